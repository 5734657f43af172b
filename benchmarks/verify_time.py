"""Speculative verify against its HBM floor: N = 256 sequences of T = 4 drafts, K = V = 128, H = 12, paged pool
(fp32 and bf16, V-first and K-first), steady state as the benchmark's decode table measures it (a graph of
8 calls over 4 disjoint slot sets, a read-only L2 flush before each replay). The floor: the state read
once, the T states written, the inputs and outputs, at the measured copy bandwidth.

    python benchmarks/verify_time.py      (a CUDA device)
"""

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402

import kda  # noqa: E402

N, T, H, K, V = 256, 4, 12, 128, 128


def main() -> None:
    dev = "cuda"
    timer = bench.Timer(warmup_ms=25, rep_ms=200)
    bw = bench.measure_bandwidth(timer, 1.0)
    torch.manual_seed(0)
    q, k, v, g, beta, A_log, dt_bias = bench._tokens(1, N * T, H, H, dev)  # the benchmark's inputs
    gate = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    cu = torch.arange(0, N * T + 1, T, device=dev, dtype=torch.int32)
    bounds = list(range(0, N * T + 1, T))
    out = torch.empty_like(v)
    for v_first in (True, False):
        for pool_dtype in (torch.float32, torch.bfloat16):
            plane = (H, V, K) if v_first else (H, K, V)
            pool = torch.randn(4 * N * T, *plane, device=dev).mul_(0.1).to(pool_dtype)
            calls = []
            for s in range(4):  # disjoint slot sets; each sequence reads the state of its second draft
                idx = (s * N * T + torch.arange(N * T, device=dev, dtype=torch.int32)).view(N, T)
                acc = torch.full((N,), 2, device=dev, dtype=torch.int32)
                calls.append(functools.partial(
                    kda.fused_recurrent_kda, q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=bounds, state_cache=pool,
                    state_indices=idx, num_accepted_tokens=acc, state_v_first=v_first, out=out,
                    **gate))
            for c in calls:
                c()
            torch.cuda.synchronize()
            us = timer.steady(calls)
            state_b = N * H * K * V * pool.element_size()
            token_b = N * T * (2 * H * K * 2 + H * V * 2 + H * K * 4 + H * 2 + H * V * 2)
            floor_us = (state_b * (1 + T) + token_b + N * T * 4 * 2) / bw * 1e6
            layout = "v_first" if v_first else "k_first"
            print(f"verify N={N} T={T} {layout} {str(pool_dtype)[6:]}: {us:.1f} us, floor {floor_us:.1f} us "
                  f"({bw / 1e12:.2f} TB/s copy), ratio {us / floor_us:.2f}")
            del pool, calls
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
