"""Compile, on a machine without a GPU, the kernels a `tree_ab.py` call will launch on the H200, into Triton's cache,
so that the device call finds them compiled (`scripts/triton_cache.py pack` then carries them).

    TRITON_CACHE_DIR=DIR python benchmarks/warm_cache.py [--shapes 1x16384x32,...,varlen] [--bench]
                                                         [--plan-device sm_80] TREE [TREE ...]

Run it under the GPU machine's Python and Triton (3.12, Triton 3.6.0: the cache key holds Triton's build and its
Python extension), from this checkout; each TREE (as `tree_ab.py` takes them) in its own process, its `kda` first on
the path. Each call is built by `tree_ab.py`'s own `row` and `inputs` (its shapes and accuracy calls; with `--bench`
every row of the tree's `bench.py`, by its `build`) on the meta device, through the public call, planned for the H200
(`offline_compile.py`'s sm_90 target; `--plan-device`: another GPU's plan, compiled for the H200) and caught at each
launch, then compiled with the specialisation Triton's launch makes (`offline_compile.specialised`). A kernel
compiled here that the GPU machine keys differently is compiled there again; nothing else changes.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
from pathlib import Path

import tree_ab  # this checkout's benchmarks/ (the script's folder): the calls it times

HERE = Path(__file__).resolve().parent


def child(tree: str, shapes: list, bench_rows: bool, plan_device: str | None) -> None:
    sys.path[:0] = [tree, os.path.join(tree, "benchmarks")]
    import bench  # the tree's, as kda: before this checkout's folders go on the path
    import triton

    import kda
    import kda.plan as P

    sys.path.insert(0, str(HERE))
    import offline_compile as oc

    from kda.ops import launch as L

    for m in (kda, bench):
        assert Path(m.__file__).resolve().is_relative_to(Path(tree).resolve()), m.__file__
    target = oc.TARGETS["sm_90"]
    device = target.device
    if plan_device is not None:  # another GPU's plan, compiled for the H200 (`kda.plan.plan_as`)
        capability, smem = P.PLAN_DEVICES[plan_device]
        device = P.DeviceInfo(device.sm_count, capability, smem)
    P.device_of = lambda call: device  # every call planned for the H200, whatever its tensors' device
    calls = [tree_ab.row(bench, kda, s, "meta")[1] for s in shapes]
    for T, H in tree_ab.ACCURACY:
        q, k, v, g, beta, h0, flags = tree_ab.inputs(bench, 1, T, H, 3, "meta")
        calls.append(functools.partial(kda.chunk_kda, q, k, v, g, beta, None, h0, True, **flags))
    if bench_rows:
        calls += [bench.build(case, None, {}, "meta")[0]["kda"] for case in bench.all_cases()]
    caught = []
    real = L.DirectKernel.launch
    L.DirectKernel.launch = lambda self, grid, args, meta, *_: caught.append((self.fn, args, meta))
    try:
        for c in calls:
            c()
    finally:
        L.DirectKernel.launch = real
    seen, failed = set(), 0
    for fn, args, meta_ in caught:
        src, options = oc.specialised(fn, args, meta_, target)
        key = (src.hash(), options.hash())
        if key in seen:
            continue
        seen.add(key)
        try:
            triton.compile(src, target=target.target, options=options.__dict__)
        except Exception as e:  # noqa: BLE001 -- reported, the others still compile
            failed += 1
            print(f"{tree}: {fn.__name__}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"{tree}: {len(caught)} launches caught, {len(seen)} kernels, {failed} failed to compile", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs="+", metavar="TREE[:LABEL]")
    p.add_argument("--shapes", default=tree_ab.SHAPES, help=f"as tree_ab.py's (default {tree_ab.SHAPES})")
    p.add_argument("--bench", action="store_true", help="also every row of bench.py (the tree's)")
    p.add_argument("--plan-device", default=None, help="plan as this device (bench.py's --plan-device: sm_80)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    shapes = [s if s == "varlen" else tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    if a.child is not None:
        child(a.child, shapes, a.bench, a.plan_device)
        return 0
    ok = True
    for t in a.trees:
        path = os.path.abspath(t.split(":", 1)[0])
        env = dict(os.environ, PYTHONPATH="")
        extra = (["--bench"] if a.bench else []) + (["--plan-device", a.plan_device] if a.plan_device else [])
        done = subprocess.run([sys.executable, __file__, "--child", path, "--shapes", a.shapes, *extra, "x"], env=env)
        ok &= done.returncode == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
