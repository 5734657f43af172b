"""Speculative verify against its HBM floor: N = 256 sequences of T = 4 drafts (`--drafts`: other T), K = V = 128,
H = 12, paged pool (fp32, bf16 and fp16, V-first and K-first), steady state as the benchmark's decode table measures
it (a graph of 8 calls over 4 disjoint slot sets, a read-only L2 flush before each replay). The floor: the state read
once, the T states written, the inputs and outputs, at the measured copy bandwidth. Verify runs the loop kernel
(`_fused_recurrent_kda_kernel`); `--plans` times other tiles of it (`kda.plan.decode_plan` overridden, recorded
calls cleared per plan) and prints each one's largest output difference from the planned tile's.

    python benchmarks/verify_time.py [--plans NAME,...|all] [--pools fp32,bf16,fp16] [--layouts v_first,k_first]
        [--drafts 2,3,4] (a CUDA device)
"""

import argparse
import functools
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402

import kda  # noqa: E402
import kda.plan as kp  # noqa: E402
from kda import replay  # noqa: E402

N, H, K, V = 256, 12, 128, 128
# tiles of the loop kernel: V-first tiles are BV rows of K, K-first ones K rows of BV columns
PLANS = {
    "planned": {},
    **{f"BV{bv} nw{w}": dict(BV=bv, num_warps=w)
       for bv, w in ((8, 1), (16, 1), (16, 2), (32, 1), (32, 2), (32, 4), (64, 2), (64, 4), (64, 8))},
    # under a register cap a thread (NVIDIA): more programs an SM
    **{f"BV{bv} nw{w} r{r}": dict(BV=bv, num_warps=w, maxnreg=r)
       for bv, w, r in ((16, 1, 128), (32, 1, 168), (32, 1, 192), (32, 2, 128), (64, 4, 128))},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _layouts(text: str) -> list[bool]:
    """--layouts as v_first flags; a name other than v_first or k_first refused."""
    names = text.split(",")
    if not set(names) <= {"v_first", "k_first"}:
        raise argparse.ArgumentTypeError(f"{text!r}: v_first and/or k_first")
    return [name == "v_first" for name in names]


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/verify_time.py")
    p.add_argument("--plans", default="planned", help="comma list of PLANS names, or all (default: planned)")
    p.add_argument("--pools", default="fp32,bf16,fp16", help="pool dtypes (default fp32,bf16,fp16)")
    p.add_argument("--layouts", default="v_first,k_first", type=_layouts, help="pool layouts (default v_first,k_first)")
    p.add_argument("--drafts", default="4", help="comma list of drafts a sequence, T (default 4)")
    args = p.parse_args()
    names = list(PLANS) if args.plans == "all" else args.plans.split(",")
    dev = "cuda"
    timer = bench.Timer(warmup_ms=25, rep_ms=200)
    bw = bench.measure_bandwidth(timer, 1.0)
    planner = kp.decode_plan
    for T in (int(t) for t in args.drafts.split(",")):
        torch.manual_seed(0)
        q, k, v, g, beta, A_log, dt_bias = bench._tokens(1, N * T, H, H, dev)  # the benchmark's inputs
        gate = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                    A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
        cu = torch.arange(0, N * T + 1, T, device=dev, dtype=torch.int32)
        bounds = list(range(0, N * T + 1, T))
        out = torch.empty_like(v)
        for v_first in args.layouts:
            for pool_name in args.pools.split(","):
                pool_dtype = DTYPES[pool_name]
                plane = (H, V, K) if v_first else (H, K, V)
                pool = torch.randn(4 * N * T, *plane, device=dev).mul_(0.1).to(pool_dtype)
                fresh = pool.clone()
                state_b = N * H * K * V * pool.element_size()
                token_b = N * T * (2 * H * K * 2 + H * V * 2 + H * K * 4 + H * 2 + H * V * 2)
                floor_us = (state_b * (1 + T) + token_b + N * T * 4 * 2) / bw * 1e6
                layout = "v_first" if v_first else "k_first"
                first = None
                for name in names:
                    over = PLANS[name]
                    kp.decode_plan = (lambda call, stochastic_rounding=False, device=None, over=over:
                                      replace(planner(call, stochastic_rounding, device), **over))
                    replay.CACHE.clear()  # a recorded call would replay the plan it was recorded with
                    calls = []
                    for s in range(4):  # disjoint slot sets; each sequence reads the state of its second draft
                        idx = (s * N * T + torch.arange(N * T, device=dev, dtype=torch.int32)).view(N, T)
                        acc = torch.full((N,), 2, device=dev, dtype=torch.int32)
                        calls.append(functools.partial(
                            kda.fused_recurrent_kda, q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=bounds,
                            state_cache=pool, state_indices=idx, num_accepted_tokens=acc, state_v_first=v_first,
                            out=out, **gate))
                    try:
                        pool.copy_(fresh)
                        calls[0]()
                        torch.cuda.synchronize()
                    except Exception as e:  # a tile the kernel cannot take: said, and the next one timed
                        print(f"verify N={N} T={T} {layout} {pool_name} {name}: not run ({type(e).__name__}: {e})")
                        continue
                    o = out.float().clone()
                    first = o if first is None else first
                    diff = (o - first).abs().max().item()
                    us = timer.steady(calls)
                    print(f"verify N={N} T={T} {layout} {pool_name} {name}: {us:.1f} us, floor {floor_us:.1f} us "
                          f"({bw / 1e12:.2f} TB/s copy), ratio {us / floor_us:.2f}, output max diff {diff:.2e}",
                          flush=True)
                kp.decode_plan = planner
                del pool, fresh, calls
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
