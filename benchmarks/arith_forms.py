"""Whether the prepare computes the same arithmetic in every form a batch can select, checked offline.

    python benchmarks/arith_forms.py [--target sm_90] [--heads 8,32,96]

A sequence's bits may not follow the batch (docs/contract.md, "Batch invariance"), yet the prepare is compiled in
several forms: a dense call's (beside the walk, or in two grids) and a varlen batch's. Where one form lets the
compiler prove more (a varlen chunk's first row always valid, say), it may fuse a multiply into an addition there
and not in the other: the source's arithmetic unchanged, the bits not. For each head count the prepare of a dense
call (T = 8192) and of a varlen batch without host bounds are compiled as `benchmarks/offline_compile.py` compiles
them (the plan's launches, Triton's specialisation) and the float operations of their PTX counted by kind (the
order is the scheduler's and moves with the addressing around it; a fused multiply-add trades an addition and a
multiply for an fma). Prints a line a comparison; exits 1 if two forms differ. Run it under the Triton the GPU
runs (the Gluon prepare is planned under 3.6 only): such a split is found without GPU time.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import offline_compile as oc  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

# the prepares; not the gate pass, whose varlen form has a one-token branch of its own (`_gate_row`)
PREPARE = ("_chunk_prepare_kernel", "_chunk_prepare_hopper_kernel")
FLOAT_OP = re.compile(r"\s+((?:fma|mul|add|sub|div|rcp|ex2|lg2|sqrt|max|min|abs|neg)\.[a-z0-9.]*f(?:32|64)"
                      r"|cvt\.rn[a-z0-9.]*|wgmma\.mma_async[^ ]*|mma\.sync[^ ]*)\s")


def float_ops(ptx: str) -> list[str]:
    """The float operations of a kernel's PTX (rounding modes and types included)."""
    return [m.group(1) for m in map(FLOAT_OP.match, ptx.splitlines()) if m]


def prepare_ptx(case: str, target: oc.Target) -> list[tuple[str, str]]:
    """(kernel name, PTX) of each prepare launch of the case, compiled for the target."""
    out = []
    for fn, args, meta in oc.launches(case, torch.float32, target.device):
        if fn.__name__ in PREPARE:
            src, options = oc.specialised(fn, args, meta, target)
            out.append((fn.__name__, triton.compile(src, target=target.target, options=options.__dict__).asm["ptx"]))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="sm_90", choices=[n for n, t in oc.TARGETS.items()
                                                         if t.target.backend == "cuda"])
    p.add_argument("--heads", default="8,32,96")
    args = p.parse_args()
    target = oc.TARGETS[args.target]
    differ = 0
    for h in map(int, args.heads.split(",")):
        oc.CASES[f"dense-h{h}"] = oc._prefill(B=1, T=8192, H=h)
        oc.CASES[f"varlen-h{h}"] = oc._prefill(B=1, T=0, H=h, lengths=[1024] * 8 + [8] * 8, host_bounds=False)
        varlen = dict(prepare_ptx(f"varlen-h{h}", target))
        for name, ptx in prepare_ptx(f"dense-h{h}", target):
            a, b = collections.Counter(float_ops(ptx)), collections.Counter(float_ops(varlen[name]))
            differ += a != b
            print(f"{args.target} H={h} {name}: dense {a.total()} float ops, varlen {b.total()}: "
                  + ("the same kinds and counts" if a == b else f"DIFFER (dense more {dict(a - b)}, varlen more "
                                                              f"{dict(b - a)})"), flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
