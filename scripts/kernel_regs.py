"""Registers, spills and shared memory of the chunk kernels for sm_90, compiled here without a GPU.

Triton compiles for a named target with no device; the PTX goes through the ptxas that Triton ships
(`ptxas-blackwell`, CUDA 13.x: it reads the PTX version Triton 3.9 writes). Costs no device time; the GPU
machine runs Triton 3.6, so treat the numbers as close, not equal. Development aid:

    python scripts/kernel_regs.py [--warps 4] [--maxnreg 168] [--K 128] [--state-stages 2]
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import tempfile

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kda.ops.chunk as chunk_ops  # noqa: E402
import kda.ops.chunk_state as walk_ops  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
POINTERS = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "o": "*bf16", "g": "*fp32", "beta": "*bf16",
            "A_log": "*fp32", "dt_bias": "*fp32", "cu_seqlens": "*i32",
            "state_src": "*fp32", "state_dst": "*fp32", "slot_of_seq": "*i32", "has_initial_state": "*i1",
            "a_seg": "*fp32", "b_seg": "*fp32", "h_seg": "*fp32"}


HALF_WORKSPACES = ("w_ws", "qd_ws", "kr_ws", "kd_ws")


def compile_for_sm90(fn, consts: dict, warps: int, stages: int, maxnreg: int | None, ws: str = "fp32",
                     divisible: tuple[str, ...] = ()):
    """`divisible`: parameters to mark divisible by 16 (what Triton's launcher specialises at run time for
    16-byte aligned pointers and integers that are multiples of 16; without it loads do not vectorise)."""
    params = list(inspect.signature(fn.fn).parameters)
    sig = {}
    for p in params:
        if p in consts:
            sig[p] = "constexpr"
        elif p in POINTERS:
            sig[p] = POINTERS[p]
        elif p.endswith("_ws"):
            sig[p] = "*fp16" if (ws == "fp16" and p in HALF_WORKSPACES) else "*fp32"
        elif p in ("scale", "lower_bound"):
            sig[p] = "fp32"
        else:
            sig[p] = "i32"
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in divisible}
    src = ASTSource(fn, sig, constexprs={(params.index(k),): v for k, v in consts.items()}, attrs=attrs)
    opts = dict(num_warps=warps, num_stages=stages)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def ptxas_report(kernel) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    keep = [ln.split(":", 1)[-1].strip() for ln in r.stderr.splitlines() if "registers" in ln or "spill" in ln]
    return " | ".join(keep) + f" | shared {kernel.metadata.shared} B"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--solve-warps", type=int, default=4)
    ap.add_argument("--inv-prec", default="ieee")
    ap.add_argument("--ws", default="fp16", help="dtype of the Kd/Qd/Kr/W workspaces (fp16 with 16-bit inputs)")
    ap.add_argument("--state-stages", type=int, default=1)
    ap.add_argument("--state-warps", type=int, default=8)
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    a = ap.parse_args()
    flags = dict(USE_BETA_SIGMOID=True, DOT_PREC="tf32")
    consts = dict(H=12, HV=12, K=a.K, BT=64, BC=16, BK=16, IS_VARLEN=False, USE_GATE=True, HAS_A_LOG=True,
                  HAS_DT_BIAS=True, USE_LOWER_BOUND=True, USE_L2NORM=True, **flags)
    k = compile_for_sm90(chunk_ops._chunk_intra_kernel, consts, a.warps, 1, a.maxnreg, a.ws)
    print(f"intra, any gate ({a.warps} warps, 1 stage): {ptxas_report(k)}", flush=True)
    bconsts = dict(H=12, HV=12, K=a.K, BT=64, BC=16, BK=min(32, triton.next_power_of_2(a.K)), IS_VARLEN=False,
                   HAS_A_LOG=True, HAS_DT_BIAS=True, A_PREC="tf32x3", **flags)
    for row_batched in (False, True):
        k = compile_for_sm90(chunk_ops._chunk_intra_bounded_kernel, dict(bconsts, ROW_BATCHED=row_batched), 8, 1,
                             a.maxnreg, a.ws)
        print(f"bounded intra, one program per chunk, ROW_BATCHED={row_batched} (8 warps, 1 stage): "
              f"{ptxas_report(k)}", flush=True)
    consts = dict(HV=12, K=a.K, V=a.V, BT=64, BC=16, BK=min(32, triton.next_power_of_2(a.K)),
                  BV=min(64, triton.next_power_of_2(a.V)), IS_VARLEN=False, INV_PREC=a.inv_prec, **flags)
    k = compile_for_sm90(chunk_ops._chunk_solve_kernel, consts, a.solve_warps, 1, a.maxnreg, a.ws)
    print(f"split solve ({a.solve_warps} warps, 1 stage): {ptxas_report(k)}", flush=True)
    BKF = max(16, triton.next_power_of_2(a.K))
    state_flags = dict(HAS_SRC=True, HAS_DST=True, PAGED=True, HAS_INIT_FLAGS=True, V_FIRST=True)
    consts = dict(HV=12, K=a.K, V=a.V, BT=64, BK=BKF, BV=32, IS_VARLEN=False, DOT_PREC="tf32", **state_flags)
    k = compile_for_sm90(walk_ops._chunk_state_kernel, consts, a.state_warps, a.state_stages, a.maxnreg, a.ws)
    print(f"state ({a.state_warps} warps, {a.state_stages} stages, {a.ws} workspaces): {ptxas_report(k)}", flush=True)
    seg = dict(HV=12, K=a.K, V=a.V, BT=64, G=16, BK=BKF, BV=32, IS_VARLEN=True, DOT_PREC="tf32")
    for name, fn, extra, stages in (
        ("segment summary", walk_ops._segment_summary_kernel, {}, a.state_stages),
        ("segment scan", walk_ops._segment_scan_kernel, state_flags, 1),
        ("segment output", walk_ops._segment_output_kernel, dict(PAGED=True), a.state_stages),
    ):
        k = compile_for_sm90(fn, dict(seg, **extra), a.state_warps, stages, a.maxnreg, a.ws)
        print(f"{name} ({a.state_warps} warps, {stages} stages): {ptxas_report(k)}", flush=True)


if __name__ == "__main__":
    main()
