"""Where a prefill call stops: each step of `chunk_kda` at the benchmark's inputs printed as it ends (the first
call, replays on the default stream, a call on another stream, a graph captured and replayed), with the walk's
give-up flags read before the resume launch of each call that takes the full path (so replays and full-path calls
are told apart), and every thread's stack dumped when a step takes longer than `--hang-s` seconds (then it exits).

    python benchmarks/replay_probe.py [--tree DIR] [--shapes 1x4096x12,1x16384x12] [--hang-s 30] [--look]
                                      [--mode plain|record-on-side|no-pdl|side-high]

`--tree`: the package to import (`tree_ab.py`'s trees; default this checkout). Modes, for the call on another
stream: `plain` (a torch stream, replaying what the default stream recorded), `record-on-side` (recorded calls
cleared first: the call on the other stream records), `no-pdl` (`kda.replay._programmatic` off: replays keep the
recorded two-stream order), `side-high` (the other stream at high priority). `--look`: each step waited for by
polling, and where it takes longer than `--hang-s`, the streams still holding work, the walk's counters and flags in
the replay's workspace, and cuda-gdb's kernels, blocks and warps (the GPU machine has it); then it exits with 3.
"""

import argparse
import faulthandler
import inspect
import os
import subprocess
import sys
import time

p = argparse.ArgumentParser(prog="python benchmarks/replay_probe.py")
p.add_argument("--tree", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
p.add_argument("--shapes", default="1x4096x12,1x16384x12")
p.add_argument("--hang-s", type=float, default=30.0)
p.add_argument("--mode", default="plain", choices=("plain", "record-on-side", "no-pdl", "side-high"))
p.add_argument("--look", action="store_true",
               help="where the call on another stream does not finish: which streams still hold work, the counters "
                    "and flags of its workspace, and cuda-gdb's view of the kernels on the GPU")
a = p.parse_args()
tree = os.path.abspath(a.tree)
sys.path[:0] = [tree, os.path.join(tree, "benchmarks"), os.path.dirname(os.path.abspath(__file__))]
import bench  # noqa: E402  (the tree's)
import torch  # noqa: E402
import tree_ab  # noqa: E402  (this checkout's: the calls it times)
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

import kda  # noqa: E402
import kda.replay  # noqa: E402
from kda.ops import chunk, overlap  # noqa: E402

flags = []
plain_walk = chunk._plain_walk
held = {}  # the walk's counters (storage, words, groups, HV, W) and the last replay's workspace buffer (`--look`)


signature = inspect.signature(plain_walk)


def walk(*args, **kw):
    """`_plain_walk`, the flags of the launch before read (one a walk program, after the counters) where it is the
    resume launch (trees before the resume launch have none)."""
    w = signature.bind(*args, **kw).arguments
    if w["ready"] is not None:
        c, plan = w["call"], w["plan"]
        held["ready"] = (w["ready"].untyped_storage().data_ptr(), w["ready"].numel(),
                         chunk.cdiv(chunk.cdiv(c.T, plan.BT), plan.wait_chunks), c.HV, plan.wait_chunks)
    if w.get("resume"):
        programs = -(-w["call"].V // w["plan"].walk_BV) * w["call"].HV * w["seqs"]
        flags.append(w["ready"][-programs:].clone())
    return plain_walk(*args, **kw)


chunk._plain_walk = walk


class _Torch:
    """`kda.replay`'s torch, keeping the one workspace buffer each replay allocates."""

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *a, **k):
        x = torch.empty(*a, **k)
        if k.get("dtype") is torch.uint8:
            held["ws"] = x
        return x


remember = kda.replay.remember


def remembered(key, tensors, record, result, bounds=None):
    """`remember`, noting where the walk's counters lie in a replay's buffer (its regions, as `remember` places
    them: one per buffer of the call's own, in the order the launches name them)."""
    roles = [x for x in (*tensors[:kda.replay._OUT], *result) if x is not None]
    ids, storages = {id(x) for x in roles}, {x.untyped_storage().data_ptr() for x in roles}
    regions, size = {}, 0
    for op in record:
        for a in op[2] if op[0] != "wait" else ():
            b = a.base if isinstance(a, TensorDescriptor) else a
            if isinstance(b, torch.Tensor) and id(b) not in ids and b.untyped_storage().data_ptr() not in storages:
                sp = b.untyped_storage().data_ptr()
                if sp not in regions:
                    regions[sp] = size
                    size += -(-b.untyped_storage().nbytes() // kda.replay._ALIGN) * kda.replay._ALIGN
    if "ready" in held:
        held["offset"] = regions.get(held["ready"][0])
    return remember(key, tensors, record, result, bounds)


if a.look:
    kda.replay.torch = _Torch()
    kda.replay.remember = remembered


def look(caller):
    """What a call that does not finish left: the streams with work queued, the counters and flags of its
    workspace (read on a stream of its own), cuda-gdb's kernels, blocks and one warp's place."""
    streams = {"caller": caller, "default": torch.cuda.default_stream()}
    streams.update({f"side of {k[1]:#x}": s for k, s in overlap._SIDE_STREAMS.items()})
    say("streams with work still queued:", [n for n, s in streams.items() if not s.query()])
    say(subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader"],
                       capture_output=True, text=True).stdout.strip(), "GPU utilization")
    if "offset" in held and held.get("offset") is not None and "ws" in held:
        _, words, groups, HV, W = held["ready"]
        reader = torch.cuda.Stream()
        host = torch.empty(words, dtype=torch.int32, pin_memory=True)
        with torch.cuda.stream(reader):
            src = held["ws"][held["offset"]:held["offset"] + 4 * words].view(torch.int32)
            host.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(reader)
        t0 = time.time()
        while not done.query() and time.time() - t0 < 5:
            time.sleep(0.01)
        if done.query():
            counts = host[:groups * HV].view(groups, HV)
            say(f"counters ({groups} groups of {W} chunks x {HV} heads): per head, the groups counted:",
                (counts >= W).sum(0).tolist(), "min", int(counts.min()), "max", int(counts.max()),
                "; flags set:", int(host[groups * HV:].count_nonzero()), "of", words - groups * HV)
        else:
            say("the workspace read did not finish in 5 s")
    gdb = subprocess.run(["timeout", "60", "cuda-gdb", "-q", "-batch", "-p", str(os.getpid()),
                          "-ex", "info cuda kernels", "-ex", "info cuda blocks", "-ex", "info cuda warps",
                          "-ex", "x/8i $pc"], capture_output=True, text=True)
    say("cuda-gdb:\n" + "\n".join((gdb.stdout + gdb.stderr).splitlines()[:120]))
    os._exit(3)


def finish(caller):
    """Wait for the device; with `--look`, `look` where `caller` and the others take longer than --hang-s."""
    if not a.look:
        torch.cuda.synchronize()
        return
    t0 = time.time()
    while time.time() - t0 < a.hang_s:
        if all(s.query() for s in (caller, torch.cuda.default_stream(), *overlap._SIDE_STREAMS.values())):
            return
        time.sleep(0.01)
    look(caller)
if a.mode == "no-pdl":
    kda.replay._programmatic = lambda order, launches: order


def say(*x):
    print(f"[{os.path.basename(tree)} {a.mode} {time.strftime('%H:%M:%S')}]", *x, file=sys.stderr, flush=True)


def same(x, y):
    return bool(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]))


for shape in a.shapes.split(","):
    faulthandler.dump_traceback_later(a.hang_s + (120 if a.look else 0), exit=True)
    name, call = tree_ab.row(bench, kda, tuple(int(x) for x in shape.split("x")), "cuda")
    t0 = time.time()
    first = call()
    finish(torch.cuda.current_stream())
    say(name, f"first call {time.time() - t0:.1f} s, flags set:", [int(f.count_nonzero()) for f in flags])
    t0 = time.time()
    for _ in range(5):
        again = call()
    finish(torch.cuda.current_stream())
    full = len(flags)  # each call through the full path (not a replay) adds its flags
    say(name, f"5 calls on the default stream, {(time.time() - t0) / 5 * 1e6:.0f} us each, same bits",
        same(first, again), f"(full-path calls so far: {full}, recorded kinds: {len(kda.replay.CACHE)})")
    if a.mode == "record-on-side":
        kda.replay.CACHE.clear()
    side = torch.cuda.Stream(priority=-1 if a.mode == "side-high" else 0)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = call()
    finish(side)
    say(name, "a call on another stream finished, same bits", same(first, other),
        "(a replay)" if len(flags) == full else "(the full path)")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    finish(torch.cuda.current_stream())
    say(name, "captured and replayed, same bits", same(first, captured))
faulthandler.cancel_dump_traceback_later()
say("all done")
