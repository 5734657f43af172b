"""Where a prefill call stops: each step of `chunk_kda` at the benchmark's inputs printed as it ends (the first
call, replays on the default stream, a call on another stream, a graph captured and replayed), with the walk's
give-up flags read before the resume launch of each call that takes the full path (so replays and full-path calls
are told apart), and every thread's stack dumped when a step takes longer than `--hang-s` seconds (then it exits).

    python benchmarks/replay_probe.py [--tree DIR] [--shapes 1x4096x12,1x16384x12] [--hang-s 30]
                                      [--mode plain|record-on-side|no-pdl|side-high]

`--tree`: the package to import (`tree_ab.py`'s trees; default this checkout). Modes, for the call on another
stream: `plain` (a torch stream, replaying what the default stream recorded), `record-on-side` (recorded calls
cleared first: the call on the other stream records), `no-pdl` (`kda.replay._programmatic` off: replays keep the
recorded two-stream order), `side-high` (the other stream at high priority).
"""

import argparse
import faulthandler
import inspect
import os
import sys
import time

p = argparse.ArgumentParser(prog="python benchmarks/replay_probe.py")
p.add_argument("--tree", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
p.add_argument("--shapes", default="1x4096x12,1x16384x12")
p.add_argument("--hang-s", type=float, default=30.0)
p.add_argument("--mode", default="plain", choices=("plain", "record-on-side", "no-pdl", "side-high"))
a = p.parse_args()
tree = os.path.abspath(a.tree)
sys.path[:0] = [tree, os.path.join(tree, "benchmarks"), os.path.dirname(os.path.abspath(__file__))]
import bench  # noqa: E402  (the tree's)
import torch  # noqa: E402
import tree_ab  # noqa: E402  (this checkout's: the calls it times)

import kda  # noqa: E402
import kda.replay  # noqa: E402
from kda.ops import chunk  # noqa: E402

flags = []
plain_walk = chunk._plain_walk


signature = inspect.signature(plain_walk)


def walk(*args, **kw):
    """`_plain_walk`, the flags of the launch before read (one a walk program, after the counters) where it is the
    resume launch (trees before the resume launch have none)."""
    w = signature.bind(*args, **kw).arguments
    if w.get("resume"):
        programs = -(-w["call"].V // w["plan"].walk_BV) * w["call"].HV * w["seqs"]
        flags.append(w["ready"][-programs:].clone())
    return plain_walk(*args, **kw)


chunk._plain_walk = walk
if a.mode == "no-pdl":
    kda.replay._programmatic = lambda order, launches: order


def say(*x):
    print(f"[{os.path.basename(tree)} {a.mode} {time.strftime('%H:%M:%S')}]", *x, file=sys.stderr, flush=True)


def same(x, y):
    return bool(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]))


for shape in a.shapes.split(","):
    faulthandler.dump_traceback_later(a.hang_s, exit=True)
    name, call = tree_ab.row(bench, kda, tuple(int(x) for x in shape.split("x")), "cuda")
    t0 = time.time()
    first = call()
    torch.cuda.synchronize()
    say(name, f"first call {time.time() - t0:.1f} s, flags set:", [int(f.count_nonzero()) for f in flags])
    t0 = time.time()
    for _ in range(5):
        again = call()
    torch.cuda.synchronize()
    full = len(flags)  # each call through the full path (not a replay) adds its flags
    say(name, f"5 calls on the default stream, {(time.time() - t0) / 5 * 1e6:.0f} us each, same bits",
        same(first, again), f"(full-path calls so far: {full}, recorded kinds: {len(kda.replay.CACHE)})")
    if a.mode == "record-on-side":
        kda.replay.CACHE.clear()
    side = torch.cuda.Stream(priority=-1 if a.mode == "side-high" else 0)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = call()
    torch.cuda.synchronize()
    say(name, "a call on another stream finished, same bits", same(first, other),
        "(a replay)" if len(flags) == full else "(the full path)")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    say(name, "captured and replayed, same bits", same(first, captured))
faulthandler.cancel_dump_traceback_later()
say("all done")
