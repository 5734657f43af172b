"""The first call at a new shape: wall time from `import kda` to a prefill call's outputs on the host, with the Triton
cache the caller's environment names (point TRITON_CACHE_DIR at an empty directory for a cold cache), then the
second call at the same shape (compiled, not yet recorded) and the third (recorded). The benchmark's inputs.

    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/first_call.py [--shape 1x8192x96]      (a CUDA device)
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/first_call.py")
    p.add_argument("--shape", default="1x8192x96", help="BxTxH (default 1x8192x96)")
    a = p.parse_args()
    B, T, H = (int(x) for x in a.shape.split("x"))
    t0 = time.perf_counter()
    import bench
    import torch

    import kda

    torch.cuda.init()
    t_import = time.perf_counter() - t0
    case = bench.Case(f"prefill {B}x{T} H={H}", "prefill", "dense", B, T, H)
    calls, _ = bench.build(case, None, {})
    torch.cuda.synchronize()
    cache = os.environ.get("TRITON_CACHE_DIR", "(Triton's default)")
    print(f"kda {kda.__file__}; Triton cache {cache}; entries before: "
          f"{len(os.listdir(cache)) if os.path.isdir(cache) else 0}")
    print(f"import torch + kda + CUDA init: {t_import:.2f} s")
    for i in range(3):
        t = time.perf_counter()
        o, s = calls["kda"]()
        torch.cuda.synchronize()
        print(f"call {i + 1} at {a.shape}: {time.perf_counter() - t:.3f} s (o finite: {bool(o.isfinite().all())})")
    print(f"entries after: {len(os.listdir(cache)) if os.path.isdir(cache) else 0}")


if __name__ == "__main__":
    main()
