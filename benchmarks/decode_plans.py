"""Decode plans on K-first (or V-first) pools: steady per-call time (`bench.Timer.steady`: one graph of 8 calls over 4
disjoint slot sets of a pool of 4N slots, a random permutation as in `bench.py`, read-only L2 flush between
replays) of `fused_recurrent_kda` under the loop kernel and the one-token kernel at several BV, warps and NSUB,
fp32 and bf16 pools, dense `[N, 1]` and varlen with host bounds; H = 12, K = V = 128, bf16 inputs, Kimi's gate.
The floor: the state read and written once plus the inputs and outputs, over the measured copy bandwidth. This is how
`kda.plan.decode_plan`'s K-first one-token choice was made (docs/performance.md). Recorded calls
(`kda.replay`) are cleared per plan.

    python benchmarks/decode_plans.py [PLAN NAME ...] [--pools fp32,bf16,fp16,fp32-1024,..] [--consecutive]
        [--layout k_first|v_first] [--sr] [--dense]
        (a CUDA device; names from PLANS, default all; --pools: the cases to run, default all three;
        --consecutive: each call's slots consecutive instead of a random permutation of the pool; --sr: 2-byte
        pools stored with stochastic rounding, the planned tile's `sr`, each row beside the nearest-rounded one;
        --dense: the dense `[N, 1]` rows only)
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

H, K, V = 12, 128, 128
PLANS = {
    "default": {},
    "default sequences first": dict(heads_fastest=False),
    "loop BV32 nw2": dict(nsub=0, BV=32, num_warps=2),
    "loop BV32 nw4": dict(nsub=0, BV=32, num_warps=4),
    "loop BV64 nw4": dict(nsub=0, BV=64, num_warps=4),
    "loop BV64 nw8": dict(nsub=0, BV=64, num_warps=8),
    "1tok nsub1 BV16 nw1": dict(nsub=1, BV=16, num_warps=1),
    "1tok nsub1 BV32 nw2": dict(nsub=1, BV=32, num_warps=2),
    "1tok nsub1 BV64 nw4": dict(nsub=1, BV=64, num_warps=4),
    "1tok nsub2 BV32 nw4": dict(nsub=2, BV=32, num_warps=4),
    "1tok nsub4 BV16 nw2": dict(nsub=4, BV=16, num_warps=2),
    "1tok nsub1 BV32 nw1": dict(nsub=1, BV=32, num_warps=1),
    "1tok nsub1 BV32 nw4": dict(nsub=1, BV=32, num_warps=4),
    "1tok nsub1 BV64 nw2": dict(nsub=1, BV=64, num_warps=2),
    "1tok nsub1 BV64 nw8": dict(nsub=1, BV=64, num_warps=8),
    "1tok nsub1 BV128 nw4": dict(nsub=1, BV=128, num_warps=4),
    "1tok nsub1 BV128 nw8": dict(nsub=1, BV=128, num_warps=8),
    "1tok nsub2 BV32 nw2": dict(nsub=2, BV=32, num_warps=2),
    "1tok nsub2 BV64 nw4": dict(nsub=2, BV=64, num_warps=4),
    # K-first in row chunks of kc, the plane read twice (kda.ops.fused_recurrent._one_token_k_split)
    **{f"1tok BV{bv} nw{w} kc{kc}": dict(nsub=1, BV=bv, num_warps=w, kc=kc)
       for bv, w in ((32, 1), (64, 1), (64, 2), (64, 4), (128, 1), (128, 2), (128, 4)) for kc in (16, 32, 64)},
    # K-first read once and held (kda.ops.fused_recurrent._one_token_k_held; bf16 as 32-bit words of two columns,
    # _one_token_k_packed; fp16 pools run the row chunks whatever these say)
    **{f"1tok BV{bv} nw{w} packed": dict(nsub=1, BV=bv, num_warps=w, kc=32, packed=True)
       for bv, w in ((32, 2), (32, 4), (64, 2), (64, 4), (64, 8), (128, 4), (128, 8))},
    # held under a register cap a thread (NVIDIA): more programs an SM, the same bytes each
    **{f"1tok BV{bv} nw{w} packed r{r}": dict(nsub=1, BV=bv, num_warps=w, kc=32, packed=True, maxnreg=r)
       for bv, w, r in ((64, 2, 128), (64, 4, 64), (64, 4, 80), (64, 4, 96), (64, 4, 128), (128, 4, 128),
                        (128, 4, 168), (128, 8, 64), (128, 8, 80), (128, 8, 96), (128, 8, 128))},
}
# V-first pools (--layout v_first): NSUB blocks of BV rows of K, one program a (V block, sequence, head)
V_PLANS = {
    "default": {},
    **{f"1tok nsub{n} BV{bv} nw{w}" + (f" r{r}" if r else ""): dict(nsub=n, BV=bv, num_warps=w, maxnreg=r)
       for n, bv, w, r in ((4, 8, 1, 0), (4, 8, 1, 96), (4, 8, 1, 128), (2, 8, 1, 0), (2, 16, 1, 0), (4, 16, 2, 0),
                           (4, 16, 1, 0), (1, 16, 1, 0), (4, 8, 2, 0))},
}
for _name, _over in PLANS.items():  # the other one-token plans read the whole tile once, whatever the default
    if _name != "default":  # no register cap unless the name says one
        _over.setdefault("maxnreg", 0)
    if _name.startswith("1tok nsub"):
        _over.setdefault("kc", 0)
    if " kc" in _name:
        _over.setdefault("packed", False)


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/decode_plans.py")
    p.add_argument("plans", nargs="*", help="plan names (default: all)")
    p.add_argument("--pools", default="fp32,bf16,fp32-1024", help="cases: fp32 (N = 256), bf16, fp16, fp32-1024")
    p.add_argument("--consecutive", action="store_true", help="consecutive slots instead of a random permutation")
    p.add_argument("--dense", action="store_true", help="dense rows only (no varlen)")
    p.add_argument("--sr", action="store_true", help="each plan also with stochastic rounding (2-byte pools)")
    p.add_argument("--layout", default="k_first", choices=("k_first", "v_first"), help="the pool's layout")
    args = p.parse_args()
    v_first = args.layout == "v_first"
    plans = V_PLANS if v_first else PLANS
    dev = "cuda"
    only = args.plans
    cases = {"fp32": (256, torch.float32), "bf16": (256, torch.bfloat16), "fp16": (256, torch.float16),
             "fp32-1024": (1024, torch.float32), "bf16-1024": (1024, torch.bfloat16),
             "fp16-1024": (1024, torch.float16), "bf16-64": (64, torch.bfloat16), "fp16-64": (64, torch.float16)}
    timer = bench.Timer(warmup_ms=25, rep_ms=150)
    bw = bench.measure_bandwidth(timer, 1.0)
    planner = kp.decode_plan
    for N, pool_dtype in (cases[c] for c in args.pools.split(",")):
        for varlen in (False,) if args.dense else (False, True):
            torch.manual_seed(0)
            pool = torch.randn(4 * N, H, K, V, device=dev).mul_(0.1).to(pool_dtype)
            # a random permutation of the pool as the benchmark's decode rows (or consecutive slots)
            order = torch.arange if args.consecutive else torch.randperm
            slots = order(4 * N, device=dev).to(torch.int32).view(4, N)
            q, k, v = (torch.randn(N, 1, H, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
            g = torch.randn(N, 1, H, K, device=dev)
            beta = torch.randn(N, 1, H, device=dev, dtype=torch.bfloat16)
            A_log = torch.empty(H, device=dev).uniform_(1.0, 16.0).log_()
            dt_bias = 0.5 * torch.randn(H * K, device=dev)
            kw = {}
            if varlen:
                q, k, v, g, beta = (x.reshape(1, N, *x.shape[2:]) for x in (q, k, v, g, beta))
                kw = dict(cu_seqlens=torch.arange(N + 1, device=dev, dtype=torch.int32),
                          cu_seqlens_cpu=list(range(N + 1)))
            out = torch.empty_like(v)
            state_bytes = N * H * K * V * pool.element_size()
            floor_us = (2 * state_bytes + N * (2 * H * K * 2 + H * V * 4 + H * K * 4 + H * 2 + 8)) / bw * 1e6
            roundings = (False, True) if args.sr and pool.element_size() == 2 else (False,)
            for name, over, sr in ((n, o, r) for n, o in plans.items() for r in roundings):
                if only and name not in only:
                    continue
                kp.decode_plan = (lambda call, stochastic_rounding=False, over=over:
                                  replace(planner(call, stochastic_rounding), **over))
                replay.CACHE.clear()  # a recorded kind would replay the plan it was recorded with
                calls = [functools.partial(
                    kda.fused_recurrent_kda, q, k, v, g, beta, state_cache=pool,
                    state_indices=slots[s].clone(), state_v_first=v_first,
                    use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                    A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, out=out, stochastic_rounding=sr, seed=s, **kw)
                    for s in range(4)]
                us = timer.steady(calls)
                print(f"N={N} {str(pool_dtype)[6:]} {args.layout} {'varlen' if varlen else 'dense '} "
                      f"{name + (' sr' if sr else ''):24s}: "
                      f"{us:7.1f} us  floor {floor_us:6.1f}  ratio {us / floor_us:.3f}", flush=True)
            kp.decode_plan = planner
            del pool
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
