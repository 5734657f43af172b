"""Where does decode time go at small N? Times the issue-4 decode shapes four ways, for kda, fla and a
device copy of the same bytes, so that a gap to the HBM floor can be split into what the kernel costs and
what the measurement costs.

    python scripts/decode_probe.py [--rep MS] [--filter REGEX] [--no-fla]

Timers (all CUDA-graph replay, medians, microseconds):
- `dobench`: as kda.bench's single replay under triton.testing.do_bench: before each replay a 256 MB buffer
  is zeroed, which leaves up to an L2's worth of dirty lines that the timed kernel's misses must write
  back to HBM; events around one replay;
- `clean`: before each replay an L2 flush that only reads (a sum over 256 MB: clean lines, nothing to write
  back), then events around one replay;
- `steady`: one graph holding 8 calls cycling twice over 4 disjoint slot sets of the 4N-slot pool (no call
  reads the state of the call before it from L2), time / 8, L2 flushed clean before the replay: back-to-back
  calls as in a serving step, the graph's launch cost shared by 8 calls (kda.bench's `Timer.steady`);
- `kernel`: the kernel's own duration from the torch profiler (CUPTI) during graph replay, no launch cost.
The copies move the same bytes (half read, half written): torch's copy_ (in a graph, a copy-engine node)
and a streaming Triton kernel on the SMs. An empty graph (one tiny kernel) gives the launch
cost of one replay under `dobench` and `clean`.
"""

from __future__ import annotations

import argparse
import re
import sys

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rep", type=int, default=200, help="replays per timer")
    p.add_argument("--filter", default="", help="regex on the decode case names")
    p.add_argument("--no-fla", action="store_true")
    args = p.parse_args()

    from kda import bench

    zero_buf = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    flush_clean = bench.read_only_flush()

    def flush_dirty():  # what do_bench does before each call: zero 256 MB
        zero_buf.zero_()

    capture = bench.capture_graph

    def timed(gr, flush, div=1):
        return bench.time_replays(gr, flush, div, min_reps=args.rep, budget_s=0.0)

    def kernel_time(gr, div=1):
        from torch.profiler import ProfilerActivity, profile

        reps = 20
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                flush_clean()
                gr.replay()
            torch.cuda.synchronize()
        ks = [e for e in prof.events() if e.device_type.name == "CUDA" and "reduce" not in e.name.lower()
              and "sum" not in e.name.lower()]
        total = sum(e.device_time for e in ks)
        return total / reps / div

    def all_timers(one, four):
        g1 = capture([one])
        g4 = capture(list(four) * 2)
        return (timed(g1, flush_dirty), timed(g1, flush_clean), timed(g4, flush_clean, 8), kernel_time(g1))

    timer = bench.Timer(warmup_ms=25, rep_ms=100)
    bw = bench.measure_bandwidth(timer, 2.0)
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s (2 GiB, do_bench); cells: us (x floor)")
    fla = None
    if not args.no_fla:
        try:
            fc, fd, ver = bench.load_fla()
            fla = (fc, fd)
            print(f"fla {ver}")
        except Exception as e:  # noqa: BLE001
            print(f"fla not importable: {e}")

    empty = torch.zeros(1, device="cuda")
    ge = capture([lambda: empty.add_(1)])
    print(f"empty graph (one 1-element kernel): dobench {timed(ge, flush_dirty):.1f} us, "
          f"clean {timed(ge, flush_clean):.1f} us")

    cases = [c for c in bench.all_cases() if c.group == "decode" and re.search(args.filter, c.name)]
    print("| shape | who | dobench | clean | steady | kernel |")
    print("|---|---|---|---|---|---|")
    for case in cases:
        floor_us = bench.floor_bytes(case) / bw * 1e6

        def fmt(t, floor_us=floor_us):
            return f"{t:.1f} ({t / floor_us:.2f})"

        torch.manual_seed(1)
        kda_call, fla_call, _cmp = bench.build(case, fla, {})
        rows = [("kda", kda_call)] + ([("fla", fla_call)] if fla_call is not None else [])
        for who, fn in rows:  # fn.rotations: the same call on each of the pool's 4 disjoint slot sets
            try:
                t = all_timers(fn, fn.rotations)
                print(f"| {case.name} | {who} | " + " | ".join(fmt(x) for x in t) + " |", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"| {case.name} | {who} | error {type(e).__name__}: {e} |", flush=True)
        n = bench.floor_bytes(case) // 8  # fp32 elements: half the floor's bytes read, half written
        srcs = [torch.empty(n, dtype=torch.float32, device="cuda").normal_() for _ in range(4)]
        dsts = [torch.empty_like(x) for x in srcs]
        cp = _triton_copy()
        for who, op in (("copy_", lambda d, x: d.copy_(x)), ("triton copy", lambda d, x, cp=cp: cp(x, d))):
            calls = [lambda d=d, x=x, op=op: op(d, x) for d, x in zip(dsts, srcs)]
            t = all_timers(calls[0], calls)
            print(f"| {case.name} | {who} | " + " | ".join(fmt(x) for x in t) + " |", flush=True)
        del srcs, dsts
        torch.cuda.empty_cache()
    return 0


def _triton_copy():
    """A streaming copy kernel on the SMs (16-byte accesses, 16 KiB per program): what a kernel that only
    moves the bytes achieves, launch and ramp included (a graph's copy_ node runs on the copy engine)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(src, dst, n, BLOCK: tl.constexpr):
        o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + o, tl.load(src + o, mask=o < n), mask=o < n)

    def run(src, dst):
        n = src.numel()
        _copy[(triton.cdiv(n, 4096),)](src, dst, n, BLOCK=4096, num_warps=4)

    return run


if __name__ == "__main__":
    sys.exit(main())
