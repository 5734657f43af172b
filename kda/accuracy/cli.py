"""`python -m kda.accuracy`: run the studies of a preset, write the report, optionally `--check` it."""

from __future__ import annotations

import argparse
import os
import sys
import time

SECTIONS = ("decode", "length", "dtype_matrix", "chunked_prefill", "varlen", "paged", "adversarial", "spec_verify",
            "checkpoints")
# The optional dependencies of the harness (pyproject.toml's `reports` extra): module -> what needs it.
REPORT_DEPS = {"numpy": "the fits", "scipy": "the fits' intervals", "matplotlib": "the plots"}
INSTALL_HINT = 'pip install "kda[reports]"   (from a checkout: pip install -e ".[reports]")'


def missing_dependencies(plots: bool = True) -> list[str]:
    """The optional modules the run needs and cannot import ("matplotlib" only when plots are drawn).
    Checked before any measurement: a missing one would otherwise fail after minutes of work."""
    import importlib

    missing = []
    for name in REPORT_DEPS:
        if name == "matplotlib" and not plots:
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def require_dependencies(argv) -> None:
    """Exit 2 with the install command when an optional dependency is missing (see missing_dependencies)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--no-plots", action="store_true")
    pre.add_argument("--inputs", default=None)
    known = pre.parse_known_args(argv)[0]
    plots = not (known.no_plots or known.inputs)  # the captured-input report draws no plots
    missing = missing_dependencies(plots)
    if missing:
        needs = "; ".join(f"{m} ({REPORT_DEPS[m]})" for m in missing)
        raise SystemExit(f"kda.accuracy: missing optional dependencies: {needs}. Install the reports extra:\n"
                         f"    {INSTALL_HINT}\nNothing was measured."
                         + ("" if missing != ["matplotlib"] else " (--no-plots runs without matplotlib.)"))


def parse_args(argv=None) -> argparse.Namespace:
    from .config import PRESETS

    p = argparse.ArgumentParser(
        prog="python -m kda.accuracy",
        description="KDA accuracy harness: errors of kda.chunk_kda and kda.fused_recurrent_kda against a "
                    "float64 oracle, by input dtype, state storage dtype, length and decode steps. "
                    "See docs/accuracy.md.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick",
                   help="sizes: quick (CPU interpreter, minutes: see the README; default), full (one GPU, "
                        "minutes on an H200), tiny (about 1 min; for the tests)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu runs the Triton kernels in the interpreter (TRITON_INTERPRET=1 is set if unset)")
    p.add_argument("--seed", type=int, default=0, help="seed of every random input (default 0)")
    p.add_argument("--out-dir", "--out", default=None,
                   help="default: accuracy_reports/<preset>-<device>/ (with --inputs: accuracy_reports/inputs-<name>/)")
    p.add_argument("--inputs", metavar="DIRECTORY", default=None,
                   help="replay the activations kda.accuracy.capture recorded in DIRECTORY instead of the synthetic "
                        "studies: per layer and for the model, the decode verdict per state dtype (docs/accuracy.md)")
    p.add_argument("--check", metavar="BASELINE", default=None,
                   help="exit 1 when an error grows more than 2x (+5e-7) over this baseline report, or a "
                        "check that held there fails; prints the entries that failed. BASELINE: a report.json, "
                        "or `committed`: accuracy_reports/<preset>-<device>/report.json as committed at HEAD "
                        "(git show), whatever a rerun wrote into the working tree")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    p.add_argument("--jobs", type=int, default=0,
                   help="work units run in parallel processes (default 0: every core on the CPU, up to 12 on "
                        "a GPU); 1 runs everything in this process")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    return args


def prepare_device(device: str) -> None:
    """CPU: the kernels need the Triton interpreter, which must be on before the kernels are defined."""
    if device == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            if any(m.startswith("kda.ops") for m in sys.modules):
                raise SystemExit("--device cpu needs TRITON_INTERPRET=1 before kda's kernels are imported")
            os.environ["TRITON_INTERPRET"] = "1"
    else:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available (use --device cpu)")


def work_units(sections, preset) -> list[tuple[str, dict]]:
    """The run split into independent units (section, part), the longest first: each unit is one
    study restricted to one value of its outer loop (`prefill.pick`). Units run in parallel with
    `--jobs`; on a GPU most of a fresh machine's time is Triton compiling kernel variants, which
    parallel processes spread over the cores."""
    P = preset
    units = {
        "decode": [dict(regime=r) for r in P.decode_regimes],
        "dtype_matrix": [dict(gate=g, input=i) for g in P.matrix_gates for i in P.matrix_inputs],
        "chunked_prefill": [dict(regime=r, state=s) for r in P.chunked_regimes for s in P.matrix_states],
        "length": [dict(regime=r, input=i) for r in P.length_regimes for i in P.length_inputs],
        "adversarial": [dict(case=c) for c in P.adversarial_cases],
        "varlen": [dict(layout=name) for name in _layouts()],
        "paged": [dict(state=s) for s in P.contract_states],
        "spec_verify": [dict(state=s) for s in P.contract_states],
        "checkpoints": [dict(state=s) for s in P.contract_states],
    }
    return [(section, part) for section in SECTIONS if section in sections for part in units[section]]


def _layouts():
    from .layouts import LAYOUTS

    return list(LAYOUTS)


def run_unit(preset_name: str, device: str, seed: int, start: float, quiet: bool, threads: int | None,
             section: str, part: dict) -> tuple[list[dict], dict | None, float]:
    """Run one work unit: (entries, summary or None, seconds). Top level, so a worker process can run it."""
    import torch

    from . import checkpoints, decode, layouts, prefill, verify
    from .config import PRESETS
    from .context import Context

    if threads:
        torch.set_num_threads(threads)
    ctx = Context(PRESETS[preset_name], device, seed, start=start, quiet=quiet)
    t0 = time.time()
    summary = None
    if section == "decode":
        entries, summary = decode.decode_growth(ctx, part)
    else:
        fn = dict(dtype_matrix=prefill.dtype_matrix, length=prefill.length_growth,
                  chunked_prefill=prefill.chunked_prefill, adversarial=prefill.adversarial,
                  varlen=layouts.varlen, paged=layouts.paged_vs_dense, spec_verify=verify.spec_verify,
                  checkpoints=checkpoints.checkpoints)[section]
        entries = fn(ctx, part)
    ctx.sync()
    return entries, summary, time.time() - t0


def run(args: argparse.Namespace) -> dict:
    """Run the chosen sections: (report, run metadata). The report (report.json) depends only on the seed,
    the commit, the device and the library versions; the run metadata (meta.json) is what varies."""
    from .config import PRESETS, thresholds
    from .context import Context
    from .measure import environment, run_metadata
    from .report import noise_bound
    from .verdict import advice, decode_verdicts

    preset = PRESETS[args.preset]
    env, run_meta = environment(args.device, args.seed), run_metadata()  # the commit the run starts from
    ctx = Context(preset, args.device, args.seed, quiet=args.quiet)
    units = work_units(args.sections, preset)
    jobs = max(1, min(args.jobs or default_jobs(args.device), len(units)))
    ctx.progress(f"preset {args.preset} on {args.device}, seed {args.seed}: {', '.join(args.sections)} "
                 f"({len(units)} work units, {jobs} at a time)")
    common = (args.preset, args.device, args.seed, ctx.start, args.quiet)
    results = [None] * len(units)
    if jobs == 1:
        for i, unit in enumerate(units):
            results[i] = run_unit(*common, None, *unit)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        threads = max(1, (os.cpu_count() or 1) // jobs)
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(run_unit, *common, threads, *unit) for unit in units]
            results = [f.result() for f in futures]
    entries, summaries, section_s = [], {}, {}
    for (section, _part), (got, summary, seconds) in zip(units, results):
        entries += got
        section_s[section] = section_s.get(section, 0.0) + seconds
        if summary is not None:
            summaries.setdefault(section, []).append(summary)
    if "decode" in summaries:
        parts = summaries["decode"]
        # float64 against float64: rounding noise, written as a bound (its digits vary with BLAS and threads)
        selfcheck = max(p["oracle_selfcheck_rel"] for p in parts)
        summaries["decode"] = dict(oracle_selfcheck_rel_bound=noise_bound(selfcheck),
                                   checkpoints=parts[0]["checkpoints"], sequences=sum(p["sequences"] for p in parts),
                                   configs=parts[0]["configs"], state_dtypes=parts[0]["state_dtypes"])
    ctx.progress(f"done: {len(entries)} entries; unit seconds per section: "
                 + ", ".join(f"{k} {v:.0f}" for k, v in section_s.items()))
    target = PRESETS[preset.proxy_for].decode_steps if preset.proxy_for else None
    verdicts, per_regime = decode_verdicts(entries, target)
    meta = dict(preset=preset.as_dict(), sections=list(args.sections), thresholds=thresholds(), environment=env)
    run_meta.update(elapsed_s=round(ctx.elapsed(), 1), jobs=jobs,
                    section_s={k: round(v, 1) for k, v in section_s.items()})
    return dict(meta=meta, verdicts=verdicts, verdicts_per_regime=per_regime,
                advice=advice(entries, per_regime, preset), summaries=summaries, entries=entries), run_meta


def default_jobs(device: str) -> int:
    """All cores on the CPU (the interpreter is single-threaded Python); on a GPU, up to 12 processes
    (on a fresh machine they mostly compile kernel variants on the host)."""
    cores = os.cpu_count() or 1
    return cores if device == "cpu" else min(12, cores)


def main(argv=None) -> int:
    require_dependencies(sys.argv[1:] if argv is None else argv)  # before torch is even imported
    args = parse_args(argv)
    prepare_device(args.device)
    if args.inputs:
        return main_inputs(args)
    from . import check, report

    out_dir = args.out_dir or os.path.join("accuracy_reports", f"{args.preset}-{args.device}")
    baseline = check.load(args.check, args.preset, args.device) if args.check else None  # before the run
    result, run_meta = run(args)
    result = report.sanitize(result)  # 3 significant digits: what report.json holds is what report.md shows
    written = report.write_all(result, run_meta, out_dir, plots=not args.no_plots)
    print(f"kda.accuracy: wrote {', '.join(written)} to {os.path.abspath(out_dir)}/ "
          f"in {run_meta['elapsed_s']:.0f} s")
    for v in result["verdicts"]:
        print(f"  {v['state']} state: {v['text']}")
    if baseline is None:
        return 0
    failures, compared = check.compare(baseline, result)
    if failures:
        print(f"kda.accuracy --check {args.check}: {len(failures)} failure(s) ({report.check_rule()}):")
        for f in failures:
            print(f"  FAIL {f}")
        return 1
    print(f"kda.accuracy --check {args.check}: passed ({compared} values compared; {report.check_rule()})")
    return 0


def main_inputs(args: argparse.Namespace) -> int:
    """`--inputs DIRECTORY`: the replay of a capture (kda.accuracy.captured_study), its report written to
    accuracy_reports/inputs-<name>/ or --out-dir; exit 1 with the message (naming the file) when the directory
    cannot be replayed."""
    from . import captured_report, captured_study, report
    from .captured import CaptureError
    from .context import Context
    from .measure import run_metadata

    run_meta = run_metadata()
    ctx = Context(None, args.device, args.seed, quiet=args.quiet)
    try:
        result = captured_study.run(args.inputs, args.device, ctx.progress)
    except CaptureError as exc:
        raise SystemExit(f"kda.accuracy --inputs: {exc}") from exc
    name = os.path.basename(os.path.normpath(args.inputs))
    out_dir = args.out_dir or os.path.join("accuracy_reports", f"inputs-{name}")
    run_meta.update(elapsed_s=round(ctx.elapsed(), 1), jobs=1, section_s={"captured": round(ctx.elapsed(), 1)})
    written = captured_report.write(report.sanitize(result), run_meta, out_dir)
    print(f"kda.accuracy: wrote {', '.join(written)} to {os.path.abspath(out_dir)}/ in {run_meta['elapsed_s']:.0f} s")
    for v in result["verdicts"]:
        print(f"  {v['state']} state: {v['text']}")
    for n in result["notes"]:
        print(f"  note: {n}")
    return 0
