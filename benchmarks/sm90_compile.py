"""Compile kda's kernels for sm_90 on a machine without a GPU: registers, spills, shared memory and the
instructions of each loop, as the H200 would run them, without spending device time.

    <python with triton 3.6> benchmarks/sm90_compile.py [CASE ...] [--maxnreg N] [--out DIR]

Run it under the Triton the GPU machine runs (3.6: `python -m venv /tmp/t36 --system-site-packages &&
/tmp/t36/bin/pip install triton==3.6.0`, torch from the system): another version compiles other code.
Each case is a kernel at the benchmark's shapes (K = V = 128, bf16 inputs, Kimi's gate, fp32 state) with
the launch parameters `kda.plan` chooses there, and the specialisation a launch makes: every pointer
16-byte aligned, every integer argument 16-divisible unless listed otherwise, integers equal to 1 as
constants (beta's head stride). The TMA walk takes the ragged descriptors' types. Prints one row per case
(`--maxnreg` caps the registers as a launch option would); `--out DIR` keeps each case's TTGIR, PTX and
SASS. Cases: see CASES (`--list`). docs/performance.md ("Checking kernels without a GPU") says why the
specialisation matters.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kda.ops import chunk_prepare, chunk_walk, fused_recurrent  # noqa: E402
from kda.plan import CHUNK, FUSED_SUB, TUNINGS, DeviceInfo, _chunk_plan, _decode_plan  # noqa: E402

K = V = 128
H_CHUNK = 32  # value heads of the prefill cases (1x16384 H=32)
H_DECODE = 12
H200 = DeviceInfo(132, (9, 0), 227 * 1024)
TUNE = TUNINGS["sm90"]
WAIT_CHUNKS, WAIT_CHUNKS_BV64 = TUNE.wait_chunks, TUNE.wait_chunks_bv64


def _chunk(walk_bv: int = 32):
    return _chunk_plan(torch.bfloat16, True, True, K, V, walk_bv, True, walk_bv == 64, H200, TUNE)


def _decode(v_first: bool, dtype: torch.dtype):
    return _decode_plan(K, V, v_first, dtype, True, False, False)


def gate_case(signal: int = 0):
    plan = _chunk()
    ptrs = dict(g="fp32", A_log="fp32", dt_bias="fp32", cu_seqlens="i32", b2_ws="fp32", gt_ws="fp32", ready="i32")
    consts = dict(HV=H_CHUNK, K=K, BT=CHUNK, BK=plan.gate_BK, IS_VARLEN=False, HAS_A_LOG=True, HAS_DT_BIAS=True,
                  SHORT=0, SIGNAL_CHUNKS=signal)
    return chunk_prepare._chunk_gate_kernel, ptrs, consts, dict(N=1), plan.gate_warps, 1


def prepare_case(signal: int = 0, fold: bool = True):
    plan = _chunk()
    ws = "fp16" if plan.ws_dtype == torch.float16 else "fp32"
    ptrs = dict(q="bf16", k="bf16", v="bf16", g="fp32", beta="bf16", A_log="fp32", dt_bias="fp32", cu_seqlens="i32",
                kd_ws=ws, qd_ws=ws, m_ws=ws, n_ws=ws, gt_ws="fp32", b2_ws="fp32", sc_ws="fp32", ready="i32", x_ws=ws)
    consts = dict(H=H_CHUNK, HV=H_CHUNK, K=K, V=V, BT=CHUNK, BC=FUSED_SUB, BK=plan.prepare_BK,
                  IS_VARLEN=False, HAS_A_LOG=True, HAS_DT_BIAS=True, SHORT=0, USE_BETA_SIGMOID=True,
                  DOT_PREC=plan.dot_prec, CUMSUM_DTYPE=tl.float64 if plan.cumsum_fp64 else tl.float32,
                  B2_FROM_WS=plan.gate_pass, SIGNAL_CHUNKS=signal, FOLD=fold, LAST_WAITS=signal > 0)
    return chunk_prepare._chunk_prepare_kernel, ptrs, consts, dict(N=1, s_bh=1), plan.prepare_warps, 1


def walk_case(walk_bv: int, wait: int = 0, in_loop: bool = False, fold: bool = True):
    plan = _chunk(walk_bv)
    assert plan.walk_tma
    ws = "fp16" if plan.ws_dtype == torch.float16 else "fp32"

    def desc(dtype, cols):  # a ragged descriptor of [tokens, HV, cols] with [BT, 1, cols] tiles
        return f"tensordesc<{dtype}[1, 1, {CHUNK}, 1, {cols}]>"

    # v: the input's ragged descriptor (`chunk._v_tiles`), [BT, 1, BV] tiles
    ptrs = dict(o="bf16", cu_seqlens="i32", n_ws=desc(ws, CHUNK), kd_ws=desc(ws, K), v=desc("bf16", walk_bv),
                qd_ws=desc(ws, K), m_ws=desc(ws, K), gt_ws="fp32", sc_ws="fp32", state_src="fp32", state_dst="fp32",
                slot_of_seq="i32", has_initial_state="i1", checkpoint_indices="i32", errors="i32", ready="i32",
                x_ws=ws if fold else desc(ws, CHUNK))
    consts = dict(HV=H_CHUNK, K=K, V=V, BT=CHUNK, BK=K, BV=walk_bv, IS_VARLEN=False, HAS_SRC=True, HAS_DST=True,
                  PAGED=False, HAS_INIT_FLAGS=False, V_FIRST=False, DOT_PREC=plan.dot_prec, HAS_CHECKPOINTS=False,
                  HAS_ERRORS=False, SHORT=0, TMA=True, V_TMA=True, WAIT_CHUNKS=wait, WAIT_IN_LOOP=in_loop,
                  SPIN=wait > 0, FOLD=fold)
    return chunk_walk._chunk_state_kernel, ptrs, consts, dict(N=1, n_slots=1), plan.walk_warps, plan.walk_stages


def decode_case(v_first: bool, dtype: torch.dtype, **overrides):
    plan = replace(_decode(v_first, dtype), **overrides)
    pool = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    ptrs = dict(q="bf16", k="bf16", v="bf16", g="fp32", beta="bf16", o="bf16", A_log="fp32", dt_bias="fp32",
                state_src=pool, state_dst=pool, slot_of_seq="i32", has_initial_state="i1", errors="i32")
    consts = dict(H=H_DECODE, HV=H_DECODE, K=K, V=V, BK=plan.BK, BV=plan.BV, NSUB=plan.nsub, USE_GATE=True,
                  HAS_A_LOG=True, HAS_DT_BIAS=True, USE_LOWER_BOUND=True, USE_L2NORM=True, USE_BETA_SIGMOID=True,
                  HAS_SRC=True, HAS_DST=True, HAS_INIT_FLAGS=True, V_FIRST=v_first, SR=plan.sr,
                  FULL_TILE=True, HAS_ERRORS=False, KC=plan.kc, HEADS_FASTEST=plan.heads_fastest,
                  PACKED=plan.packed)
    # seed, paged and n_slots are not specialised (`do_not_specialize`); s_bh = 1: beta [N, 1, H]; a launch
    # takes Triton's default of 3 stages, which only the row-chunk loops (2-byte K-first pools) use
    return (fused_recurrent._fused_recurrent_one_token_kernel, ptrs, consts,
            dict(s_bh=1, seed=None, paged=None, n_slots=None, zero=None), plan.num_warps,
            3 if plan.kc and not plan.packed else 1)


def loop_case(v_first: bool, dtype: torch.dtype, verify: bool = False):
    """The loop kernel (any tokens per sequence; varlen without host bounds, paged), as the benchmark's "no host
    bounds" decode row and speculative verify run it."""
    plan = _decode_plan(K, V, v_first, dtype, False, False, False)
    pool = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    ptrs = dict(q="bf16", k="bf16", v="bf16", g="fp32", beta="bf16", o="bf16", A_log="fp32", dt_bias="fp32",
                cu_seqlens="i32", state_src=pool, state_dst=pool, slot_of_seq="i32", has_initial_state="i1",
                num_accepted="i32", errors="i32")
    consts = dict(H=H_DECODE, HV=H_DECODE, K=K, V=V, BK=plan.BK, BV=plan.BV, IS_VARLEN=True, USE_GATE=True,
                  HAS_A_LOG=True, HAS_DT_BIAS=True, USE_LOWER_BOUND=True, USE_L2NORM=True, USE_BETA_SIGMOID=True,
                  HAS_SRC=True, HAS_DST=True, PAGED=True, HAS_INIT_FLAGS=False, V_FIRST=v_first, SR=plan.sr,
                  FULL_TILE=True, VERIFY=verify, HAS_ACCEPTED=verify, HAS_ERRORS=False, SHORT=0)
    return (fused_recurrent._fused_recurrent_kda_kernel, ptrs, consts, dict(s_bh=1, seed=None, n_slots=None),
            plan.num_warps, 1)


CASES = {
    "gate": gate_case,
    "prepare": prepare_case,
    "walk": lambda: walk_case(32),
    "walk-bv64": lambda: walk_case(64),
    "gate-signal": lambda: gate_case(WAIT_CHUNKS),
    "prepare-signal": lambda: prepare_case(WAIT_CHUNKS),
    "walk-beside": lambda: walk_case(32, WAIT_CHUNKS),
    "walk-bv64-beside": lambda: walk_case(64, WAIT_CHUNKS_BV64, True),
    # `ChunkPlan.fold` off: the walk applies the inverse
    "prepare-signal-unfolded": lambda: prepare_case(WAIT_CHUNKS, False),
    "walk-bv64-beside-unfolded": lambda: walk_case(64, WAIT_CHUNKS_BV64, True, False),
    "walk-bv64-unfolded": lambda: walk_case(64, fold=False),
    "walk-unfolded": lambda: walk_case(32, fold=False),
    "decode-vfirst-fp32": lambda: decode_case(True, torch.float32),
    "decode-vfirst-bf16": lambda: decode_case(True, torch.bfloat16),
    "decode-kfirst-fp32": lambda: decode_case(False, torch.float32),
    "decode-kfirst-bf16": lambda: decode_case(False, torch.bfloat16),
    "decode-kfirst-bf16-rows": lambda: decode_case(False, torch.bfloat16, packed=False, num_warps=1),
    "decode-kfirst-fp16": lambda: decode_case(False, torch.float16),
    "loop-kfirst-fp32": lambda: loop_case(False, torch.float32),
    "loop-kfirst-bf16-verify": lambda: loop_case(False, torch.bfloat16, True),
}
FLOATS = ("scale", "lower_bound")


def compile_case(name: str, maxnreg: int | None, out: Path | None) -> dict:
    fn, ptrs, consts, special, warps, stages = CASES[name]()
    fn = getattr(fn, "fn", fn)  # the JIT function under `kda.ops.launch.DirectKernel`
    sig, attrs, cx = {}, {}, dict(consts)
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            if p.name not in consts:
                raise KeyError(f"{name}: constexpr {p.name} not given")
            sig[p.name] = "constexpr"
        elif p.name in ptrs:
            t = ptrs[p.name]
            sig[p.name] = t if t.startswith("tensordesc") else "*" + t
            if not t.startswith("tensordesc"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif p.name in FLOATS:
            sig[p.name] = "fp32"
        elif special.get(p.name, 0) == 1:
            sig[p.name], cx[p.name] = "constexpr", 1
        else:
            sig[p.name] = "i32"
            if p.name not in special:  # 16-divisible at the benchmark's shapes
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = dict(num_warps=warps, num_stages=stages)
    if maxnreg:
        options["maxnreg"] = maxnreg
    src = ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = kernel.asm["ptx"]
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    work = out or Path("/tmp") / "kda_sm90"
    work.mkdir(parents=True, exist_ok=True)
    (work / f"{name}.ptx").write_text(ptx)
    (work / f"{name}.ttgir").write_text(kernel.asm["ttgir"])
    cubin = work / f"{name}.cubin"
    r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", str(work / f"{name}.ptx"), "-o", str(cubin)],
                       capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    row = dict(case=name, warps=warps, stages=stages, registers=int(regs.group(1)) if regs else r.stderr[-200:],
               spills=int(spill.group(1)) if spill else 0, shared=kernel.metadata.shared,
               wgmma=ptx.count("wgmma.mma_async"), mma=ptx.count("mma.sync"), cp_async=ptx.count("cp.async."),
               loops=_loops(work, name, cubin, Path(ptxas).parent / "cuobjdump"))
    return row


def _loops(work: Path, name: str, cubin: Path, cuobjdump: Path) -> str:
    """SASS instructions of each loop (backward branch; the pipelined walk compiles its loop in several copies)
    and their four commonest opcodes, from cuobjdump where the toolchain ships it."""
    if not cuobjdump.exists():
        return "-"
    sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True).stdout
    (work / f"{name}.sass").write_text(sass)
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3).split(".")[0], m.group(4)))
    loops = []
    for addr, op, args in ins:
        t = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if t and int(t.group(1), 16) < addr:
            body = [x[1] for x in ins if int(t.group(1), 16) <= x[0] <= addr]
            if len(body) < 8:  # a barrier's spin-wait
                continue
            top = ", ".join(f"{k} {v}" for k, v in collections.Counter(body).most_common(4))
            loops.append(f"{len(body)} ({top})")
    return f"{len(ins)} total; loops: " + "; ".join(loops) if loops else f"{len(ins)} total"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="*", help="case names (default: all)")
    p.add_argument("--maxnreg", type=int, default=None, help="register cap per thread, as a launch option")
    p.add_argument("--out", type=Path, default=None, help="keep TTGIR, PTX, SASS here")
    p.add_argument("--list", action="store_true", help="list the cases")
    args = p.parse_args()
    if args.list:
        print("\n".join(CASES))
        return 0
    print(f"triton {triton.__version__}, sm_90" + (f", maxnreg {args.maxnreg}" if args.maxnreg else ""))
    print("| case | warps | stages | registers | spill bytes | shared bytes | wgmma | mma.sync | cp.async | SASS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.cases or CASES:
        r = compile_case(name, args.maxnreg, args.out)
        print(f"| {r['case']} | {r['warps']} | {r['stages']} | {r['registers']} | {r['spills']} | {r['shared']} | "
              f"{r['wgmma']} | {r['mma']} | {r['cp_async']} | {r['loops']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
