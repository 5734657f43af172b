"""Static SASS census of the prepare for sm_90 (no GPU): the tl twin (`_chunk_prepare_kernel`) and the Gluon forms
v4-v8 of `kda/ops/hopper_prepare.py` at the H200 plan of a 1x16384 H=32 bf16 call (fp32 pool), each compiled with
the specialisation its caught launch gets (as `offline_compile.py`), SASS with line info (ptxas -lineinfo,
nvdisasm -g), then counted per (chunk, head) item: the tl K loop (not unrolled) times its 4 trips, the persistent
v7's item loop once without the first item's copies, the one-token branch left out.

    PYTHONPATH=. python benchmarks/prepare_sass.py --out DIR [--forms tl,v4,v5,v6,v7,v8] [--case NAME] [--fold on]

Run under Triton 3.6 (the GPU machine's). Phases are source-line ranges of the files at 93db6ad (checked below;
v8's from marker lines);
an instruction from a helper file or helper line takes the phase of the kernel line before it, so phase splits
are approximate, the item totals are not. Results: benchmarks/results/offline-gluon-prepare-sass.md."""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

VARIANTS = {"v4": dict(), "v5": dict(num_warps=8), "v6": dict(num_warps=8, maxnreg=128),
            "v7": dict(num_warps=8, programs=132), "v8": dict(form="v8")}
WARPS = {"tl": 4, "v4": 4, "v5": 8, "v6": 8, "v7": 8, "v8": 4}
KFILE = {"tl": "chunk_prepare.py", "v4": "hopper_prepare.py", "v5": "hopper_prepare.py",
         "v6": "hopper_prepare.py", "v7": "hopper_prepare.py", "v8": "hopper_prepare.py"}
PH_G = [((53, 58), "inverse"), ((66, 101), "locate"), ((103, 137), "one_row"), ((139, 151), "count"),
        ((153, 164), "kloop"), ((166, 205), "copies"), ((208, 316), "setup"), ((317, 337), "norms"),
        ((338, 342), "one_row"), ((343, 386), "kloop"), ((387, 394), "Lform"), ((395, 416), "inverse"),
        ((417, 444), "store"), ((445, 447), "count")]
PH_T = [((66, 81), "locate"), ((95, 112), "count"), ((123, 179), "norms"), ((181, 188), "kloop"),
        ((190, 198), "setup"), ((232, 253), "kloop"), ((254, 261), "Lform"), ((321, 344), "store"),
        ((345, 395), "one_row"), ((396, 445), "inverse"), ((493, 500), "kloop"), ((503, 551), "setup"),
        ((552, 556), "norms"), ((557, 564), "one_row"), ((565, 615), "kloop"), ((616, 631), "Lform"),
        ((632, 636), "inverse"), ((637, 641), "store"), ((642, 647), "count")]
# v8 (appended after the v4-v7 kernel): phases from marker lines, found when the census runs
V8_MARKS = [("def _v8_op", "kloop"), ("def _v8_copies", "copies"), ("def _chunk_prepare_hopper_v8_kernel", "setup"),
            ("        # the norms pass", "norms"), ("        if n_rows == 1:", "one_row"),
            ("            # the K loop:", "kloop"), ("            r = gl.arange(0, BT", "Lform"),
            ("            # Y = X^T", "inverse"), ("            if FOLD:", "store"),
            ("        if SIGNAL_CHUNKS > 0:", "count")]


def v8_phases() -> list:
    lines = (ROOT / "kda" / "ops" / "hopper_prepare.py").read_text().splitlines()
    start = next(n for n, t in enumerate(lines, 1) if t.startswith("def _v8_op")) - 2
    marks = [(next(n for n, t in enumerate(lines, 1) if n >= start and t.startswith(m)), ph) for m, ph in V8_MARKS]
    ends = [n - 1 for n, _ in marks[1:]] + [len(lines)]
    return [r for r in PH_G if r[0][1] < start] + [((n, e), ph) for (n, ph), e in zip(marks, ends)]


CHECK = {("hopper_prepare.py", 338): "if n_rows == 1", ("hopper_prepare.py", 350): "for s in gl.static_range(NKS)",
         ("chunk_prepare.py", 557): "if n_rows == 1", ("chunk_prepare.py", 573): "for k0 in range(0, K, BK)"}


def compile_forms(out: Path, forms: list[str], case: str = "prefill-1x16384-h32",
                  plan_over: dict | None = None) -> None:
    import offline_compile as OC
    import torch
    import triton
    from triton.compiler import ASTSource, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    import kda.ops.chunk as C
    import kda.plan as P
    from kda.ops import launch as L
    from kda.ops.launch import NUMERICS

    tgt = OC.TARGETS["sm_90"]
    for form in forms:
        call = OC.CASES[case][1](torch.float32)
        plan, route = P.prefill_plan(call, device=tgt.device)
        plan = replace(plan, **(plan_over or {}))
        if form != "tl":
            plan = replace(plan, prepare="hopper")
            C.HOPPER_VARIANT.clear()
            C.HOPPER_VARIANT.update(VARIANTS[form])
        caught = []
        real = L.DirectKernel.launch
        L.DirectKernel.launch = lambda self, grid, args, meta, caught=caught: caught.append((self.fn, grid, args, meta))
        try:
            C.chunk_kda_fwd(call, plan, route)
        finally:
            L.DirectKernel.launch = real
            C.HOPPER_VARIANT.clear()
        name = {"tl": "_chunk_prepare_kernel", "v8": "_chunk_prepare_hopper_v8_kernel"}.get(
            form, "_chunk_prepare_hopper_kernel")
        fn, grid, args, meta = next(c for c in caught if c[0].__name__ == name)
        backend = make_backend(tgt.target)
        kwargs = {**meta, **NUMERICS}
        bound, spec, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
        src = (ASTSource if form == "tl" else GluonASTSource)(fn=fn, signature=signature, constexprs=constexprs,
                                                               attrs=attrs)
        k = triton.compile(src, target=tgt.target, options=options.__dict__)
        (out / f"{form}.ttgir").write_text(k.asm["ttgir"])
        (out / f"{form}.ptx").write_text(k.asm["ptx"])
        (out / f"{form}.cubin").write_bytes(k.asm["cubin"])  # Triton's ptxas runs with -lineinfo
        from triton.backends.nvidia.compiler import get_ptxas
        nvdisasm = Path(get_ptxas(90).path).parent / "nvdisasm"
        sass = subprocess.run([str(nvdisasm), "-g", "-c", str(out / f"{form}.cubin")], capture_output=True,
                              text=True, check=True).stdout
        (out / f"{form}.sass").write_text(sass)
        meta_row = dict(grid=list(grid), warps=options.num_warps, maxnreg=options.maxnreg,
                        regs=k.metadata.num_regs if hasattr(k.metadata, "num_regs") else None,
                        shared=k.metadata.shared, flags={a: str(b) for a, b in meta.items()})
        (out / f"{form}.json").write_text(json.dumps(meta_row))
        print(form, meta_row, flush=True)


def parse(path: Path) -> list[dict]:
    ins, cur, pending, labels = [], (None, 0), [], {}
    for line in path.read_text().splitlines():
        m = re.match(r'\s*//## File "([^"]+)", line (\d+)', line)
        if m:
            cur = (m.group(1).split("/")[-1], int(m.group(2)))
            continue
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);", line)
        if m:
            a = int(m.group(1), 16)
            for p in pending:
                labels[p] = a
            pending = []
            t = re.search(r"`\((\.L_x_\d+)\)", m.group(4))
            ins.append(dict(addr=a, op=m.group(3), args=m.group(4), file=cur[0], line=cur[1],
                            target=t.group(1) if t else None))
    for i in ins:
        i["taddr"] = labels.get(i["target"]) if i["target"] else None
    return ins


def classify(ins: list[dict], form: str) -> None:
    table = PH_T if form == "tl" else v8_phases() if form == "v8" else PH_G
    ph = "setup"
    for i in ins:
        if i["file"] == KFILE[form]:
            for (a, b), p in table:
                if a <= i["line"] <= b:
                    ph = p
                    break
        i["phase"] = ph


def blocks(ins: list[dict]) -> list[list[dict]]:
    starts = {ins[0]["addr"]}
    for k, i in enumerate(ins):
        if i["op"].startswith(("BRA", "EXIT", "RET", "BSYNC", "WARPSYNC")):
            if k + 1 < len(ins):
                starts.add(ins[k + 1]["addr"])
            if i["taddr"] is not None:
                starts.add(i["taddr"])
    out, cur = [], []
    for i in ins:
        if i["addr"] in starts and cur:
            out.append(cur)
            cur = []
        cur.append(i)
    return out + [cur]


def width(op: str) -> int:
    for suf, b in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1), (".S8", 1)):
        if suf in op:
            return b
    return 4


def cat(i: dict) -> list[tuple[str, int]]:
    op, args = i["op"], i["args"]
    base = op.split(".")[0]
    if base == "HGMMA":
        a = "A:smem" if args.split(",")[1].strip().startswith("gdesc") else "A:reg"
        return [("HGMMA", 1), (f"HGMMA {op.split('.')[1]} {a}", 1)]
    if op.startswith("WARPGROUP.ARRIVE"):
        return [("WG.ARRIVE", 1)]
    if op.startswith("WARPGROUP.DEPBAR"):
        return [("WG.DEPBAR", 1)]
    if base in ("WARPSYNC", "NOP", "SHFL"):
        return [(base, 1)]
    if base == "BAR":
        return [("BAR." + op.split(".")[1], 1)]
    if base in ("LDS", "STS", "LDG", "STG", "LDGSTS", "LDL", "STL"):
        return [(base, 1), (f"{base} B/thr", width(op))]
    if base in ("LDSM", "STSM"):
        n = 4 if op.endswith(".4") else 2 if op.endswith(".2") else 1
        return [(base, 1), (f"{base} B/thr", 4 * n)]
    if base == "MUFU":
        return [(op, 1)]
    if base in ("F2F", "F2FP"):
        return [(base, 1)]
    if base in ("ATOM", "ATOMG", "RED", "REDG", "ATOMS"):
        return [("atomics", 1)]
    if base in ("FENCE", "MEMBAR"):
        return [("FENCE/MEMBAR", 1)]
    if base in ("DEPBAR", "LDGDEPBAR"):
        return [(base, 1)]
    return []


def analyse(out: Path, form: str) -> dict:
    ins = parse(out / f"{form}.sass")
    classify(ins, form)
    excl = set()
    for b in blocks(ins):
        if sum(i["phase"] == "one_row" for i in b) > len(b) / 2:
            excl.update(i["addr"] for i in b)
    loop = None  # the last backward branch over more than 16 instructions
    for i in ins:
        if i["taddr"] is not None and i["taddr"] < i["addr"] - 0x100:
            loop = (i["taddr"], i["addr"])
    lo, hi, mult = 0, 1 << 40, {}
    if form == "tl":  # the K loop: 4 trips (K = 128, BK = 32)
        mult = {i["addr"]: 4 for i in ins if loop[0] <= i["addr"] <= loop[1]}
    elif form == "v7":  # the item loop once, less `if it == 0`'s copies (the first forward branch over them)
        lo, hi = loop
        skip = min((i for i in ins if i["op"].startswith("BRA") and i["taddr"] and lo < i["addr"] < i["taddr"]
                    and any(j["phase"] == "copies" for j in ins if i["addr"] < j["addr"] < i["taddr"])),
                   key=lambda i: i["taddr"] - i["addr"])  # the shortest: `if it == 0`, not `if t0 < eos`
        excl.update(j["addr"] for j in ins if skip["addr"] < j["addr"] < skip["taddr"])
    item, static, phases = collections.Counter(), collections.Counter(), collections.defaultdict(collections.Counter)
    for i in ins:
        static["total"] += 1
        for k, v in cat(i):
            static[k] += v
        if i["addr"] in excl or not lo <= i["addr"] <= hi or (i["op"] == "BRA" and i["taddr"] == i["addr"]):
            continue
        m = mult.get(i["addr"], 1)
        item["total"] += m
        phases[i["phase"]]["total"] += m
        for k, v in cat(i):
            item[k] += v * m
            phases[i["phase"]][k] += v * m
    return dict(warps=WARPS[form], static=static, item=item, phases={k: dict(v) for k, v in phases.items()})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--forms", default="tl,v4,v5,v6,v7")
    p.add_argument("--no-compile", action="store_true", help="count the SASS already in --out")
    p.add_argument("--case", default="prefill-1x16384-h32", help="a prefill case of offline_compile.py")
    p.add_argument("--fold", choices=("plan", "on", "off"), default="plan", help="ChunkPlan.fold: the plan's or forced")
    a = p.parse_args()
    for (f, n), text in CHECK.items():
        assert text in (ROOT / "kda" / "ops" / f).read_text().splitlines()[n - 1], (f, n, "phase table is stale")
    forms = a.forms.split(",")
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.no_compile:
        compile_forms(a.out, forms, a.case, {} if a.fold == "plan" else {"fold": a.fold == "on"})
    res = {f: analyse(a.out, f) for f in forms}
    (a.out / "counts.json").write_text(json.dumps(res, indent=1))
    keys = sorted({k for r in res.values() for k in r["item"]}, key=lambda k: (k != "total", k))
    print("per item, per thread (static in the binary)".ljust(34) + "".join(f"{f:>16}" for f in forms))
    for k in keys:
        print(k.ljust(34) + "".join(f"{r['item'].get(k, 0):>9}/{r['static'].get(k, 0):<6}" for r in res.values()))
    print("warp-instructions per item".ljust(34) + "".join(f"{r['item']['total'] * r['warps']:>16}"
                                                           for r in res.values()))
    for f, r in res.items():
        print(f"{f}: " + ", ".join(f"{ph} {d['total'] * r['warps']}" for ph, d in r["phases"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
