"""Compile, on a machine without a GPU, the kernels a `tree_ab.py` call will launch on the H200, into Triton's cache,
so that the device call finds them compiled (`scripts/triton_cache.py pack` then carries them).

    TRITON_CACHE_DIR=DIR python benchmarks/warm_cache.py [--shapes 1x16384x32,...,varlen] TREE [TREE ...]

Run it under the GPU machine's Python and Triton (3.12, Triton 3.6.0: the cache key holds Triton's build and its
Python extension), from this checkout; each TREE (as `tree_ab.py` takes them) in its own process, its `kda` first on
the path. Each call is built as `tree_ab.py` builds it (bf16 q, k, v, fp32 g, Kimi's gate, q/k l2norm, beta sigmoid,
a dense fp32 initial state and the final state; the benchmark's varlen row with `cu_seqlens` int64 on the device and
no host bounds; the accuracy calls at T = 2048 and 8192, H = 4) on meta tensors, planned for the H200
(`offline_compile.py`'s sm_90 target) and caught at each launch, then compiled with the specialisation Triton's
launch makes (`offline_compile.compile_launch`). A kernel compiled here that the GPU machine keys differently is
compiled there again; nothing else changes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = "1x16384x32,4x4096x32,1x4096x12,1x16384x12,1x65536x12,1x8192x96,1x4096x32,varlen"
ACCURACY = ((1, 2048, 4), (1, 8192, 4))  # tree_ab.py's accuracy calls
VARLEN = [1] * 12 + [1100, 1300, 900]  # bench.py's varlen row, H = 32


def child(tree: str, shapes: list) -> None:
    sys.path.insert(0, tree)
    import torch

    import kda  # the tree's, before offline_compile puts this checkout on the path

    sys.path.insert(0, str(HERE))
    import offline_compile as oc

    from kda.api import check_call_args
    from kda.contract import check_call
    from kda.ops import launch as L
    from kda.ops.chunk import chunk_kda_fwd
    from kda.plan import prefill_plan

    assert Path(kda.__file__).resolve().is_relative_to(Path(tree).resolve()), kda.__file__
    target = oc.TARGETS["sm_90"]
    K = V = 128

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    def call(B, T, H, lengths=None):
        N = B if lengths is None else len(lengths)
        flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                     A_log=meta(H, dtype=torch.float32), dt_bias=meta(H * K, dtype=torch.float32), lower_bound=-5.0)
        if lengths is not None:
            flags["cu_seqlens"] = meta(N + 1, dtype=torch.int64)
        h0 = meta(N, H, K, V, dtype=torch.float32)
        args = (meta(B, T, H, K), meta(B, T, H, K), meta(B, T, H, V), meta(B, T, H, K, dtype=torch.float32),
                meta(B, T, H), None, h0, True)
        positional, keywords = check_call_args(kda.chunk_kda, *args, **flags)
        return check_call(*positional, **keywords)

    calls = [call(1, sum(VARLEN), 32, VARLEN) if s == "varlen" else call(*s) for s in shapes]
    calls += [call(*s) for s in ACCURACY]
    caught = []
    real = L.DirectKernel.launch
    L.DirectKernel.launch = lambda self, grid, args, meta: caught.append((self.fn, args, meta))
    try:
        for c in calls:
            chunk_kda_fwd(c, *prefill_plan(c, device=target.device))
    finally:
        L.DirectKernel.launch = real
    done = 0
    for i, (fn, args, meta_) in enumerate(caught):
        row = oc.compile_launch(fn, args, meta_, target, None, None, f"warm-{os.getpid()}-{i}")
        if "error" in row:
            print(f"{tree}: {fn.__name__}: {row['error']}", flush=True)
        else:
            done += 1
    print(f"{tree}: {len(caught)} launches caught, {done} compiled or found in the cache", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs="+", metavar="TREE[:LABEL]")
    p.add_argument("--shapes", default=SHAPES, help=f"as tree_ab.py's (default {SHAPES})")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    shapes = [s if s == "varlen" else tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    if a.child is not None:
        child(a.child, shapes)
        return 0
    ok = True
    for t in a.trees:
        path = os.path.abspath(t.split(":", 1)[0])
        env = dict(os.environ, PYTHONPATH="")
        done = subprocess.run([sys.executable, __file__, "--child", path, "--shapes", a.shapes, "x"], env=env)
        ok &= done.returncode == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
