"""From "I have a model" to a state-dtype verdict: capture a model's KDA calls, then replay them.

A small model with two KDA layers (random weights, Kimi's gate: raw gate projections through
`A_log`, `dt_bias` and the lower bound -5 in the kernel; q, k L2-normalised and beta's sigmoid in the
kernel) serves a batch of prompts through a paged fp32 state pool: one varlen `kda.chunk_kda` prefill,
then one `kda.fused_recurrent_kda` decode call per step and layer, each step's input made from the last
output (a stand-in for sampling a token and embedding it). Under `kda.accuracy.capture` every call is
recorded; the replay then tells whether the same activations survive an fp16 or bf16 pool:

    python examples/capture_model.py --capture captures/example          # the model, recorded
    python -m kda.accuracy --inputs captures/example                     # the replay, per layer and overall
    cat accuracy_reports/inputs-example/report.md                        # the verdict

In your own model only the `with kda.accuracy.capture(...) as cap:` block and the `cap.step()` per forward
are new (or `layers_per_forward=`, as here). Runs on CPU under the Triton interpreter (set automatically
without a GPU) or on a GPU.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kda (triton) is imported

# the interpreter evaluates masked-off lanes too, where exp2 of an unused value may overflow (numpy warns)
warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)

import kda  # noqa: E402
import kda.accuracy  # noqa: E402

LOWER_BOUND = -5.0


class KDALayer:
    """One KDA layer: projections of the hidden state to q, k, v, the raw gate and beta's logit, the KDA
    call (Kimi's gate parameterisation in the kernel), an output projection and a residual."""

    def __init__(self, D: int, H: int, K: int, gen: torch.Generator, device: str):
        def w(*shape, scale=1.0):
            return (scale * torch.randn(*shape, generator=gen) / math.sqrt(shape[0])).to(device)

        self.H, self.K = H, K
        self.Wq, self.Wk, self.Wv, self.Wg = w(D, H * K), w(D, H * K), w(D, H * K), w(D, H * K)
        self.Wb, self.Wo = w(D, H), w(H * K, D, scale=0.5)
        self.A_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen)).to(device)  # Kimi's A in [1, 16]
        self.dt_bias = (0.1 * torch.randn(H * K, generator=gen)).to(device)

    def __call__(self, x: torch.Tensor, decode: bool, **seqs) -> torch.Tensor:
        T, H, K = x.shape[1], self.H, self.K
        q, k, v, g = ((x @ W).view(1, T, H, K) for W in (self.Wq, self.Wk, self.Wv, self.Wg))
        beta = (x @ self.Wb).view(1, T, H)
        fn = kda.fused_recurrent_kda if decode else kda.chunk_kda
        o, _ = fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=LOWER_BOUND,
                  state_v_first=True, **seqs)
        return x + o.reshape(1, T, H * K) @ self.Wo


def run_model(prompts=(24, 13), steps: int = 8, *, D: int = 32, H: int = 2, K: int = 16, seed: int = 0,
              device: str = "cpu", cap=None) -> list[torch.Tensor]:
    """Prefill the prompts (random embeddings) through both layers, then `steps` decode steps; returns the
    hidden states after the prefill and after each step. `cap`: an open capture, told where forwards end
    (not needed with `layers_per_forward`, shown here for a model that cannot count its layers)."""
    gen = torch.Generator().manual_seed(seed)
    layers = [KDALayer(D, H, K, gen, device) for _ in range(2)]
    N = len(prompts)
    pools = [torch.full((N + 1, H, K, K), float("nan"), device=device) for _ in layers]  # one spare slot
    slots = torch.arange(N, 0, -1, dtype=torch.int32, device=device)  # sequence n in slot N - n
    bounds = [0]
    for n in prompts:
        bounds.append(bounds[-1] + n)
    x = torch.randn(1, bounds[-1], D, generator=gen).to(device)
    seqs = dict(cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device), cu_seqlens_cpu=bounds,
                state_indices=slots, has_initial_state=torch.zeros(N, dtype=torch.bool, device=device))
    outputs = []
    for layer, pool in zip(layers, pools):
        x = layer(x, decode=False, state_cache=pool, **seqs)
    outputs.append(x)
    one = list(range(N + 1))
    seqs = dict(cu_seqlens=torch.tensor(one, dtype=torch.int32, device=device), cu_seqlens_cpu=one,
                state_indices=slots)
    for _ in range(steps):
        if cap is not None:
            cap.step()
        x = torch.tanh(x[:, [b - 1 for b in bounds[1:]]] if x.shape[1] != N else x)  # the next token's input
        for layer, pool in zip(layers, pools):
            x = layer(x, decode=True, state_cache=pool, **seqs)
        outputs.append(x)
    return outputs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--capture", metavar="DIR", default=None, help="record the KDA calls into DIR (default: just run)")
    p.add_argument("--prompts", default="24,13", help="prompt lengths, comma-separated (default 24,13)")
    p.add_argument("--steps", type=int, default=16, help="decode steps after the prefill (default 16)")
    p.add_argument("--max-tokens", type=int, default=1 << 20, help="the capture's token budget")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    prompts = tuple(int(n) for n in args.prompts.split(","))
    if args.capture is None:
        outputs = run_model(prompts, args.steps, device=args.device)
    else:
        with kda.accuracy.capture(args.capture, max_tokens=args.max_tokens, layers_per_forward=2) as cap:
            outputs = run_model(prompts, args.steps, device=args.device)
        print(f"captured {cap.calls_recorded} of {cap.calls_seen} KDA calls ({cap.tokens} tokens, {cap.bytes} bytes) "
              f"into {args.capture}" + (f"; stopped: {cap.stopped['reason']}" if cap.stopped else ""))
    print(f"ran {len(prompts)} prompts ({', '.join(map(str, prompts))} tokens) and {args.steps} decode steps; "
          f"last hidden state norm {outputs[-1].double().norm().item():.6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
