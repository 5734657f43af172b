"""Registers and static SASS instruction mix of the decode kernel for sm_90, compiled here without a GPU
(scripts/kernel_regs.py's compiler path; Triton here may be newer than the GPU machine's 3.6, so treat the
counts as close, not equal). Development aid:

    python scripts/decode_sass.py [--pool fp32|bf16] [--configs BV:warps[:nsub[:maxnreg]],...]

nsub > 0 compiles the one-token kernel.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

from kernel_regs import PTXAS, compile_for_sm90, ptxas_report  # noqa: E402

import kda.ops.fused_recurrent as fr  # noqa: E402

BIN = os.path.dirname(PTXAS)
# what the launcher specialises in the benchmark's decode call: aligned pointers, strides that are multiples of 16
DIVISIBLE = ("q", "k", "v", "g", "beta", "o", "A_log", "dt_bias", "state_src", "state_dst", "slot_of_seq",
             "s_qt", "s_kt", "s_vt", "s_gt", "s_ot", "s_qh", "s_kh", "s_vh", "s_gh", "s_oh", "src_stride", "dst_stride")


def sass_mix(kernel) -> collections.Counter:
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        open(ptx, "w").write(kernel.asm["ptx"])
        subprocess.run([PTXAS, "-arch=sm_90a", ptx, "-o", cubin], check=True)
        out = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", cubin], capture_output=True, text=True).stdout
    ops = collections.Counter()
    for line in out.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool", default="fp32")
    ap.add_argument("--configs", default="16:1,8:1")
    ap.add_argument("--extra", default="", help="more constexprs, k=v,... (ints)")
    a = ap.parse_args()
    consts = dict(H=12, HV=12, K=128, V=128, BK=128, IS_VARLEN=False, USE_GATE=True, HAS_A_LOG=True,
                  HAS_DT_BIAS=True, USE_LOWER_BOUND=True, USE_L2NORM=True, USE_BETA_SIGMOID=True, HAS_SRC=True,
                  HAS_DST=True, PAGED=True, HAS_INIT_FLAGS=False, V_FIRST=True, SR=0, FULL_TILE=True)
    for kv in filter(None, a.extra.split(",")):
        k, v = kv.split("=")
        consts[k] = int(v)
    from kernel_regs import POINTERS
    pool = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}[a.pool]
    POINTERS.update(state_src=pool, state_dst=pool)
    for c in a.configs.split(","):
        bv, w, *rest = (int(x) for x in c.split(":"))
        nsub = rest[0] if rest else 0
        if nsub:  # the one-token kernel (dense T = 1)
            one = {k_: v_ for k_, v_ in consts.items() if k_ not in ("IS_VARLEN", "PAGED")}  # paged: run time
            k = compile_for_sm90(fr._fused_recurrent_one_token_kernel, dict(one, BV=bv, NSUB=nsub), w, 1,
                                 rest[1] if len(rest) > 1 else None, divisible=DIVISIBLE)
        else:
            k = compile_for_sm90(fr._fused_recurrent_kda_kernel, dict(consts, BV=bv), w, 1, None,
                                 divisible=DIVISIBLE)
        mix = sass_mix(k)
        total = sum(mix.values())
        top = ", ".join(f"{op} {n}" for op, n in mix.most_common(14))
        print(f"{a.pool} BV={bv} warps={w} nsub={nsub}: {ptxas_report(k)}\n  {total} SASS: {top}", flush=True)


if __name__ == "__main__":
    main()
