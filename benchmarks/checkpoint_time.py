"""A prefill with prefix-cache checkpoints every 1024 tokens against the same call without: 1x16384 H=32,
K = V = 128, bf16 inputs, Kimi's gate, paged fp32 pool in both layouts; CUDA-graph replay
(`bench.Timer.graph`), best of two rounds each.

    python benchmarks/checkpoint_time.py      (a CUDA device)
"""

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402

import kda  # noqa: E402

T, H, K, V, EVERY = 16384, 32, 128, 128, 1024


def main() -> None:
    dev = "cuda"
    timer = bench.Timer(warmup_ms=25, rep_ms=300)
    torch.manual_seed(0)
    q, k, v, g, beta, A_log, dt_bias = bench._tokens(1, T, H, H, dev)  # the benchmark's inputs
    gate = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    n_ck = T // EVERY
    for v_first in (False, True):
        pool = torch.zeros(1 + n_ck, H, K, V, device=dev)
        call = functools.partial(
            kda.chunk_kda, q, k, v, g, beta, cu_seqlens=torch.tensor([0, T], device=dev, dtype=torch.int32),
            cu_seqlens_cpu=[0, T], state_cache=pool, state_indices=torch.tensor([0], device=dev, dtype=torch.int32),
            has_initial_state=torch.ones(1, device=dev, dtype=torch.bool), state_v_first=v_first,
            out=torch.empty_like(v), **gate)
        ckpt = torch.arange(1, 1 + n_ck, device=dev, dtype=torch.int32).view(1, n_ck)
        with_ckpt = functools.partial(call, checkpoint_every=EVERY, checkpoint_indices=ckpt)
        variants = {"plain": call, "checkpoints": with_ckpt}
        best = {name: min(timer.graph(fn) for _ in range(2)) for name, fn in variants.items()}
        layout = "v_first" if v_first else "k_first"
        print(f"1x{T} H={H} {layout} fp32 pool: plain {best['plain']:.1f} us, checkpoints every {EVERY} "
              f"{best['checkpoints']:.1f} us, ratio {best['checkpoints'] / best['plain']:.3f}")


if __name__ == "__main__":
    main()
