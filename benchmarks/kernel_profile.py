"""Where one `kda` call spends its GPU time: the profiling tool beside the benchmark (needs a CUDA device).

    python benchmarks/kernel_profile.py times [--op chunk|decode] [shapes] [--plan K=V,..]  per-kernel CUDA time
    python benchmarks/kernel_profile.py timeline [...] [--plan K=V,..]   when each kernel of one call starts and ends
    python benchmarks/kernel_profile.py regs  [--op chunk|decode|both] [...]   registers, spills, shared memory
    python benchmarks/kernel_profile.py ncu   [--op ...] [--kernel REGEX] [--metrics M,..] [--run]   the ncu command
    python benchmarks/kernel_profile.py call  [--op ...] [...]   warm up, then one call (what ncu profiles)

The tool calls the public functions (`kda.chunk_kda`, `kda.fused_recurrent_kda`) with the benchmark's
inputs (bf16 q/k/v, Kimi's in-kernel lower-bound gate, q/k l2norm, beta sigmoid, K = V = 128) and reads
what ran: it never selects a kernel variant by rewriting module globals. `times --plan k=v,k=v`
(repeatable) also times `chunk_kda` under `kda.plan.chunk_plan(call, k=v, ...)`, one variant per `--plan`,
in the same process; `timeline` takes the same variants and prints, for the last of `--reps` calls, each kernel's
stream, start and end from the call's first kernel (the walk beside the prepare: when it starts, how long a
chunk step takes beside the prepare's programs). Shapes: `--op chunk` is a dense prefill `--B x --T` at `--H`
heads with an fp32 initial state; `--op decode` is one token for each of `--N` sequences through a paged pool of
4N slots (`--pool fp32|bf16|fp16`, `--layout v_first|k_first`, `--varlen` for the `cu_seqlens` + `cu_seqlens_cpu`
form; `--draft T`: speculative verify of T drafts a sequence through a pool of 4NT slots).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import pkgutil
import shlex
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

POOL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
K_DIM = V_DIM = 128


def parse_plan(spec: str) -> dict:
    """'walk_BV=64,walk_warps=8' -> {'walk_BV': 64, 'walk_warps': 8} (values as Python literals, else strings)."""
    out = {}
    for item in filter(None, spec.split(",")):
        key, _, val = item.partition("=")
        try:
            out[key] = ast.literal_eval(val)
        except (ValueError, SyntaxError):
            out[key] = val
    return out


def make_call(op: str, args: argparse.Namespace, plan: dict | None = None):
    """A zero-argument callable issuing one public call with the benchmark's inputs (for `chunk` with `plan`:
    the same call through `kda.plan.chunk_plan(call, **plan)`)."""
    import kda

    dev, H = "cuda", args.H
    D = args.draft if op == "decode" else 1
    ntok = args.B * args.T if op == "chunk" else args.N * D
    B, T = (args.B, args.T) if op == "chunk" else ((1, ntok) if args.varlen or D > 1 else (args.N, 1))
    assert B * T == ntok
    q = torch.randn(B, T, H, K_DIM, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, T, H, K_DIM, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, T, H, V_DIM, device=dev, dtype=torch.bfloat16)
    g = torch.randn(B, T, H, K_DIM, device=dev)
    beta = torch.randn(B, T, H, device=dev, dtype=torch.bfloat16)
    flags = dict(use_gate_in_kernel=True, A_log=torch.empty(H, device=dev).uniform_(1.0, 16.0).log_(),
                 dt_bias=0.5 * torch.randn(H * K_DIM, device=dev), lower_bound=-5.0,
                 use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    if op == "chunk":
        h0 = 0.1 * torch.randn(args.B, H, K_DIM, V_DIM, device=dev)
        if plan:
            from kda.api import check_call_args
            from kda.contract import check_call
            from kda.ops.chunk import chunk_kda_fwd
            from kda.plan import prefill_plan

            positional, keywords = check_call_args(kda.chunk_kda, q, k, v, g, beta, None, h0, True, **flags)
            call = check_call(*positional, **keywords)
            chosen = prefill_plan(call, **plan)
            return lambda: chunk_kda_fwd(call, *chosen)
        return lambda: kda.chunk_kda(q, k, v, g, beta, None, h0, True, **flags)
    v_first = args.layout == "v_first"
    plane = (H, V_DIM, K_DIM) if v_first else (H, K_DIM, V_DIM)
    pool = (0.1 * torch.randn(4 * ntok, *plane, device=dev)).to(POOL_DTYPES[args.pool])
    idx = torch.randperm(4 * ntok, device=dev)[:ntok].to(torch.int32)
    extra = {}
    if D > 1:  # speculative verify: a slot per draft, each sequence's state read from its second draft's slot
        idx = idx.view(args.N, D)
        extra = dict(cu_seqlens=torch.arange(0, ntok + 1, D, dtype=torch.int32, device=dev),
                     cu_seqlens_cpu=list(range(0, ntok + 1, D)),
                     num_accepted_tokens=torch.full((args.N,), 2, dtype=torch.int32, device=dev))
    elif args.varlen:
        extra = dict(cu_seqlens=torch.arange(args.N + 1, dtype=torch.int32, device=dev),
                     cu_seqlens_cpu=list(range(args.N + 1)))
    return lambda: kda.fused_recurrent_kda(q, k, v, g, beta, state_cache=pool, state_indices=idx,
                                           state_v_first=v_first, **extra, **flags)


def ops_for(args) -> list[str]:
    return ["chunk", "decode"] if args.op == "both" else [args.op]


def warm(fn, n: int = 3) -> None:
    for _ in range(n):
        fn()
    torch.cuda.synchronize()


def profiled(args):
    """(op, plan overrides or None, the profiler) of `args.reps` calls of each variant (each call synced, so that
    calls do not overlap in the trace), after a warm-up."""
    from torch.profiler import ProfilerActivity, profile

    variants = [(op, None) for op in ops_for(args)]
    variants += [("chunk", parse_plan(spec)) for spec in args.plan]
    for op, plan in variants:
        fn = make_call(op, args, plan)
        warm(fn)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                fn()
                torch.cuda.synchronize()
        yield op, plan, prof


def cmd_times(args) -> int:
    for op, plan, prof in profiled(args):
        rows = []
        for e in prof.key_averages():
            dev_us = getattr(e, "device_time_total", None)
            if dev_us is None:
                dev_us = getattr(e, "cuda_time_total", 0.0)
            if dev_us > 0:
                rows.append((dev_us / args.reps, e.count // args.reps, e.key))
        rows.sort(reverse=True)
        label = describe(op, args) + (f", plan {plan}" if plan else "")
        print(f"## {label}: GPU time per call, mean of {args.reps} calls (torch.profiler)")
        print("| kernel | us | launches |\n|---|---|---|")
        for us, count, name in rows:
            print(f"| {name} | {us:.1f} | {count} |")
        print(f"| **total** | **{sum(r[0] for r in rows):.1f}** | {sum(r[1] for r in rows)} |\n")
    return 0


def kernel_spans(trace: dict) -> list[tuple[float, float, int, str]]:
    """(start us, end us, stream, name) of every GPU kernel in a chrome trace (`torch.profiler` export), by start."""
    spans = [(e["ts"], e["ts"] + e.get("dur", 0.0), e.get("args", {}).get("stream", -1), e["name"])
             for e in trace.get("traceEvents", [])
             if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel"]
    return sorted(spans)


def last_call(spans: list, first: str) -> list:
    """The kernels from the last launch of kernel `first` (a call's first kernel) on."""
    starts = [i for i, sp in enumerate(spans) if sp[3] == first]
    return spans[starts[-1]:] if starts else spans


def cmd_timeline(args) -> int:
    import json
    import tempfile

    from kda.plan import CHUNK, cdiv

    for op, plan, prof in profiled(args):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            spans = kernel_spans(json.loads(Path(f.name).read_text()))
        if not spans:
            print("no kernel events in the trace")
            continue
        call = last_call(spans, spans[0][3])
        t0 = call[0][0]
        label = describe(op, args) + (f", plan {plan}" if plan else "")
        print(f"## {label}: the last of {args.reps} calls, us from its first kernel's start (torch.profiler)")
        print("| kernel | stream | start | end | us |\n|---|---|---|---|---|")
        for start, end, stream, name in call:
            print(f"| {name} | {stream} | {start - t0:.1f} | {end - t0:.1f} | {end - start:.1f} |")
        chunks = cdiv(args.T, CHUNK) if op == "chunk" else 0
        walk = [sp for sp in call if "state_kernel" in sp[3]]
        tail = f"; walk {(walk[0][1] - walk[0][0]) / chunks:.3f} us a chunk step" if walk and chunks else ""
        print(f"call: {max(sp[1] for sp in call) - t0:.1f} us{tail}\n")
    return 0


def jit_kernels():
    """(name, JITFunction) of every Triton kernel defined in the modules of `kda.ops`."""
    from triton.runtime.jit import JITFunction

    import kda.ops

    found = {}
    for info in pkgutil.iter_modules(kda.ops.__path__):
        module = importlib.import_module(f"kda.ops.{info.name}")
        for name, obj in vars(module).items():
            fn = obj
            while fn is not None and not isinstance(fn, JITFunction):
                fn = getattr(fn, "fn", None)  # autotuner / heuristics wrappers
            if fn is not None and getattr(fn, "__module__", module.__name__) == module.__name__:
                found[f"{info.name}.{name}"] = fn
    return sorted(found.items())


def compiled_variants(fn):
    """The CompiledKernel objects in a JITFunction's caches (every device, every specialisation)."""
    for entry in getattr(fn, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        yield from cache.values()


def cmd_regs(args) -> int:
    for op in ops_for(args):
        warm(make_call(op, args), n=1)
        print(f"(compiled by: {describe(op, args)})")
    print("| kernel | warps | stages | registers | spills | shared bytes |\n|---|---|---|---|---|---|")
    for name, fn in jit_kernels():
        for kernel in compiled_variants(fn):
            try:
                kernel._init_handles()  # loads the binary; fills n_regs and n_spills
            except Exception as e:  # noqa: BLE001 - report, go on
                print(f"| {name} | - | - | {type(e).__name__} | - | - |")
                continue
            md = kernel.metadata
            print(f"| {name} | {md.num_warps} | {md.num_stages} | {kernel.n_regs} | {kernel.n_spills} | {md.shared} |")
    return 0


def cmd_call(args) -> int:
    for op in ops_for(args):
        fn = make_call(op, args)
        warm(fn)
        torch.cuda.profiler.start()  # ncu --profile-from-start off sees this call only, not the warm-up
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


def _call_args(argv: list[str]) -> list[str]:
    """`ncu`'s arguments less its own options (`--run`, `--kernel X`, `--metrics X`): what `call` takes."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--kernel", "--metrics"):
            skip = True
        elif a != "--run" and not a.startswith(("--kernel=", "--metrics=")):
            out.append(a)
    return out


def cmd_ncu(args) -> int:
    forward = _call_args(sys.argv[2:])
    kernel = ["--kernel-name", f"regex:{args.kernel}"] if args.kernel else []
    # `call` brackets its one timed call with cudaProfilerStart/Stop: the warm-up calls are not profiled
    sections = ("SpeedOfLight", "WarpStateStats", "Occupancy", "LaunchStats", "ComputeWorkloadAnalysis",
                "MemoryWorkloadAnalysis", "SchedulerStats", "SourceCounters")
    what = [x for s in sections for x in ("--section", s)]
    if args.metrics:  # only these counters: a few passes instead of the sections' dozens
        what = ["--metrics", args.metrics]
    cmd = ["ncu", "--profile-from-start", "off", *kernel, *what,
           sys.executable, str(Path(__file__).resolve()), "call", *forward]
    print(shlex.join(cmd))
    if args.run:
        return subprocess.call(cmd)
    return 0


def describe(op: str, args) -> str:
    if op == "chunk":
        return f"chunk_kda {args.B}x{args.T} H={args.H}, dense fp32 initial state"
    form = "varlen cu_seqlens + cu_seqlens_cpu" if args.varlen else f"dense [{args.N}, 1]"
    if args.draft > 1:
        form = f"verify of {args.draft} drafts a sequence"
    slots = 4 * args.N * args.draft
    return f"fused_recurrent_kda N={args.N} H={args.H}, {args.pool} {args.layout} pool of {slots} slots, {form}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/kernel_profile.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("times", "per-kernel CUDA time of one call (torch.profiler)"),
                        ("regs", "registers, spills and shared memory of the kernels one call compiled"),
                        ("timeline", "each kernel's start and end in one call (torch.profiler trace)"),
                        ("ncu", "print (--run: run) the Nsight Compute command line for one call"),
                        ("call", "warm up, then one call (the workload ncu profiles)")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--op", choices=("chunk", "decode", "both"), default="chunk" if name != "regs" else "both")
        s.add_argument("--B", type=int, default=1, help="chunk: batch (default 1)")
        s.add_argument("--T", type=int, default=16384, help="chunk: tokens per sequence (default 16384)")
        s.add_argument("--H", type=int, default=32, help="heads, HV = H (default 32)")
        s.add_argument("--N", type=int, default=256, help="decode: sequences (default 256)")
        s.add_argument("--pool", choices=tuple(POOL_DTYPES), default="fp32", help="decode: pool dtype")
        s.add_argument("--layout", choices=("v_first", "k_first"), default="v_first", help="decode: pool layout")
        s.add_argument("--varlen", action="store_true", help="decode: cu_seqlens + cu_seqlens_cpu instead of [N, 1]")
        s.add_argument("--draft", type=int, default=1, metavar="T",
                       help="decode: speculative verify of T drafts a sequence, a slot each (default 1: decode)")
        if name in ("times", "timeline"):
            s.add_argument("--reps", type=int, default=3, help="calls profiled (default 3)")
            s.add_argument("--plan", action="append", default=[], metavar="K=V,...",
                           help="also time chunk_kda under chunk_plan(call, K=V, ...) (repeatable)")
        if name == "ncu":
            s.add_argument("--kernel", default=None, metavar="REGEX", help="only kernels whose name matches")
            s.add_argument("--run", action="store_true", help="run the command instead of printing it")
            s.add_argument("--metrics", default=None, metavar="M1,M2",
                           help="these ncu metrics instead of the sections (e.g. dram__bytes_read.sum,"
                                "lts__t_sector_hit_rate.pct: whether a second read hits L2)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "ncu":
        return cmd_ncu(args)
    if not torch.cuda.is_available():
        print("benchmarks/kernel_profile.py needs a CUDA device", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    return {"times": cmd_times, "timeline": cmd_timeline, "regs": cmd_regs, "call": cmd_call}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
