"""Sweep the decode kernel's tile (BV, num_warps) on the GPU: the issue-4 shapes, graph replay.

    python scripts/tune_decode.py [--rep MS] [--configs BV:warps[:nsub[:maxnreg]],...] [--filter 'bf16|fp16']
                                  [--steady] [--no-copy]

nsub > 0 runs the one-token kernel (`_fused_recurrent_one_token_kernel`) with nsub V blocks per program.

Times `kda.fused_recurrent_kda` through `kda.bench`'s own cases and timer, with
`kda.ops.fused_recurrent._launch_config` replaced by each candidate, and prints time / floor per shape.
The winner goes into `_launch_config` by hand (with the numbers in its docstring).
"""

from __future__ import annotations

import argparse
import re
import sys

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--configs", default="8:1,16:1,16:2,32:1,32:2,32:4,64:2,64:4", help="BV:warps,...")
    p.add_argument("--filter", default="", help="regex on the decode case names")
    p.add_argument("--steady", action="store_true", help="time with kda.bench's Timer.steady (8 back-to-back "
                   "calls over 4 disjoint slot sets) instead of one graph replay under do_bench")
    p.add_argument("--no-copy", action="store_true", help="skip the same-bytes copy rows")
    args = p.parse_args()

    import triton

    from kda import bench
    from kda.ops import fused_recurrent as fr

    timer = bench.Timer(warmup_ms=25, rep_ms=args.rep)
    bw = bench.measure_bandwidth(timer, 2.0)
    cases = {c.name: c for c in bench.all_cases() if c.group == "decode"}
    wanted = [n for n in cases if "N=1 " not in n and re.search(args.filter, n)]
    original = fr._launch_config
    # (BV, num_warps[, nsub[, maxnreg]]) for the V-first [V, K] plane at K = 128; nsub > 0: the one-token
    # kernel with nsub blocks per program (the bench's decode calls are dense, T = 1)
    candidates = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (2 GiB); cells: graph us (x floor)")
    # A device copy of the same bytes (half read, half written) at each shape: what a kernel that only
    # moves the state could do at that size, launch and ramp included (the floor assumes the 2 GiB rate).
    for name in ([] if args.no_copy else wanted):
        n = bench.floor_bytes(cases[name]) // 8
        src = torch.empty(n, dtype=torch.float32, device="cuda").normal_()
        dst = torch.empty_like(src)
        t = timer.bench(lambda d=dst, x=src: d.copy_(x))
        floor_us = bench.floor_bytes(cases[name]) / bw * 1e6
        print(f"same-bytes copy for {name}: {t:.1f} us ({t / floor_us:.2f} x floor)")
    print("| BV, warps, nsub, maxnreg | " + " | ".join(wanted) + " |")
    print("|---" * (len(wanted) + 1) + "|")
    for BV, warps, *extra in candidates:
        nsub = extra[0] if extra else 0
        maxnreg = extra[1] if len(extra) > 1 else None
        cells = []
        for name in wanted:
            case = cases[name]

            def cfg(K, V, v_first, state_bytes=4, one_token=False, BV=BV, warps=warps, nsub=nsub, maxnreg=maxnreg):
                return fr.LaunchConfig(max(16, triton.next_power_of_2(K)), BV, warps,
                                       nsub=nsub if one_token else 0, maxnreg=maxnreg)

            fr._launch_config = cfg
            try:
                kda_call, _fla, _cmp = bench.build(case, None, {})
                t = timer.steady(kda_call.rotations) if args.steady else timer.graph(kda_call)
                cells.append(f"{t:.1f} ({t / (bench.floor_bytes(case) / bw * 1e6):.2f})")
            except Exception as e:  # a tile that does not compile or fit: say so, go on
                cells.append(f"error {type(e).__name__}")
            finally:
                fr._launch_config = original
            torch.cuda.synchronize()
        print(f"| {BV}, {warps}, {nsub}, {maxnreg} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
