"""Writes report.json (every number), report.md (tables, verdicts, environment) and the PNG plots."""

from __future__ import annotations

import json
import math
import os

from .config import (
    CHECK_FACTOR,
    CHECK_SLACK,
    EMULATION_RATIO_MAX,
    FIT_MIN_STEP,
    GROWING_EXPONENT,
    KERNEL_FLOOR_FACTOR,
    KERNEL_FP32_TERM,
    KERNEL_NARROW_TERM,
    OUTPUT_FLOOR_FACTOR,
    OUTPUT_WINDOW,
    REGIMES,
    REORDER_FP32_TERM,
)
from .inputs import ADVERSARIAL_DOC
from .verdict import failed_checks, fmt_fit

BOUND_TEXT = (f"error <= {KERNEL_FLOOR_FACTOR:g} x floor + {KERNEL_FP32_TERM:g} with fp32 inputs, "
              f"<= max({KERNEL_FLOOR_FACTOR:g} x floor, floor + {KERNEL_NARROW_TERM:.3g}) with fp16/bf16 inputs "
              f"(11-bit intermediates), for output and state")


SIGNIFICANT = 3  # digits every measured number keeps, in report.json and report.md alike
# Fit statistics (growth exponents, their intervals, r^2) below FIT_NOISE are written as 0: a fit of a constant
# curve gives a slope of ~1e-32 and an interval of ~1e-15, float64 noise whose digits vary with the machine, and
# an exponent of 1e-6 changes an error by 1e-5 relative over 2^20 steps: nothing to read there.
FIT_KEYS = ("slope", "stderr", "ci_low", "ci_high", "r2")
FIT_NOISE = 1e-6
# Quantities that only measure float64 rounding (the oracle's self-check) are written as a power-of-ten
# bound, never below this one: their digits change with the machine's BLAS and thread count.
NOISE_BOUND = 1e-14
PLOT_FILES = ("decode_output_error.png", "decode_state_error.png", "length_error.png", "chunked_prefill.png")
REPORT_FILES = ("report.md", "report.json", "meta.json")


def sig(x: float) -> float:
    """`x` rounded to SIGNIFICANT significant digits (the precision run-to-run noise and reading allow)."""
    return float(f"{x:.{SIGNIFICANT}g}")


def noise_bound(x: float) -> float:
    """A bound on a float64-noise quantity: the power of ten at or above `x`, at least NOISE_BOUND."""
    if not x > NOISE_BOUND:
        return NOISE_BOUND
    return float(f"1e{math.ceil(math.log10(x))}")


def _clean(x, rounded: bool, key: str = ""):
    if isinstance(x, dict):
        return {str(k): _clean(v, rounded, str(k)) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v, rounded, key) for v in x]
    if isinstance(x, float):
        if not math.isfinite(x):
            return None
        if not rounded:
            return x
        if key in FIT_KEYS and abs(x) < FIT_NOISE:
            return 0.0
        return sig(x) + 0.0  # + 0.0: no "-0.0"
    return x


def sanitize(report: dict) -> dict:
    """JSON-safe copy: tuples to lists, non-finite floats to None, every measured float (all but `meta`:
    the preset and the thresholds stay exact) rounded to SIGNIFICANT digits, fit statistics below FIT_NOISE
    to 0. Rounded here, where report.json is written, so report.md prints what report.json holds and
    a rerun at the same commit writes both byte for byte."""
    return {k: _clean(v, rounded=k != "meta") for k, v in report.items()}


def write_json(obj: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, allow_nan=False)
        f.write("\n")


def write_all(report: dict, run_meta: dict, out_dir: str, plots: bool = True) -> list[str]:
    """Write report.json, meta.json, the plots (unless `plots` is false) and report.md into `out_dir`, after
    removing what an earlier run of the harness left there (its reports and plots; nothing else), so the
    directory holds one run. Only meta.json holds `run_meta` (commit, date, host, run time); the other files
    are functions of `report` alone. Returns the names written."""
    os.makedirs(out_dir, exist_ok=True)
    for name in (*REPORT_FILES, *PLOT_FILES):
        path = os.path.join(out_dir, name)
        if os.path.isfile(path):
            os.remove(path)
    write_json(report, os.path.join(out_dir, "report.json"))
    write_json(run_meta, os.path.join(out_dir, "meta.json"))
    drawn = draw_plots(report, out_dir) if plots else []
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(markdown(report, drawn))
    return ["report.md", "report.json", "meta.json", *drawn]


def e(x) -> str:
    """An error (3 significant digits), a yes/NO check, or n/a."""
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "**NO**"
    if x == 0:
        return "0"
    return f"{x:.{SIGNIFICANT - 1}e}"


def r(x) -> str:
    """A ratio, 3 significant digits."""
    if x is None:
        return "n/a"
    return f"{x:.{SIGNIFICANT - 1}e}" if abs(x) >= 1000 else f"{x:#.{SIGNIFICANT}g}"


FP32_RATIO = "n/a (fp32: no storage rounding)"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows), ""]


def _by_section(report: dict, section: str) -> list[dict]:
    return [x for x in report["entries"] if x["section"] == section]


# --- markdown -------------------------------------------------------------------------------------------


def markdown(report: dict, plots: list[str] = PLOT_FILES) -> str:
    """report.md: a function of report.json alone (the run's commit, date, host and run time are in meta.json)."""
    meta, env, P = report["meta"], report["meta"]["environment"], report["meta"]["preset"]
    L = [f"# KDA accuracy report: preset `{P['name']}` on `{env['device']}`", ""]
    L += ["Every error is measured in float64 against the float64 oracle (`kda_reference`, state never rounded) on "
          "the very inputs the kernel got, so input rounding is not counted. Relative errors are relative L2 "
          "(`||x - exact|| / ||exact||`); a *floor* is the error of the exact answer itself rounded to the dtype "
          "it is stored in (computed here, not assumed): no kernel can beat it. Numbers keep "
          f"{SIGNIFICANT} significant digits. Regenerate with "
          f"`python -m kda.accuracy --preset {P['name']} --device {env['device']} --seed {env['seed']}` "
          "(docs/accuracy.md explains how to read it). The run that wrote it (commit, date, host, run time) is "
          "in `meta.json` beside this file.", ""]
    L += [f"**Preset `{P['name']}`**: {P['purpose']}. {_sizes(P)}", ""]
    L += ["## Environment", ""]
    L += table(["", ""], [[k, f"`{env[k]}`"] for k in (
        "device", "device_name", "torch", "triton", "numpy", "scipy", "python", "seed", "triton_interpret",
        "kda_dot_precision")])
    L += _verdict_md(report)
    for section, fn in (("decode", _decode_md), ("length", _length_md), ("dtype_matrix", _matrix_md),
                        ("chunked_prefill", _chunked_md), ("varlen", _varlen_md), ("paged", _paged_md),
                        ("adversarial", _adversarial_md), ("spec_verify", _spec_verify_md),
                        ("checkpoints", _checkpoints_md)):
        if section in meta["sections"]:
            L += fn(report, plots) if section in ("decode", "length", "chunked_prefill") else fn(report)
    fails = failed_checks(report["entries"])
    L += ["## Checks", "", f"{sum(len(x['checks']) for x in report['entries'])} checks, {len(fails)} failed."
          + (" Failed:" if fails else ""), ""]
    L += [f"- `{f}`" for f in fails] + ([""] if fails else [])
    return "\n".join(L)


def _sizes(P: dict) -> str:
    return (f"Sizes: K = V = {P['K']}, H = {P['H']} q/k head(s), HV = {P['HV']} value head(s); decode: a "
            f"{P['decode_prefill']}-token prefill then {P['decode_steps']} steps, {P['decode_reps']} sequence(s) per "
            f"regime; length: T up to {P['length_Ts'][-1]}; dtype matrix: T = {P['matrix_T']}.")


def _proxy_note(P: dict) -> str:
    from .config import PRESETS

    F = PRESETS[P["proxy_for"]]
    return (f"It stands in for the `{F.name}` preset (K = V = {F.K}, H = {F.H}, HV = {F.HV}, {F.decode_steps} "
            f"decode steps, {F.decode_reps} sequences per regime; `python -m kda.accuracy --preset {F.name} --device "
            f"cuda`, committed in `accuracy_reports/{F.name}-cuda/`), whose verdict is the one to act on. The "
            f"regimes and thresholds are the same; an error that still grows at {P['decode_steps']} steps keeps "
            f"growing up to {F.decode_steps}, so a verdict here can be milder than there, never a substitute.")


def _verdict_md(report: dict) -> list[str]:
    overall, per = report.get("verdicts", []), report.get("verdicts_per_regime", [])
    if not per:
        return []
    P = report["meta"]["preset"]
    steps = per[0]["steps"]
    L = ["## Verdict per state storage dtype", ""]
    if P.get("proxy_for"):
        L += [f"**Preset `{P['name']}`, a proxy**: K = V = {P['K']}, {P['decode_steps']} decode steps, "
              f"{P['decode_reps']} sequence(s) per regime. {_proxy_note(P)}", ""]
    L += [f"From the decode study (one token per call through a paged pool rounded every step; fp32 inputs and "
          f"outputs, so the output error is the error the state storage causes). A storage dtype passes a regime "
          f"when, at the longest measured step count ({steps}), (1) its output error is at most "
          f"**{OUTPUT_FLOOR_FACTOR:g}x the bf16 rounding floor of the exact output** (what a bf16 output costs "
          f"anyway: the state then adds at most as much again, a bf16 output ends up within sqrt(2) of its floor), "
          f"and (2) for fp16/bf16 only, the kernel's output and state errors are at most **{EMULATION_RATIO_MAX:g}x "
          f"the emulation's** (float64 arithmetic, the state rounded to the same dtype after every token): the "
          f"kernel loses nothing beyond what the dtype forces. An output-error growth exponent whose 95% interval "
          f"lies above {GROWING_EXPONENT:g} is flagged *still growing*: the verdict then holds only up to "
          f"{steps} steps.", ""]
    L += [f"- **{v['state']}**: {v['text']}" for v in overall] + [""]
    target = per[0].get("target_steps")
    L += ["Columns: `output err`: relative L2 error of the output over the last "
          f"min({OUTPUT_WINDOW}, s/2) steps at step {steps}; `bf16 out floor`: the same for the exact output rounded "
          f"to bf16; `err / floor`: their ratio, **threshold (1): <= {OUTPUT_FLOOR_FACTOR:g}, every row**; "
          f"`kernel/emu`: kernel error over emulation error, **threshold (2): <= {EMULATION_RATIO_MAX:g}, fp16 and "
          f"bf16 rows only** ({FP32_RATIO}: the emulation of an fp32 state rounds below fp32 arithmetic, so the "
          "ratio compares two fp32 noise levels and says nothing); `state err`: the pool at the last step; "
          f"`exponent`: slope of log(output error) on log(steps) for steps >= {FIT_MIN_STEP}, 95% interval."
          + (f" `x floor at {target} (extrapolated)`: for a still-growing error, err / floor x ({target} / "
             f"{steps})^exponent, a rough guide to what the `{P['proxy_for']}` preset measures, not a verdict."
             if target else ""), ""]
    rows = []
    for v in per:
        fp32 = v["state"] == "fp32"
        row = [v["state"], v["regime"], e(v["out_rel"]), e(v["out_floor_bf16"]), r(v["out_over_floor"]),
               FP32_RATIO if fp32 else r(v["out_over_emulation"]), FP32_RATIO if fp32 else r(v["state_over_emulation"]),
               e(v["state_rel"]), v["exponent"] + (" (growing)" if v["growing"] else "")]
        if target:
            x = v.get("extrapolated_over_floor")
            row.append(r(x) if x is not None else "not growing")
        row.append("pass" if v["passes"] else "**FAIL**: " + "; ".join(v["reasons"]))
        rows.append(row)
    L += table(["storage", "regime", "output err", "bf16 out floor", f"err / floor (<= {OUTPUT_FLOOR_FACTOR:g})",
                 f"kernel/emu out (<= {EMULATION_RATIO_MAX:g})", f"kernel/emu state (<= {EMULATION_RATIO_MAX:g})",
                 "state err", "output exponent [95% CI]", *([f"x floor at {target} (extrapolated)"] if target else []),
                 "verdict"], rows)
    if report.get("advice"):
        L += ["### What to do", ""]
        L += [f"- {a['text']}" for a in report["advice"]] + [""]
    return L


def _img(plots, name: str, alt: str) -> list[str]:
    return [f"![{alt}]({name})", ""] if name in plots else []


def _decode_md(report: dict, plots=PLOT_FILES) -> list[str]:
    ents = _by_section(report, "decode")
    if not ents:
        return []
    s = report["summaries"]["decode"]
    p0 = ents[0]["params"]
    L = ["## Growth with decode steps", ""]
    L += [f"Prefill of {p0['prefill']} tokens (`kda.chunk_kda` into the pool), then {p0['steps']} decode steps "
          f"(`kda.fused_recurrent_kda`, one token per call, V-first pool planes, permuted slots), "
          f"{p0['reps']} sequence(s) per regime, K = V = {p0['K']}, HV = {p0['HV']}. Vectorised float64 oracle vs "
          f"`kda_reference.recurrent_kda`: {_selfcheck(s)}.", ""]
    L += ["Columns of the error tables: `step` s; one column per kernel configuration (storage dtype; `+sr`: "
          "stochastic rounding, seed = step); `emu <dtype>`: the float64 emulation of that storage dtype (rounded "
          "to nearest after every token), which the kernel column of the same dtype should match; output error "
          f"at step s: relative L2 over the last min({OUTPUT_WINDOW}, s/2) steps; state error: the pool at step s; "
          "`bf16 out floor`: the verdict's line (1). Plots: kernel lines with markers, the emulation as a wide "
          "pale band of the same colour (a kernel line inside its band adds nothing), the bf16 output floor "
          "in black.", ""]
    L += _img(plots, "decode_output_error.png", "output error vs decode steps")
    L += _img(plots, "decode_state_error.png", "state error vs decode steps")
    for regime in dict.fromkeys(x["params"]["regime"] for x in ents):
        rs = [x for x in ents if x["params"]["regime"] == regime]
        steps = rs[0]["info"]["steps"]
        emus = {x["params"]["state"]: x for x in rs if not x["params"]["stochastic_rounding"]}
        names = [x["id"].split("/")[-1] for x in rs]
        for what, key, emu_key in (("output", "out_rel", "emu_out_rel"), ("state", "state_rel", "emu_state_rel")):
            L += [f"**{regime}** ({REGIMES[regime].decay}): {what} error", ""]
            header = ["step", *names, *(f"emu {d}" for d in emus)] + (["bf16 out floor"] if what == "output" else [])
            rows = []
            for i, st in enumerate(steps):
                row = [st, *(e(x["metrics"][key][i]) for x in rs), *(e(x["info"][emu_key][i]) for x in emus.values())]
                if what == "output":
                    row.append(e(rs[0]["info"]["out_floor_bf16"][i]))
                rows.append(row)
            L += table(header, rows)
        L += [f"**{regime}**: fitted growth exponent of error vs steps (steps >= {rs[0]['info']['fit_steps'][0]}; "
              "slope of the log-log fit, 95% CI). `kernel/emu @end`: kernel error / emulation error at the last step; "
              "for `+sr` rows against the round-to-nearest emulation, i.e. what stochastic rounding costs (> 1) or "
              f"gains (< 1); fp32 rows: {FP32_RATIO}.", ""]
        L += table(["config", "output", "state", "emulation output", "emulation state",
                     "kernel/emu out @end", "kernel/emu state @end"],
                    [[n, fmt_fit(x["info"]["fit_out"]), fmt_fit(x["info"]["fit_state"]),
                      fmt_fit(x["info"]["fit_emu_out"]), fmt_fit(x["info"]["fit_emu_state"]),
                      *((FP32_RATIO, FP32_RATIO) if x["params"]["state"] == "fp32" else
                        (r(x["info"]["out_over_emulation"][-1]), r(x["info"]["state_over_emulation"][-1])))]
                     for n, x in zip(names, rs)])
    return L


def _selfcheck(summary: dict) -> str:
    bound = summary.get("oracle_selfcheck_rel_bound")
    if bound is None:  # a report written before the bound
        bound = noise_bound(summary["oracle_selfcheck_rel"])
    return f"relative difference at most {bound:g}" + (" (float64 rounding)" if bound <= NOISE_BOUND else "")


def _same(curves: list[list]) -> bool:
    return all(c == curves[0] for c in curves)


def _length_md(report: dict, plots=PLOT_FILES) -> list[str]:
    ents = _by_section(report, "length")
    if not ents:
        return []
    L = ["## Growth with sequence length", ""]
    L += ["`kda.chunk_kda` on prefixes of one long sequence (no initial state), final state stored in each "
          "dtype. Columns: `T`: prefix length; `out`: relative error of the output over the whole prefix (the "
          "final state's storage dtype cannot change the output, which is computed before the state is stored: "
          "one column when the runs agree, as they must); `out floor`: the exact output rounded to the input "
          "dtype; `tail`: output error over the last 64 tokens; `state (<dtype>)`: the final state stored in that "
          "dtype; `<dtype> floor`: the exact final state rounded to it. No threshold applies here: this section "
          "shows whether errors grow with T (exponent: log-log slope of error vs T, 95% CI; ~0 flat).", ""]
    L += _img(plots, "length_error.png", "error vs T")
    groups = {}
    for x in ents:
        groups.setdefault((x["params"]["regime"], x["params"]["input"]), []).append(x)
    for (regime, inp), xs in groups.items():
        L += [f"**{regime}** regime, {inp} inputs", ""]
        Ts = xs[0]["info"]["T"]
        one = _same([x["metrics"]["out_rel"] for x in xs])
        outs = xs[:1] if one else xs
        out_names = ["out"] if one else [f"out ({x['params']['state']})" for x in xs]
        header = ["T", *out_names, "out floor", "tail", *(f"state ({x['params']['state']})" for x in xs),
                  *(f"{x['params']['state']} floor" for x in xs)]
        rows = [[T, *(e(x["metrics"]["out_rel"][i]) for x in outs), e(xs[0]["info"]["out_floor"][i]),
                 e(xs[0]["metrics"]["out_tail_rel"][i]), *(e(x["metrics"]["state_rel"][i]) for x in xs),
                 *(e(x["info"]["state_floor"][i]) for x in xs)] for i, T in enumerate(Ts)]
        L += table(header, rows)
        L += table(["storage", "exponent: out", "tail", "state"],
                    [[x["params"]["state"], fmt_fit(x["info"]["fit_out"]), fmt_fit(x["info"]["fit_out_tail"]),
                      fmt_fit(x["info"]["fit_state"])] for x in xs])
    return L


def _matrix_md(report: dict) -> list[str]:
    ents = _by_section(report, "dtype_matrix")
    if not ents:
        return []
    p = ents[0]["params"]
    L = ["## dtype matrix", ""]
    L += [f"One call per kernel from a random initial state (V-first planes, stored in the storage dtype), "
          f"B = {p['B']}, T = {p['T']}, K = V = {p['K']}, H = {p['H']}, HV = {p['HV']}; q, k l2-normalised and beta "
          f"sigmoid in the kernel; g and beta fp32. Columns: `out rel`, `state rel`: relative L2 errors; `max abs`: "
          f"largest absolute error; `out floor`: the exact output rounded to the input dtype; `state floor`: the "
          f"exact final state rounded to the storage dtype; `bound (out / state)`: the kernel tests' criterion "
          f"applied to this row ({BOUND_TEXT}); `within`: both errors at most their bound, and finite. With "
          f"16-bit inputs `chunk_kda` computes through 11-bit intermediates, so an fp32-stored state is far above "
          f"its fp32 floor there and within its bound (floor + {KERNEL_NARROW_TERM:.3g}).", ""]
    rows = [[x["params"]["kernel"], x["params"]["gate"], x["params"]["input"], x["params"]["state"],
             e(x["metrics"]["out_rel"]), e(x["info"]["out_max_abs"]), e(x["info"]["out_floor"]),
             e(x["metrics"]["state_rel"]), e(x["info"]["state_max_abs"]), e(x["info"]["state_floor"]),
             _bounds(x),
             e(x["checks"]["out_within_bound"] and x["checks"]["state_within_bound"] and x["checks"]["finite"])]
            for x in ents]
    L += table(["kernel", "gate", "input", "state", "out rel", "out max abs", "out floor", "state rel",
                 "state max abs", "state floor", "bound (out / state)", "within"], rows)
    return L


def _bounds(x: dict) -> str:
    i = x["info"]
    return f"{e(i.get('out_bound'))} / {e(i.get('state_bound'))}"


def _chunked_md(report: dict, plots=PLOT_FILES) -> list[str]:
    ents = _by_section(report, "chunked_prefill")
    if not ents:
        return []
    p = ents[0]["params"]
    L = ["## Chunked prefill", ""]
    L += [f"One sequence of T = {p['T']} tokens (fp32 inputs) split at random points into P pieces, each a "
          f"`kda.chunk_kda` call starting from the previous piece's final state stored in the storage dtype "
          f"(K-first). Error against one float64 run over the whole sequence; `emu`: float64 with the state "
          f"rounded at the same cuts. Columns: `pieces`: number of calls; `state <dtype> (kernel / emu)`: final-state "
          f"error of the kernel and of the emulation (they should match: the kernel adds nothing to the rounding "
          f"at the cuts); `out (<dtype>)`: output error over the whole sequence. No threshold applies; "
          f"`--check` compares every number with the baseline.", ""]
    L += _img(plots, "chunked_prefill.png", "state error vs pieces")
    for regime in dict.fromkeys(x["params"]["regime"] for x in ents):
        xs = [x for x in ents if x["params"]["regime"] == regime]
        pieces = xs[0]["info"]["pieces"]
        header = ["pieces", *(f"state {x['params']['state']} (kernel / emu)" for x in xs),
                  *(f"out ({x['params']['state']})" for x in xs)]
        rows = [[n, *(f"{e(x['metrics']['state_rel'][i])} / {e(x['info']['emu_state_rel'][i])}" for x in xs),
                 *(e(x["metrics"]["out_rel"][i]) for x in xs)] for i, n in enumerate(pieces)]
        L += [f"**{regime}** regime", ""] + table(header, rows)
        L += table(["storage", "state floor", "exponent of state error vs pieces"],
                    [[x["params"]["state"], e(x["info"]["state_floor"]), fmt_fit(x["info"]["fit_state"])] for x in xs])
    return L


def _varlen_md(report: dict) -> list[str]:
    ents = _by_section(report, "varlen")
    if not ents:
        return []
    L = ["## Varlen layouts with empty sequences", ""]
    L += ["bf16 inputs, `cu_seqlens` (and its host copy), a random dense initial state per sequence in the storage "
          "dtype. Columns: `max seq out err`, `max seq state err`: the largest relative error over the sequences "
          "(output rows of the sequence; its final state); `empty: state bits kept`: every empty sequence's final "
          "state is its initial state bit for bit; `bound`: every sequence within the kernel bound "
          f"({BOUND_TEXT}); `finite`: no NaN or inf.", ""]
    rows = [[x["params"]["layout"], str(x["params"]["lengths"]), x["params"]["kernel"], x["params"]["state"],
             e(x["info"]["max_seq_out_rel"]), e(x["info"]["max_seq_state_rel"]),
             e(x["checks"]["empty_keep_state_bits"]), e(x["checks"]["within_bound"]), e(x["checks"]["finite"])]
            for x in ents]
    L += table(["layout", "lengths", "kernel", "state", "max seq out err", "max seq state err",
                 "empty: state bits kept", "bound", "finite"], rows)
    return L


def _spec_verify_md(report: dict) -> list[str]:
    ents = _by_section(report, "spec_verify")
    if not ents:
        return []
    p = ents[0]["params"]
    L = ["## Speculative verify", ""]
    L += [f"A verify call of {p['drafts']} drafts per sequence (`state_indices` [N, {p['drafts']}] = "
          f"{p['state_indices']}, the last sequence padding), then a continuation of lengths {p['continuation']} "
          f"from `num_accepted_tokens` = {p['accepted']} (drafts rejected) with `state_indices` "
          f"{p['continuation_state_indices']}, fp32 inputs, V-first pools of {p['slots']} slots poisoned with "
          "NaN / 1e30. Errors against the float64 oracle on the same calls (which rounds the carried state to the "
          "pool's dtype after every token, as the kernel does); `step`: the accepted drafts and the continuation "
          "decoded one call per token, compared with the verify path (bitwise on CPU; the checks ask for "
          "rounding, since a GPU V-first one-token call runs another binary).", ""]
    names = list(ents[0]["checks"])
    rows = [[x["params"]["state"], e(x["metrics"]["verify_out_rel"]), e(x["metrics"]["continue_out_rel"]),
             e(x["metrics"]["state_rel"]), e(x["info"]["step_out_bitwise"]), e(x["info"]["step_state_bitwise"]),
             *(e(x["checks"][n]) for n in names)] for x in ents]
    L += table(["state", "verify out err", "continuation out err", "state err", "step out bitwise",
                 "step state bitwise", *names], rows)
    return L


def _checkpoints_md(report: dict) -> list[str]:
    ents = _by_section(report, "checkpoints")
    if not ents:
        return []
    p = ents[0]["params"]
    L = ["## Prefix-cache checkpoints", ""]
    L += [f"One varlen paged `chunk_kda` call (lengths {p['lengths']}, fp32 inputs, V-first pools of {p['slots']} "
          f"slots poisoned with NaN / 1e30, final slots {p['state_indices']}) storing the state every "
          f"{p['checkpoint_every']} tokens into `checkpoint_indices` {p['checkpoint_indices']} (slots stored: "
          f"{p['stored']}). Errors against the float64 oracle on the same call (each checkpoint rounded once to "
          "the pool's dtype); `step`: the same tokens decoded one `fused_recurrent_kda` call per token from the "
          "same initial state in an fp32 pool, its state at each checkpoint rounded to the pool's dtype "
          "(check: relative difference at most `step bound`).", ""]
    names = list(ents[0]["checks"])
    rows = [[x["params"]["state"], e(x["metrics"]["out_rel"]), e(x["metrics"]["checkpoint_rel"]),
             e(x["metrics"]["final_state_rel"]), e(x["info"]["step_diff_rel"]), e(x["info"]["step_bound"]),
             e(x["info"]["step_bitwise"]), *(e(x["checks"][n]) for n in names)] for x in ents]
    L += table(["state", "out err", "checkpoint err", "final state err", "step diff", "step bound",
                 "step bitwise", *names], rows)
    return L


def _paged_md(report: dict) -> list[str]:
    ents = _by_section(report, "paged")
    if not ents:
        return []
    p = ents[0]["params"]
    plane = p["plane_numel"]
    L = ["## Paged vs dense", ""]
    L += [f"Sequences of lengths {p['lengths']} (bf16 inputs), V-first planes of {plane} elements, a pool of "
          f"{p['slots']} slots poisoned with NaN / 1e30, slots {p['state_indices']}, padded past the plane twice: "
          f"slot stride {p['slot_stride']} (plane + {p['slot_stride'] - plane}, a multiple of 16 elements) and "
          + (f"{p['odd_slot_stride']} (plane + {p['odd_slot_stride'] - plane}, not a multiple of 16). "
             if "odd_slot_stride" in p else "no other. ")
          + "Each stride runs three paged calls against the dense calls: every sequence from its slot (`out`, "
          "`state`: paged vs dense; `untouched`: the other slots' bits unchanged); `dirty`: slots full of NaN "
          f"with has_initial_state = False (sequences {p['fresh']}) vs the dense call from zeros; `padding`: "
          f"sequence {p['padding_sequence']} with slot -1 gets zero rows, its slot and the unnamed ones keep "
          "their bits, the others vs the dense call.", ""]
    L += ["**Contract.** `kda.chunk_kda`: paged == dense bit for bit at any slot stride for the sequences its "
          "chunk kernels walk (its odd-stride calls here run without host bounds); with host bounds, sequences "
          "of 1..16 tokens go to the recurrent loop kernel and follow `kda.fused_recurrent_kda`'s contract. "
          "`kda.fused_recurrent_kda`: bit for bit when the pool's stride(0) is a multiple of 16 elements (every "
          "contiguous pool, and padding by a multiple of 16); with another padding the two agree to rounding, "
          "not bitwise. Cause: with such a stride Triton cannot prove the state planes 16-byte aligned, so the "
          "decode kernel loads its state tile with another register layout (scalar instead of 4-wide), and "
          "`tl.sum` over K adds in another order: the last fp32 bits differ, and the stored state and output "
          "may round to the neighbouring value. chunk_kda reduces through `tl.dot`, whose layout does not "
          "depend on the load. The interpreter (CPU) has no layouts: there everything is bitwise.", ""]
    names = [n for n in ents[0]["checks"] if not n.startswith("odd_")]
    L += [f"**Stride {p['slot_stride']}** (a multiple of 16 elements): every check bit for bit, both kernels.", ""]
    rows = [[x["params"]["kernel"], x["params"]["state"], e(x["metrics"]["out_rel"]),
             *(e(x["checks"][n]) for n in names)] for x in ents]
    L += table(["kernel", "state", "out err (dense)", *names], rows)
    if "odd_slot_stride" not in p:
        return L
    L += [f"**Stride {p['odd_slot_stride']}** (not a multiple of 16): `out diff`, `state diff`: relative L2 "
          "difference paged vs dense, the largest of the three calls (the dirty call against the dense call "
          "from zeros, the padding call over the other sequences). `bound`: 2 x the unit roundoff of the stored "
          f"dtype (bf16 output; state in its storage dtype) + {REORDER_FP32_TERM:g}: the fp32 values of two "
          f"summation orders differ by far less than {REORDER_FP32_TERM:g}, and each result is rounded once, "
          "which costs at most an ulp where the two fall on either side of a rounding boundary "
          "(kda/accuracy/layouts.py `reorder_bound`). `bitwise`: out, state, dirty "
          "and padding results bit for bit, required of chunk_kda; for fused_recurrent_kda shown for "
          "information (bitwise in the interpreter; on an H200 it was not).", ""]
    bit_names = ("odd_out_bits", "odd_state_bits", "odd_dirty_out_bits", "odd_dirty_state_bits",
                 "odd_padding_others_bits")
    rows = []
    for x in ents:
        c, i = x["checks"], x["info"]
        if all(n in c for n in bit_names):
            bitwise = e(all(c[n] for n in bit_names))
        else:
            bitwise = ("yes" if i["odd_bitwise"] else "no") + " (not required)"
        rows.append([x["params"]["kernel"], x["params"]["state"],
                     e(max(i[f"odd_{n}_diff_rel"] for n in ("out", "dirty_out", "padding_out"))),
                     e(max(i[f"odd_{n}_diff_rel"] for n in ("state", "dirty_state", "padding_state"))),
                     f"{e(i['odd_out_bound'])} / {e(i['odd_state_bound'])}",
                     e(c["odd_out_rounding"] and c["odd_state_rounding"]), bitwise,
                     e(c["odd_untouched_bits"]), e(c["odd_dirty_finite"]), e(c["odd_padding_rows_zero"]),
                     e(c["odd_padding_untouched_bits"])])
    L += table(["kernel", "state", "out diff", "state diff", "bound (out / state)", "within bound", "bitwise",
                 "untouched_bits", "dirty_finite", "padding_rows_zero", "padding_untouched_bits"], rows)
    return L


def _adversarial_md(report: dict) -> list[str]:
    ents = _by_section(report, "adversarial")
    if not ents:
        return []
    L = ["## Adversarial inputs", ""]
    L += [f"- `{c}`: {ADVERSARIAL_DOC[c]}" for c in dict.fromkeys(x["params"]["case"] for x in ents)] + [""]
    L += [f"No initial state, T = {ents[0]['params']['T']}. Columns: `out rel`, `state rel`: relative L2 errors; "
          "`/ floor`: the error over the rounding floor of the same result (output: exact output rounded to the "
          "input dtype; state: exact final state rounded to the storage dtype); `bound`: the bound that applies to "
          f"the row ({BOUND_TEXT}); `within`: both errors within their bound.", "",
          "Reading `state / floor`: a large ratio is not a failure by itself; `within` is the column to read. "
          "The floor of an **fp32** state is about 3e-8, while `chunk_kda` with **bf16 or fp16 inputs** computes "
          "its intermediates with an 11-bit significand (tf32 dots on a GPU, fp16 workspaces everywhere): its "
          "fp32-stored state then carries about 1e-4 to 1e-3 of error, thousands of fp32 floors, and the bound "
          f"of those rows is floor + {KERNEL_NARROW_TERM:.3g} (4 x 2^-11). `fused_recurrent_kda` keeps fp32 "
          "intermediates, hence its small ratios. With fp32 inputs the bound, 2 x floor + "
          f"{KERNEL_FP32_TERM:g}, leaves fp32 arithmetic on these ill-conditioned inputs hundreds of floors.", ""]
    rows = [[x["params"]["case"], x["params"]["kernel"], x["params"]["input"], x["params"]["state"],
             e(x["metrics"]["out_rel"]), r(x["info"]["out_over_floor"]), e(x["metrics"]["state_rel"]),
             r(x["info"]["state_over_floor"]), _bounds(x), e(x["checks"]["finite"]),
             e(x["checks"]["out_within_bound"] and x["checks"]["state_within_bound"])] for x in ents]
    L += table(["case", "kernel", "input", "state", "out rel", "out / floor", "state rel", "state / floor",
                 "bound (out / state)", "finite", "within"], rows)
    return L


# --- plots ----------------------------------------------------------------------------------------------

COLOR = {"fp32": "tab:blue", "fp16": "tab:orange", "bf16": "tab:red"}  # by storage dtype
MARKER = {"fp32": "o", "fp16": "s", "bf16": "^"}
SR_MARKER = {"fp32": "+", "fp16": "x", "bf16": "P"}
INPUT_STYLE = {"fp32": dict(ls="-", marker="o", mfc=None), "fp16": dict(ls="-.", marker="D", mfc="none"),
               "bf16": dict(ls="--", marker="x", mfc=None)}  # by input dtype (length plot)
INPUT_COLOR = {"fp32": "tab:green", "fp16": "tab:brown", "bf16": "tab:purple"}
BAND = dict(lw=8, alpha=0.22, solid_capstyle="butt")  # a reference drawn wide and pale under the kernel lines


def _axes(ax, xs: list, xlabel: str, title: str) -> None:
    """Log-log axes whose x ticks are the measured points (base 2, at most 9 labelled), y in decades."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    every = max(1, math.ceil(len(xs) / 9))
    ticks = list(xs)[::every]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.set_xticklabels([str(t) for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlim(xs[0] / 1.25, xs[-1] * 1.25)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("relative L2 error (log)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", axis="y", alpha=0.12)


def _legend(fig, ax) -> None:
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, handlelength=4,
               frameon=False)


def draw_plots(report: dict, out_dir: str) -> list[str]:
    """The PNG plots of the decode, length and chunked-prefill studies; returns the names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=110, bbox_inches="tight", metadata={"Software": None})
        plt.close(fig)
        written.append(name)

    dec = _by_section(report, "decode")
    if dec:
        regimes = list(dict.fromkeys(x["params"]["regime"] for x in dec))
        for what, key, emu_key, name in (("output", "out_rel", "emu_out_rel", "decode_output_error.png"),
                                         ("state", "state_rel", "emu_state_rel", "decode_state_error.png")):
            fig, axes = plt.subplots(1, len(regimes), figsize=(4.6 * len(regimes), 4), squeeze=False)
            for ax, regime in zip(axes[0], regimes):
                xs = [x for x in dec if x["params"]["regime"] == regime]
                steps = xs[0]["info"]["steps"]
                for x in xs:
                    if not x["params"]["stochastic_rounding"]:
                        st = x["params"]["state"]
                        ax.plot(steps, _pos(x["info"][emu_key]), color=COLOR[st], **BAND,
                                label=f"emulation {st} (band)")
                if what == "output":
                    ax.plot(steps, _pos(xs[0]["info"]["out_floor_bf16"]), color="k", ls="-.", lw=1.2,
                            label="bf16 output floor")
                for x in xs:
                    st, sr = x["params"]["state"], x["params"]["stochastic_rounding"]
                    ax.plot(steps, _pos(x["metrics"][key]), color=COLOR[st], ls=":" if sr else "-", lw=1.3,
                            marker=SR_MARKER[st] if sr else MARKER[st], ms=5,
                            label=f"kernel {st}" + (" + stochastic rounding" if sr else ""))
                _axes(ax, steps, "decode steps (log2)", f"{regime} regime: {what} error")
            _legend(fig, axes[0][0])
            save(fig, name)

    ln = _by_section(report, "length")
    if ln:
        regimes = list(dict.fromkeys(x["params"]["regime"] for x in ln))
        fig, axes = plt.subplots(2, len(regimes), figsize=(4.6 * len(regimes), 7.5), squeeze=False)
        for j, regime in enumerate(regimes):
            xs = [x for x in ln if x["params"]["regime"] == regime]
            Ts = xs[0]["info"]["T"]
            ax_o, ax_s = axes[0][j], axes[1][j]
            floors = {}
            for x in xs:  # state floors: one pale band per storage dtype
                floors.setdefault(x["params"]["state"], x["info"]["state_floor"])
            for st, f in floors.items():
                ax_s.plot(Ts, _pos(f), color=COLOR[st], **BAND, label=f"{st} state floor (band)")
            for inp in dict.fromkeys(x["params"]["input"] for x in xs):
                ys = [x for x in xs if x["params"]["input"] == inp]
                style = INPUT_STYLE[inp]
                ax_o.plot(Ts, _pos(ys[0]["info"]["out_floor"]), color=INPUT_COLOR[inp], **BAND,
                          label=f"{inp}-input output floor (band)")
                one = _same([y["metrics"]["out_rel"] for y in ys])
                for y in ys[:1] if one else ys:
                    st = y["params"]["state"]
                    ax_o.plot(Ts, _pos(y["metrics"]["out_rel"]), color=INPUT_COLOR[inp], lw=1.3, ms=6,
                              ls=style["ls"], marker=style["marker"], mfc=style["mfc"],
                              label=f"{inp} inputs, output" + ("" if one else f" ({st} state)"))
                for y in ys:
                    st = y["params"]["state"]
                    ax_s.plot(Ts, _pos(y["metrics"]["state_rel"]), color=COLOR[st], lw=1.3, ms=6, ls=style["ls"],
                              marker=style["marker"], mfc=style["mfc"], label=f"{inp} inputs, {st} state")
            _axes(ax_o, Ts, "T (tokens, log2)", f"{regime} regime: output error (chunk_kda)\n"
                  "(same for every final-state dtype)")
            _axes(ax_s, Ts, "T (tokens, log2)", f"{regime} regime: final state error (chunk_kda)")
        handles, labels = [], []
        for ax in (axes[0][0], axes[1][0]):
            h, lab = ax.get_legend_handles_labels()
            handles += h
            labels += lab
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, handlelength=4,
                   frameon=False)
        save(fig, "length_error.png")

    ch = _by_section(report, "chunked_prefill")
    if ch:
        regimes = list(dict.fromkeys(x["params"]["regime"] for x in ch))
        fig, axes = plt.subplots(1, len(regimes), figsize=(4.6 * len(regimes), 4), squeeze=False)
        for ax, regime in zip(axes[0], regimes):
            xs = [x for x in ch if x["params"]["regime"] == regime]
            pieces = xs[0]["info"]["pieces"]
            for x in xs:
                st = x["params"]["state"]
                ax.plot(pieces, _pos(x["info"]["emu_state_rel"]), color=COLOR[st], **BAND,
                        label=f"emulation {st} (band)")
            for x in xs:
                st = x["params"]["state"]
                ax.plot(pieces, _pos(x["metrics"]["state_rel"]), color=COLOR[st], lw=1.3, marker=MARKER[st], ms=5,
                        label=f"kernel {st}")
            _axes(ax, pieces, "pieces (chunk_kda calls, log2)", f"{regime} regime: final state error")
        _legend(fig, axes[0][0])
        save(fig, "chunked_prefill.png")
    return written


def _pos(values):
    """Zeros and missing values cannot sit on a log axis: leave them out (NaN)."""
    return [v if (v is not None and v > 0) else float("nan") for v in values]


def check_rule() -> str:
    return (f"new <= {CHECK_FACTOR:g} x baseline + {CHECK_SLACK:g} for every error metric (relative L2, "
            "max abs / max |exact|), and every check true in the baseline still true")
