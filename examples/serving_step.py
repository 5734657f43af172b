"""A serving loop over paged KDA state pools, emulated at tiny sizes and checked against the oracle.

What a serving engine does with `kda` each step, in the open:

- requests arrive, are admitted when a pool slot is free, and free their slot when finished (the slot is
  then filled with NaN: the next request's `has_initial_state=False` must never read it);
- a long prompt is prefilled in chunks across steps (a token budget per step), its state kept in its slot;
- a step holding only one-token sequences is a decode step: one `fused_recurrent_kda` varlen call with
  `cu_seqlens_cpu` = 0, 1, ..., N (the one-token kernel), padded to a fixed batch with a padding slot
  (`state_indices = -1`: no read, no write, zero output rows), as a CUDA-graph bucket would be;
- a step holding decode tokens and prefill chunks together is a mixed step: one `chunk_kda` varlen call;
- every layer of the step uses the same bounds, slots and flags (built once per step); here layer 0 keeps
  an fp32 pool and layer 1 a bf16 pool.

At every step each request's outputs and its slot's state are compared with `kda_reference.recurrent_kda`
(float64) run on the request's full token history: fp32 within 1e-4 relative; bf16 within its rounding
(each store of the state rounds it by at most 2^-9 relative, so after n stores the error stays within
n * 2^-8, a 2x margin). Runs on CPU under the Triton interpreter (set automatically without a GPU; its run
time: README) or on a GPU:

    python examples/serving_step.py [--steps N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kda (triton) is imported

# the interpreter evaluates masked-off lanes too, where exp2 of an unused value may overflow (numpy warns);
# those lanes are never stored, and every result below is checked against the oracle
warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)

import kda  # noqa: E402
import kda_reference as ref  # noqa: E402

H = HV = 2
K = V = 16
SLOTS = 3  # pool slots: a fourth request waits for one to free
DECODE_BUCKET = 4  # decode batches are padded to this size (padding slot -1)
PREFILL_BUDGET = 24  # tokens of prefill per step
POOL_DTYPES = (torch.float32, torch.bfloat16)  # layer 0, layer 1
KW = dict(use_qk_l2norm_in_kernel=True, state_v_first=True)  # the layers' gate and pool layout


@dataclass
class Request:
    rid: str
    arrive: int  # step at which it arrives
    prompt: int  # tokens to prefill
    gen: int  # decode steps after the prompt
    inputs: list = field(default_factory=list)  # per layer: (q, k, v, g, beta) for every token [L, ...]
    slot: int = -1
    done_tokens: int = 0  # tokens whose state is in the slot
    stores: int = 0  # times the slot was written (the bf16 bound)

    @property
    def total(self) -> int:
        return self.prompt + self.gen

    def next_len(self, budget: int) -> int:
        """Tokens this request runs this step: a prefill chunk within the budget, or one decode token."""
        if self.done_tokens < self.prompt:
            return min(self.prompt - self.done_tokens, budget)
        return 1


def token_inputs(n: int, gen: torch.Generator) -> tuple:
    """Random per-token inputs (stand-ins for one layer's projections): raw q, k; log-decay g; beta."""
    return (torch.randn(n, H, K, generator=gen), torch.randn(n, H, K, generator=gen),
            torch.randn(n, HV, V, generator=gen), -0.3 * torch.rand(n, HV, K, generator=gen),
            torch.rand(n, HV, generator=gen))


def oracle(req: Request, layer: int, upto: int):
    """recurrent_kda (float64) on the request's tokens [0, upto): outputs [upto, HV, V], state [HV, V, K]."""
    x = [t[:upto].unsqueeze(0).double() for t in req.inputs[layer]]
    o, s = ref.recurrent_kda(*x, output_final_state=True, allow_float64=True, **KW)
    return o[0], s[0]


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double().cpu(), y.double().cpu()
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def run(steps: int, device: str) -> int:
    gen = torch.Generator().manual_seed(0)
    requests = [Request("A", 0, 20, 4), Request("B", 0, 5, 6), Request("C", 2, 30, 3), Request("D", 3, 3, 3),
                Request("E", 6, 14, 2)]
    for r in requests:
        r.inputs = [token_inputs(r.total, gen) for _ in POOL_DTYPES]
    pools = [torch.full((SLOTS, HV, V, K), float("nan"), dtype=dt, device=device) for dt in POOL_DTYPES]
    free, waiting, running, failures = list(range(SLOTS)), list(requests), [], 0

    for step in range(steps):
        # admission: arrived requests take free slots (the slot still holds NaN or a finished request's state)
        for r in [r for r in waiting if r.arrive <= step]:
            if free:
                r.slot = free.pop(0)
                waiting.remove(r)
                running.append(r)
        if not running:
            print(f"step {step:2d}: idle")
            continue

        # the batch: decode tokens first, then prefill chunks within the budget
        budget, batch = PREFILL_BUDGET, []
        for r in sorted(running, key=lambda r: r.done_tokens < r.prompt):
            n = r.next_len(budget)
            if n > 0:
                batch.append((r, n))
                budget -= n if r.done_tokens < r.prompt else 0
        decoding = [r.done_tokens >= r.prompt for r, _ in batch]
        decode_only = all(decoding)
        kind = "decode" if decode_only else ("mixed" if any(decoding) else "prefill")
        pad = DECODE_BUCKET - len(batch) if decode_only else 0
        lens = [n for _, n in batch] + [1] * pad
        bounds = [0]
        for n in lens:
            bounds.append(bounds[-1] + n)
        # shared by every layer of the step
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        slots = torch.tensor([r.slot for r, _ in batch] + [-1] * pad, dtype=torch.int32, device=device)
        has = torch.tensor([r.done_tokens > 0 for r, _ in batch] + [False] * pad, device=device)

        t0, worst = time.perf_counter(), []
        for layer, pool in enumerate(pools):
            parts = [[t[r.done_tokens:r.done_tokens + n] for t in r.inputs[layer]] for r, n in batch]
            parts += [[t[:1] for t in token_inputs(1, gen)] for _ in range(pad)]
            q, k, v, g, beta = (torch.cat(xs).unsqueeze(0).to(device) for xs in zip(*parts))
            call = dict(cu_seqlens=cu, cu_seqlens_cpu=bounds, state_cache=pool, state_indices=slots,
                        has_initial_state=has, **KW)
            if decode_only:
                o, _ = kda.fused_recurrent_kda(q, k, v, g, beta, **call)
            else:
                o, _ = kda.chunk_kda(q, k, v, g, beta, **call)
            # the check: each request against the oracle on its whole history; padding rows are zero
            for i, (r, n) in enumerate(batch):
                o_ref, s_ref = oracle(r, layer, r.done_tokens + n)
                e_o = rel(o[0, bounds[i]:bounds[i + 1]], o_ref[-n:])
                e_s = rel(pool[r.slot], s_ref)
                tol = 1e-4 if pool.dtype == torch.float32 else (r.stores + 1) * 2.0 ** -8
                worst.append((max(e_o, e_s) / tol, layer, r.rid, e_o, e_s, tol))
            if pad and o[0, bounds[len(batch)]:].abs().max().item() != 0.0:
                worst.append((float("inf"), layer, "padding", float("nan"), float("nan"), 0.0))

        # bookkeeping: advance, finish, free (and poison) slots
        for r, n in batch:
            r.done_tokens += n
            r.stores += 1
        for r in [r for r in running if r.done_tokens == r.total]:
            running.remove(r)
            for pool in pools:
                pool[r.slot] = float("nan")
            free.append(r.slot)

        ok = max(w[0] for w in worst) <= 1.0
        failures += not ok
        seqs = " ".join(f"{r.rid}:{n}" for r, n in batch) + (" pad" * pad)
        errs = []
        for layer, dt in enumerate(POOL_DTYPES):
            _, _, rid, e_o, e_s, tol = max(w for w in worst if w[1] == layer)
            errs.append(f"{str(dt)[6:]} pool: worst {rid} out {e_o:.1e} state {e_s:.1e} (tol {tol:.0e})")
        print(f"step {step:2d} {kind:7s} [{seqs}] bounds={bounds}  " + "; ".join(errs)
              + f"  {'ok' if ok else 'FAIL'} {time.perf_counter() - t0:.1f} s")
    print("all steps within tolerance" if not failures else f"{failures} step(s) out of tolerance")
    return 1 if failures else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    return run(args.steps, args.device)


if __name__ == "__main__":
    sys.exit(main())
