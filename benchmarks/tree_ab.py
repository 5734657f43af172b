"""Two or more copies of the package timed in one device call: `chunk_kda` by graph replay at the
benchmark's prefill shapes, its kernels by torch.profiler, and its bf16-input accuracy against the float64
chunk oracle, each tree imported in its own process, in turns (a, b, a, b, ...), so that every variant
meets the same machine state. This is how a kernel change is weighed before it lands
(`benchmarks/results/2026-12-02-37c2d18-h200-prepare-folded-inverse.md`).

    python benchmarks/tree_ab.py [--rounds 2] [--shapes 1x16384x32,4x4096x32,varlen,mixed] [--child-timeout 240]
                                 TREE[:LABEL] TREE[:LABEL] ...

A TREE is a directory holding `kda/`, `kda_reference/` and `benchmarks/bench.py` (`.` for this checkout;
another commit: `git archive <rev> kda kda_reference benchmarks | tar -x -C <dir>`, an ignored folder named
in the device call's `carry`). Prints one line per shape and tree, then a summary of each tree's graph time
over the first tree's, shape by shape and as a geometric mean. Inputs as `bench.py`'s prefill rows: bf16
q, k, v, fp32 g with Kimi's in-kernel lower-bound gate (-5), q/k l2norm, beta sigmoid, fp32 initial and
final state, K = V = 128.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time

SHAPES = "1x16384x32,4x4096x32,1x4096x12,1x16384x12,1x65536x12,1x8192x96,1x4096x32,varlen"
# the accuracy calls (T, H): few heads, and heads enough for `kda.plan.wide_heads` on the H200 (its own plan)
ACCURACY = ((2048, 4), (8192, 4), (4096, 32))


def inputs(bench, B: int, T: int, H: int, seed: int, dev: str):
    """The benchmark's prefill inputs (`bench._tokens` of the tree's `bench.py`), an fp32 initial state, the flags."""
    import torch

    torch.manual_seed(seed)
    q, k, v, g, beta, A_log, dt_bias = bench._tokens(B, T, H, H, dev)
    flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                 A_log=A_log, dt_bias=dt_bias, lower_bound=bench.LOWER_BOUND)
    h0 = torch.randn(B, H, 128, 128, device=dev) * 0.1
    return q, k, v, g, beta, h0, flags


def row(bench, kda, shape, dev: str):
    """(name, call) of one shape: B x T x H dense, or the benchmark's own varlen or mixed row (one `chunk_kda`
    call) as `bench.py` builds it."""
    import torch

    if shape in ("varlen", "mixed"):
        torch.manual_seed(0)
        case = next(c for c in bench.all_cases() if c.group == shape)
        return case.name, bench.build(case, None, {}, dev)[0]["kda"]
    B, T, H = shape
    q, k, v, g, beta, h0, flags = inputs(bench, B, T, H, 0, dev)
    return f"{B}x{T} H={H}", functools.partial(kda.chunk_kda, q, k, v, g, beta, None, h0, True, **flags)


def child(tree: str, shapes: list, accuracy: bool) -> None:
    """Runs in the subprocess: times `tree`'s package and prints one JSON line."""
    sys.path.insert(0, os.path.join(tree, "benchmarks"))
    sys.path.insert(0, tree)
    import bench
    import torch

    import kda
    import kda_reference as ref

    dev = "cuda"
    timer = bench.Timer(warmup_ms=25, rep_ms=300)

    rows = []
    for shape in shapes:
        t0 = time.time()
        name, call = row(bench, kda, shape, dev)

        us = timer.graph(call)
        eager_us, (host_us, cpu_us) = timer.eager(call), timer.host(call)
        call()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels = {e.key: round(getattr(e, "device_time_total", 0.0), 1) for e in prof.key_averages()
                   if e.device_type == torch.autograd.DeviceType.CUDA}
        rows.append(dict(shape=name, graph_us=round(us, 1), eager_us=round(eager_us, 1),
                         host_us=round(host_us, 1), cpu_us=round(cpu_us, 1), kernels=kernels))
        print(f"{tree}: {name} {us:.1f} us, {time.time() - t0:.0f} s with its compiles", file=sys.stderr, flush=True)
        del call
        torch.cuda.empty_cache()
    acc = []
    for T, H in ACCURACY if accuracy else ():
        q, k, v, g, beta, h0, flags = inputs(bench, 1, T, H, 3, dev)
        o, s = kda.chunk_kda(q, k, v, g, beta, None, h0, True, **flags)
        # the oracle computes in float64 from the call's own tensors (any tree's oracle takes them)
        ro, rs = ref.chunk_kda(q, k, v, g, beta, None, h0, True, **flags)
        acc.append(dict(T=T, H=H, out=bench._rel(o, ro), state=bench._rel(s, rs),
                        floor=bench._rel(ro.to(torch.bfloat16), ro)))
    print("RESULT " + json.dumps(dict(rows=rows, acc=acc)), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs="+", metavar="TREE[:LABEL]")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--shapes", default=SHAPES,
                   help=f"BxTxH, varlen or mixed (the benchmark's rows), comma separated (default {SHAPES})")
    p.add_argument("--no-accuracy", action="store_true", help="time only (no accuracy calls)")
    p.add_argument("--child-timeout", type=float, default=240.0, metavar="S",
                   help="seconds a tree's process may take (a call that never finishes: that round is skipped)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    shapes = [s if s in ("varlen", "mixed") else tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    if a.child is not None:
        child(a.child, shapes, not a.no_accuracy)
        return
    trees = [(t.split(":", 1) + [t])[:2] if ":" in t else [t, t] for t in a.trees]
    best: dict[str, dict[str, float]] = {}
    best_cpu: dict[str, dict[str, float]] = {}  # the host's CPU time per call: another tenant does not add to it
    for r in range(a.rounds):
        for path, label in trees:
            env = dict(os.environ, PYTHONPATH="")
            t0 = time.time()
            # the child's progress (stderr) shows as it goes, not only its result at its end
            try:
                out = subprocess.run([sys.executable, __file__, "--child", os.path.abspath(path), "--shapes",
                                      a.shapes, *(["--no-accuracy"] if a.no_accuracy else []), "x"],
                                     stdout=subprocess.PIPE, text=True, env=env, timeout=a.child_timeout).stdout
            except subprocess.TimeoutExpired:
                print(f"{label} round {r}: no result within {a.child_timeout:g} s (killed)", flush=True)
                continue
            res = next((json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")), None)
            print(f"{label} round {r}: {time.time() - t0:.0f} s in its process (compiles included)", flush=True)
            if res is None:
                print(f"{label} round {r}: failed (its stderr above)", flush=True)
                continue
            for row in res["rows"]:
                ker = ", ".join(f"{k[:32]} {v}" for k, v in row["kernels"].items())
                print(f"{label:12s} r{r} {row['shape']:14s} {row['graph_us']:9.1f} us  eager {row['eager_us']:.1f}"
                      f"  host {row['host_us']:.1f} cpu {row['cpu_us']:.1f}   ({ker})", flush=True)
                mine = best.setdefault(label, {})
                mine[row["shape"]] = min(mine.get(row["shape"], math.inf), row["graph_us"])
                cpu = best_cpu.setdefault(label, {})
                cpu[row["shape"]] = min(cpu.get(row["shape"], math.inf), row["cpu_us"])
            for x in res["acc"]:
                print(f"{label:12s} r{r} accuracy T={x['T']} H={x['H']}: output {x['out']:.4e} state {x['state']:.4e} "
                      f"(bf16 floor {x['floor']:.4e})", flush=True)
    base = trees[0][1]
    print(f"\nbest graph us over the rounds, and over {base}'s:")
    for _, label in trees:
        got = best.get(label, {})
        ratios = [got[s] / best[base][s] for s in got if s in best.get(base, {})]
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")
        cells = "  ".join(f"{s} {got[s]:.1f}" for s in got)
        print(f"{label:12s} {cells}  geomean {geo:.3f}")
    print("\nbest host CPU us per call over the rounds (time.thread_time of the host loop):")
    for _, label in trees:
        print(f"{label:12s} " + "  ".join(f"{s} {u:.1f}" for s, u in best_cpu.get(label, {}).items()))


if __name__ == "__main__":
    main()
