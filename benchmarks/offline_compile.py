"""Compile every kernel `kda.plan` launches for NVIDIA and AMD targets on a machine without a GPU: registers (VGPRs,
SGPRs on AMD), spills, shared memory (LDS) and whether they fit the target, as that GPU would run them.

    python benchmarks/offline_compile.py [--targets sm_80,sm_90,...] [--cases NAME,...] [--maxnreg N]
                                         [--plan FIELD=VALUE,...] [--out DIR] [--md FILE]

Each case is a call at K = V = 128 with bf16 inputs and Kimi's gate unless its name says otherwise, on an fp32 or a
bf16 state pool. For each target its call is planned for that GPU (`kda.plan.prefill_plan` / `decode_plan` with the
target's `DeviceInfo`: SMs, capability, shared memory, HIP), then run through the package's own launch path
(`kda.ops.chunk.chunk_kda_fwd`, `kda.ops.fused_recurrent.fused_recurrent_kda_fwd`) on meta tensors, each launch
caught before it reaches a device and compiled for the target with the specialisation Triton's own binder makes
of its arguments (16-byte aligned pointers, 16-divisible and unit integers, TMA descriptors' types). So TMA, the
walk beside the prepare, its PTX spin and the tiles, warps and stages are what the plan chooses on that target.
Run it under the Triton the GPU machine runs: another version compiles other code. `--out DIR` keeps each
kernel's TTGIR, PTX or AMDGCN (and SASS where `cuobjdump` ships with Triton); `--md FILE` writes the table.
`--plan BV=64,num_warps=4` replaces fields of every case's plan (`DecodePlan` or `ChunkPlan`, as the tests'
overrides do): another tile's registers and spills before any GPU time is spent on it.
The specialisation matters: without it every integer is a scalar of unknown divisibility, and vector loads,
TMA and asynchronous copies compile to narrower code or not at all. docs/platforms.md reads the committed table
(benchmarks/results/offline-compile.md).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# a cache of its own: the launch cache may be a packed one (scripts/triton_cache.py keeps no ttgir or ptx to read)
os.environ["TRITON_CACHE_DIR"] = str(Path.home() / ".triton" / "offline_compile_cache")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

import kda  # noqa: E402
from kda.api import check_call_args  # noqa: E402
from kda.contract import check_call  # noqa: E402
from kda.plan import DeviceInfo, decode_plan, prefill_plan  # noqa: E402

K = V = 128


@dataclass(frozen=True)
class Target:
    name: str
    gpu: str
    target: GPUTarget
    device: DeviceInfo
    max_regs: int  # registers a thread may hold (NVIDIA), or VGPRs (arch + accumulation) a lane (AMD)


TARGETS = {t.name: t for t in (
    Target("sm_80", "A100", GPUTarget("cuda", 80, 32), DeviceInfo(108, (8, 0), 166912), 255),
    Target("sm_90", "H200", GPUTarget("cuda", 90, 32), DeviceInfo(132, (9, 0), 232448), 255),
    Target("sm_100", "B200", GPUTarget("cuda", 100, 32), DeviceInfo(148, (10, 0), 232448), 255),
    Target("gfx942", "MI300X", GPUTarget("hip", "gfx942", 64), DeviceInfo(304, (9, 4), 65536, hip=True), 512),
    Target("gfx950", "MI355X", GPUTarget("hip", "gfx950", 64), DeviceInfo(256, (9, 5), 163840, hip=True), 512),
)}


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _call(fn, B: int, T: int, H: int, lengths: list[int] | None = None, pool: torch.dtype = torch.float32,
          v_first: bool = True, host_bounds: bool = True, kimi_gate: bool = True, verify: int = 0,
          dtype: torch.dtype = torch.bfloat16, K: int = K, V: int = V):
    """The `KDACall` of `fn` (`kda.chunk_kda` or `kda.fused_recurrent_kda`) on meta tensors: dense [B, T] or varlen
    `lengths` (host bounds given or not), value heads H, a paged pool of `pool` dtype (one slot a sequence), Kimi's
    gate (A_log, dt_bias, lower bound -5, q and k l2-normalised in the kernel) or a raw log-decay gate; q, k, v of
    `dtype`, K and V wide."""
    N = B if lengths is None else len(lengths)
    if lengths is not None:
        B, T = 1, sum(lengths)
    q, k, v = _meta(B, T, H, K, dtype=dtype), _meta(B, T, H, K, dtype=dtype), _meta(B, T, H, V, dtype=dtype)
    g, beta = _meta(B, T, H, K, dtype=dtype), _meta(B, T, H, dtype=dtype)
    kw = dict(state_cache=_meta(N + 1, H, *((V, K) if v_first else (K, V)), dtype=pool),
              state_v_first=v_first, output_final_state=False)
    if verify:
        kw.update(state_indices=_meta(N, verify, dtype=torch.int32), num_accepted_tokens=_meta(N, dtype=torch.int32))
    else:
        kw.update(state_indices=_meta(N, dtype=torch.int32), has_initial_state=_meta(N, dtype=torch.bool))
    if kimi_gate:
        kw.update(A_log=_meta(H, dtype=torch.float32), dt_bias=_meta(H * K, dtype=torch.float32), lower_bound=-5.0,
                  use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    else:
        g = _meta(B, T, H, K, dtype=torch.float32)
    if lengths is not None:
        bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        kw["cu_seqlens"] = bounds.to("meta")
        if host_bounds:
            kw["cu_seqlens_cpu"] = bounds
    positional, keywords = check_call_args(fn, q, k, v, g, beta, **kw)
    return check_call(*positional, **keywords)


def _prefill(**kw):
    return "prefill", lambda pool: _call(kda.chunk_kda, pool=pool, **kw)


def _decode(sr: bool = False, **kw):
    return "decode-sr" if sr else "decode", lambda pool: _call(kda.fused_recurrent_kda, pool=pool, **kw)


# name -> (kind, call builder of a pool dtype); every case runs on an fp32 and a bf16 pool
CASES = {
    # wide heads (the walk at V blocks of 64, the inverse applied by the walk), beside the prepare's tail on sm_90
    "prefill-1x16384-h32": _prefill(B=1, T=16384, H=32),
    # 96 heads: on sm_90 under Triton 3.6 the Gluon prepare (`kda.plan.gluon_prepare`), the walk beside its tail
    "prefill-1x8192-h96": _prefill(B=1, T=8192, H=96),
    # few heads: the walk beside the whole prepare on NVIDIA (counters, PTX spin)
    "prefill-1x8192-h8": _prefill(B=1, T=8192, H=8),
    # a raw log-decay gate: the split prepare (and the counters' own zeroing where the walk runs beside it)
    "prefill-raw-gate-1x8192-h8": _prefill(B=1, T=8192, H=8, kimi_gate=False),
    # a serving batch without host bounds: varlen chunk kernels routed on the device, short ones by the loop kernel
    "prefill-varlen-64-h32": _prefill(B=1, T=0, H=32, lengths=[1024] * 32 + [8] * 32, host_bounds=False),
    # fp32 inputs at K = V = 64: exact dots stage their operands in shared memory beside the walk's TMA stages
    "prefill-fp32-k64-1x4096-h4": _prefill(B=1, T=4096, H=4, dtype=torch.float32, K=64, V=64),
    "decode-vfirst-256-h32": _decode(B=256, T=1, H=32),
    "decode-kfirst-256-h32": _decode(B=256, T=1, H=32, v_first=False),
    "verify-kfirst-256x4-h32": _decode(B=256, T=4, H=32, v_first=False, verify=4),
    "verify-vfirst-256x4-h32": _decode(B=256, T=4, H=32, v_first=True, verify=4),
    # stochastic rounding (2-byte pools; an fp32 pool plans and compiles as the nearest case): its own tile
    "decode-sr-vfirst-256-h32": _decode(sr=True, B=256, T=1, H=32),
    "decode-sr-kfirst-256-h32": _decode(sr=True, B=256, T=1, H=32, v_first=False),
}
POOLS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def plan_overrides(text: str) -> dict:
    """`--plan`'s FIELD=VALUE,... as keyword overrides: integers, true / false, else the string."""
    import dataclasses

    from kda.plan import ChunkPlan, DecodePlan

    known = {f.name for cls in (ChunkPlan, DecodePlan) for f in dataclasses.fields(cls)}
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or name not in known:
            raise SystemExit(f"--plan: {item!r} is not FIELD=VALUE with a field of DecodePlan or ChunkPlan")
        low = value.lower()
        out[name] = (low == "true") if low in ("true", "false") else int(value) if value.lstrip("-").isdigit() \
            else value
    return out


def launches(case: str, pool: torch.dtype, device: DeviceInfo, overrides: dict | None = None) -> list[tuple]:
    """(kernel, args, meta) of every launch the case's call makes on `device` (its plan's fields replaced by
    `overrides`), caught before any reaches a device (the arguments are meta tensors)."""
    from kda.ops import launch as L
    from kda.ops.chunk import chunk_kda_fwd
    from kda.ops.fused_recurrent import fused_recurrent_kda_fwd

    kind, build = CASES[case]
    call = build(pool)
    caught = []
    real = L.DirectKernel.launch
    L.DirectKernel.launch = lambda self, grid, args, meta, *_: caught.append((self.fn, args, meta))
    try:
        if kind == "prefill":
            chunk_kda_fwd(call, *prefill_plan(call, device=device, **(overrides or {})))
        else:  # stochastic rounding only where the pool is narrow (fp32 refuses it)
            sr = kind == "decode-sr" and pool != torch.float32
            fused_recurrent_kda_fwd(call, decode_plan(call, sr, device=device, **(overrides or {})))
    finally:
        L.DirectKernel.launch = real
    return caught


FLAGS = ("BV", "TMA", "WAIT_CHUNKS", "WAIT_IN_LOOP", "SPIN", "FOLD", "SIGNAL_CHUNKS", "LAST_WAITS", "B2_FROM_WS",
         "IS_VARLEN", "SHORT", "NSUB", "KC", "PACKED", "PTX", "V_FIRST", "SR", "VERIFY", "DOT_PREC")


def specialised(fn, args: tuple, meta: dict, target: Target, maxnreg: int | None = None) -> tuple:
    """(source, options) of one caught launch as Triton's launch would specialise it for `target`: what
    `triton.compile` takes, and what Triton's cache keys the compiled kernel by."""
    backend = make_backend(target.target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    from kda.ops.launch import NUMERICS

    kwargs = {**meta, **NUMERICS}  # the options every launch states
    if maxnreg and target.target.backend == "cuda":
        kwargs["maxnreg"] = maxnreg
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    source = ASTSource
    if type(fn).__name__ == "GluonJITFunction":  # a Gluon kernel's module carries its warps and target
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), options


def compile_launch(fn, args: tuple, meta: dict, target: Target, maxnreg: int | None, out: Path | None,
                   label: str) -> dict:
    """Compile one caught launch for `target` as Triton's launch would specialise it; its resources."""
    src, options = specialised(fn, args, meta, target, maxnreg)
    signature = src.signature
    flags = {k: meta[k] for k in FLAGS if k in meta and meta[k] not in (False, 0, None)}
    if "state_src" in signature:  # the pool's dtype (the walk's and the decode kernels' state pointers)
        flags["state"] = signature["state_src"].lstrip("*")
    flags.update(warps=options.num_warps, stages=options.num_stages)
    row = dict(kernel=fn.__name__, flags=flags)
    t0 = time.time()
    try:
        kernel = triton.compile(src, target=target.target, options=options.__dict__)
    except Exception as e:  # noqa: BLE001 -- a failure is a row of the table
        lines = str(e).strip().splitlines() or [""]
        found = [x.split("error", 1)[-1].strip(" :") for x in lines if "error" in x.lower()][:2] or lines[-1:]
        row.update(error=f"{type(e).__name__}: " + "; ".join(found)[:300], trace=traceback.format_exc()[-2000:])
        return row
    row["seconds"] = round(time.time() - t0, 1)
    row["shared"] = kernel.metadata.shared
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{label}.ttgir").write_text(kernel.asm["ttgir"])
    if target.target.backend == "cuda":
        row.update(_ptxas(kernel.asm["ptx"], target, out, label))
    else:
        row.update(_amdgcn(kernel.asm["amdgcn"], out, label))
    # launchable: shared memory within the block's limit, registers within the target's (spills only cost time)
    row["fits"] = (row["shared"] <= target.device.max_smem and isinstance(row.get("registers"), int)
                   and row["registers"] <= target.max_regs)
    return row


@functools.cache
def _scratch() -> Path:
    """This process's folder for the PTX and cubins ptxas reads and writes: a shared one let two runs at once (Triton
    3.9 and 3.6, say) overwrite each other's files of the same label, and ptxas read a mix."""
    return Path(tempfile.mkdtemp(prefix="kda_offline_compile_"))


def _ptxas(ptx: str, target: Target, out: Path | None, label: str) -> dict:
    """Registers and spill bytes from `ptxas -v` (the ptxas Triton ships) on the kernel's PTX."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas = get_ptxas(target.target.arch).path
    work = out or _scratch()
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"{label}.ptx"
    src.write_text(ptx)
    cubin = work / f"{label}.cubin"
    r = subprocess.run([ptxas, "-v", f"--gpu-name={sm_arch_from_capability(target.target.arch)}", str(src), "-o",
                        str(cubin)], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    serialized = "C7512" in r.stderr  # every wgmma of the kernel awaited where issued (too few registers to pipeline)
    row = dict(registers=int(regs.group(1)) if regs else r.stderr.strip()[-200:],
               spills=int(spill.group(1)) if spill else 0,
               serialized=serialized,
               ptx=("wgmma" if "wgmma.mma_async" in ptx else "tcgen05" if "tcgen05.mma" in ptx
                    else "mma" if "mma.sync" in ptx else "-")
               + (" **serialized**" if serialized else "")
               + (", tma" if "cp.async.bulk.tensor" in ptx else "")
               + (", PTX spin" if "ld.acquire.gpu.global.b32" in ptx else "")
               + (", proxy fence" if "fence.proxy.async.global" in ptx else "")
               + (", griddepcontrol" if "griddepcontrol" in ptx else ""))
    cuobjdump = Path(ptxas).parent / "cuobjdump"
    if out is not None and cuobjdump.exists() and cubin.exists():
        sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True).stdout
        (out / f"{label}.sass").write_text(sass)
        row["sass"] = _loops(sass)
    return row


def _amdgcn(asm: str, out: Path | None, label: str) -> dict:
    """VGPRs (arch + accumulation), SGPRs, spills and scratch from the kernel's AMDGCN metadata."""
    if out is not None:
        (out / f"{label}.amdgcn").write_text(asm)

    def meta(key: str) -> int:
        m = re.search(rf"\.{key}:\s+(\d+)", asm)
        return int(m.group(1)) if m else 0

    vgpr, agpr = meta("vgpr_count"), meta("agpr_count")
    spilled = meta("vgpr_spill_count") + meta("sgpr_spill_count")
    return dict(registers=vgpr + agpr, sgprs=meta("sgpr_count"), spills=meta("private_segment_fixed_size"),
                ptx=("mfma" if "v_mfma" in asm else "-") + (f", {spilled} registers spilled" if spilled else ""))


def _loops(sass: str) -> str:
    """SASS instructions of each loop (backward branch) and their four commonest opcodes."""
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


def _cell(r: dict) -> str:
    if "error" in r:
        return "fails"
    extra = f" +{r['sgprs']}s" if "sgprs" in r else ""
    return (f"{r['registers']}{extra} / {r['spills']} / {r['shared'] / 1024:.0f}K "
            + ("**over**" if not r["fits"] else "spills" if r["spills"] else "ok")
            + (", wgmma **serialized**" if r.get("serialized") else ""))


def _flags(f: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in f.items())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated: " + ", ".join(TARGETS))
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    p.add_argument("--pools", default="fp32,bf16")
    p.add_argument("--maxnreg", type=int, default=None, help="register cap per thread (NVIDIA), a launch option")
    p.add_argument("--plan", default="", metavar="FIELD=VALUE,...",
                   help="replace these fields of every case's plan (DecodePlan or ChunkPlan)")
    p.add_argument("--out", type=Path, default=None, help="keep TTGIR, PTX/AMDGCN, SASS here")
    p.add_argument("--md", type=Path, default=None, help="write the markdown tables here")
    args = p.parse_args()
    targets = [TARGETS[t] for t in args.targets.split(",")]
    overrides = plan_overrides(args.plan)  # a bad field refused before anything compiles
    rows = []  # (case, pool, target, row)
    seen: dict = {}  # one compile per (target, kernel, specialisation)
    for target in targets:
        for case in args.cases.split(","):
            for pool_name in args.pools.split(","):
                for fn, a, m in launches(case, POOLS[pool_name], target.device, overrides):
                    bound_key = (target.name, fn.__name__, repr(create_function_from_signature(
                        fn.signature, fn.params, make_backend(target.target))(*a, **m)[1:]))
                    if bound_key not in seen:
                        label = f"{target.name}-{len(seen)}-{fn.__name__}"
                        seen[bound_key] = compile_launch(fn, a, m, target, args.maxnreg, args.out, label)
                        r = seen[bound_key]
                        print(f"{target.name} {case} {pool_name} {r['kernel']} {_flags(r['flags'])}: "
                              + (r["error"] if "error" in r else _cell(r) + f" ({r['seconds']} s)"),
                              flush=True)
                    rows.append((case, pool_name, target, seen[bound_key]))
    md = _markdown(rows, targets, args.maxnreg, args.md)
    print(md)
    if args.md:
        args.md.write_text(md)
    return 0


def _markdown(rows: list, targets: list[Target], maxnreg: int | None, out: Path | None = None) -> str:
    lines = [f"# Offline compiles: every kernel kda.plan launches, per target (Triton {triton.__version__})", "",
             f"`python benchmarks/offline_compile.py --md {out or 'FILE'}` on a CPU machine with Triton "
             f"{triton.__version__} installed"
             + (f", `--maxnreg {maxnreg}`" if maxnreg else "") + ". K = V = 128, bf16 inputs unless the case says "
             "otherwise; each call planned for the target's `DeviceInfo` and compiled with its launch's "
             "specialisation. A cell: registers a thread (AMD: VGPRs incl. AGPRs, +SGPRs) / spill bytes (AMD: "
             "scratch bytes a lane) / shared memory (LDS) / ok, spills (launchable, spilling), or **over** (shared "
             "memory past the block's limit, or registers past the target's: the launch would fail); wgmma "
             "**serialized** where ptxas awaits every wgmma where it is issued (its C7512: too few registers for "
             "the pipeline). Launch flags "
             "list the constexprs that are set (a flag not listed is off). Shared memory a block may use: "
             + ", ".join(f"{t.name} ({t.gpu}) {t.device.max_smem // 1024} KiB" for t in targets) + ".", ""]
    grid: dict = {}
    for case, pool, target, r in rows:
        key = (case, pool, r["kernel"])
        grid.setdefault(key, {}).setdefault(target.name, r)
    lines += ["| case | pool | kernel | " + " | ".join(f"{t.name} ({t.gpu})" for t in targets) + " |",
              "|---|---|---|" + "---|" * len(targets)]
    for (case, pool, kernel), cells in grid.items():
        lines.append(f"| {case} | {pool} | `{kernel}` | "
                     + " | ".join(_cell(cells[t.name]) if t.name in cells else "not launched" for t in targets)
                     + " |")
    lines += ["", "## Each compile", "",
              "| target | kernel | launch flags (constexprs, warps, stages) | registers | spill bytes | shared bytes | "
              "launches | code |", "|---|---|---|---|---|---|---|---|"]
    done = set()  # one row per distinct line: specialisations that differ only in integers' values compile alike
    for _case, _pool, target, r in rows:
        line = (target.name, r["kernel"], _flags(r["flags"]), r.get("error"), r.get("registers"), r.get("spills"),
                r.get("shared"))
        if line in done:
            continue
        done.add(line)
        if "error" in r:
            lines.append(f"| {target.name} | `{r['kernel']}` | {_flags(r['flags'])} | compile failed: "
                         f"{r['error'].replace('|', '/')} | | | no | |")
            continue
        regs = f"{r['registers']}" + (f" (+{r['sgprs']} SGPRs)" if "sgprs" in r else "")
        lines.append(f"| {target.name} | `{r['kernel']}` | {_flags(r['flags'])} | {regs} | {r['spills']} | "
                     f"{r['shared']} | {'yes' if r['fits'] else '**no**'} | {r['ptx']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
