"""Writes report.json (every number), report.md (tables, verdicts, environment) and the PNG plots."""

from __future__ import annotations

import json
import math
import os

from .config import (
    CHECK_FACTOR,
    CHECK_SLACK,
    EMULATION_RATIO_MAX,
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
from .verdict import _fmt_fit, failed_checks

BOUND_TEXT = (f"error <= {KERNEL_FLOOR_FACTOR:g} x floor + {KERNEL_FP32_TERM:g} with fp32 inputs, "
              f"<= max({KERNEL_FLOOR_FACTOR:g} x floor, floor + {KERNEL_NARROW_TERM:.3g}) with fp16/bf16 inputs "
              f"(11-bit intermediates), for output and state")


def sanitize(x):
    """JSON-safe copy: tuples to lists, non-finite floats to None."""
    if isinstance(x, dict):
        return {str(k): sanitize(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [sanitize(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(sanitize(report), f, indent=1, allow_nan=False)
        f.write("\n")


def e(x) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "**NO**"
    if x == 0:
        return "0"
    return f"{x:.2e}"


def r(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows), ""]


def _by_section(report: dict, section: str) -> list[dict]:
    return [x for x in report["entries"] if x["section"] == section]


# --- markdown -------------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    meta, env = report["meta"], report["meta"]["environment"]
    L = [f"# KDA accuracy report: preset `{meta['preset']['name']}` on `{env['device']}`", ""]
    L += ["Every error is measured in float64 against the float64 oracle (`kda_reference`, state never rounded) on "
          "the very inputs the kernel got, so input rounding is not counted. Relative errors are relative L2 "
          "(`||x - exact|| / ||exact||`); a *floor* is the error of the exact answer itself rounded to the dtype "
          "it is stored in (computed here, not assumed): no kernel can beat it. Regenerate with "
          f"`python -m kda.accuracy --preset {meta['preset']['name']} --device {env['device']} --seed {env['seed']}` "
          "(docs/accuracy.md explains how to read it).", ""]
    L += ["## Environment", ""]
    L += _table(["", ""], [[k, f"`{env[k]}`"] for k in (
        "device_name", "torch", "triton", "numpy", "scipy", "python", "git_commit", "git_dirty", "date", "seed",
        "triton_interpret", "kda_dot_precision")] + [["sizes", f"K = V = {meta['preset']['K']}, H = "
                                                    f"{meta['preset']['H']}, HV = {meta['preset']['HV']}"],
                                                   ["run time", f"{meta['elapsed_s']:.0f} s wall, {meta['jobs']} "
                                                    "parallel job(s); seconds of work per section: " + ", ".join(
                                                        f"{k} {v:.0f}" for k, v in meta['section_s'].items())]])
    L += _verdict_md(report)
    for section, fn in (("decode", _decode_md), ("length", _length_md), ("dtype_matrix", _matrix_md),
                        ("chunked_prefill", _chunked_md), ("varlen", _varlen_md), ("paged", _paged_md),
                        ("adversarial", _adversarial_md)):
        if section in meta["sections"]:
            L += fn(report)
    fails = failed_checks(report["entries"])
    L += ["## Checks", "", f"{sum(len(x['checks']) for x in report['entries'])} checks, {len(fails)} failed."
          + (" Failed:" if fails else ""), ""]
    L += [f"- `{f}`" for f in fails] + ([""] if fails else [])
    return "\n".join(L)


def _verdict_md(report: dict) -> list[str]:
    overall, per = report.get("verdicts", []), report.get("verdicts_per_regime", [])
    if not per:
        return []
    L = ["## Verdict per state storage dtype", ""]
    L += [f"From the decode study (one token per call through a paged pool rounded every step; fp32 inputs and "
          f"outputs, so the output error is the error the state storage causes). A storage dtype passes a regime "
          f"when, at the longest measured step count, (1) its output error is at most **{OUTPUT_FLOOR_FACTOR:g}x "
          f"the bf16 rounding floor of the exact output** (what a bf16 output costs anyway: the state then "
          f"adds at most as much again, a bf16 output ends up within sqrt(2) of its floor), and (2) for fp16/bf16, "
          f"the kernel's output and state errors are at most **{EMULATION_RATIO_MAX:g}x the emulation's** (float64 "
          f"arithmetic, the state rounded to the same dtype after every token): the kernel loses nothing beyond "
          f"what the dtype forces. An output-error growth exponent whose 95% interval lies above "
          f"{GROWING_EXPONENT:g} is flagged *still growing*: the verdict then holds only up to the measured length.",
          ""]
    L += [f"- **{v['state']}**: {v['text']}" for v in overall] + [""]
    rows = [[v["state"], v["regime"], e(v["out_rel"]), e(v["out_floor_bf16"]), r(v["out_over_floor"]),
             r(v["out_over_emulation"]), r(v["state_over_emulation"]), e(v["state_rel"]), v["exponent"]
             + (" (growing)" if v["growing"] else ""),
             "pass" if v["passes"] else "**FAIL**: " + "; ".join(v["reasons"])] for v in per]
    L += _table(["storage", "regime", "output err", "bf16 out floor", "err / floor", "kernel/emu (out)",
                 "kernel/emu (state)", "state err", "output exponent [95% CI]", "verdict"], rows)
    return L


def _decode_md(report: dict) -> list[str]:
    ents = _by_section(report, "decode")
    if not ents:
        return []
    s = report["summaries"]["decode"]
    p0 = ents[0]["params"]
    L = ["## Growth with decode steps", ""]
    L += [f"Prefill of {p0['prefill']} tokens (`kda.chunk_kda` into the pool), then {p0['steps']} decode steps "
          f"(`kda.fused_recurrent_kda`, one token per call, V-first pool planes, permuted slots), "
          f"{p0['reps']} sequence(s) per regime, K = V = {p0['K']}, HV = {p0['HV']}. Output error at step s: "
          f"relative L2 over the last min({OUTPUT_WINDOW}, s/2) steps; state error: the pool at step s. "
          f"`+sr`: stochastic rounding (seed = step). `emu`: the float64 emulation of that storage dtype. "
          f"Vectorised float64 oracle vs `kda_reference.recurrent_kda`: {e(s['oracle_selfcheck_rel'])} relative.", ""]
    L += ["![output error vs decode steps](decode_output_error.png)", "",
          "![state error vs decode steps](decode_state_error.png)", ""]
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
            L += _table(header, rows)
        L += [f"**{regime}**: fitted growth exponent of error vs steps (steps >= {rs[0]['info']['fit_steps'][0]}; "
              "slope of the log-log fit, 95% CI)", ""]
        L += _table(["config", "output", "state", "emulation output", "emulation state",
                     "kernel/emu out @end", "kernel/emu state @end"],
                    [[n, _fmt_fit(x["info"]["fit_out"]), _fmt_fit(x["info"]["fit_state"]),
                      _fmt_fit(x["info"]["fit_emu_out"]), _fmt_fit(x["info"]["fit_emu_state"]),
                      r(x["info"]["out_over_emulation"][-1]), r(x["info"]["state_over_emulation"][-1])]
                     for n, x in zip(names, rs)])
    return L


def _length_md(report: dict) -> list[str]:
    ents = _by_section(report, "length")
    if not ents:
        return []
    L = ["## Growth with sequence length", ""]
    L += ["`kda.chunk_kda` on prefixes of one long sequence (no initial state), final state stored in each "
          "dtype. `out`: relative error over the whole prefix; `tail`: over its last 64 tokens; `state`: final "
          "state. Exponents: log-log slope of error vs T with 95% CI.", "",
          "![error vs T](length_error.png)", ""]
    groups = {}
    for x in ents:
        groups.setdefault((x["params"]["regime"], x["params"]["input"]), []).append(x)
    for (regime, inp), xs in groups.items():
        L += [f"**{regime}** regime, {inp} inputs", ""]
        Ts = xs[0]["info"]["T"]
        header = ["T", *(f"out ({x['params']['state']})" for x in xs), "out floor", "tail (fp32 state)",
                  *(f"state ({x['params']['state']})" for x in xs), *(f"{x['params']['state']} floor" for x in xs)]
        rows = [[T, *(e(x["metrics"]["out_rel"][i]) for x in xs), e(xs[0]["info"]["out_floor"][i]),
                 e(xs[0]["metrics"]["out_tail_rel"][i]), *(e(x["metrics"]["state_rel"][i]) for x in xs),
                 *(e(x["info"]["state_floor"][i]) for x in xs)] for i, T in enumerate(Ts)]
        L += _table(header, rows)
        L += _table(["storage", "exponent: out", "tail", "state"],
                    [[x["params"]["state"], _fmt_fit(x["info"]["fit_out"]), _fmt_fit(x["info"]["fit_out_tail"]),
                      _fmt_fit(x["info"]["fit_state"])] for x in xs])
    return L


def _matrix_md(report: dict) -> list[str]:
    ents = _by_section(report, "dtype_matrix")
    if not ents:
        return []
    p = ents[0]["params"]
    L = ["## dtype matrix", ""]
    L += [f"One call per kernel from a random initial state (V-first planes, stored in the storage dtype), "
          f"B = {p['B']}, T = {p['T']}, K = V = {p['K']}, H = {p['H']}, HV = {p['HV']}; q, k l2-normalised and beta "
          f"sigmoid in the kernel; g and beta fp32. Output floor: the exact output rounded to the input dtype; "
          f"state floor: the exact final state rounded to the storage dtype. `bound`: "
          f"{BOUND_TEXT} (the kernel tests' criterion).", ""]
    rows = [[x["params"]["kernel"], x["params"]["gate"], x["params"]["input"], x["params"]["state"],
             e(x["metrics"]["out_rel"]), e(x["info"]["out_max_abs"]), e(x["info"]["out_floor"]),
             e(x["metrics"]["state_rel"]), e(x["info"]["state_max_abs"]), e(x["info"]["state_floor"]),
             e(x["checks"]["out_within_bound"] and x["checks"]["state_within_bound"] and x["checks"]["finite"])]
            for x in ents]
    L += _table(["kernel", "gate", "input", "state", "out rel", "out max abs", "out floor", "state rel",
                 "state max abs", "state floor", "bound"], rows)
    return L


def _chunked_md(report: dict) -> list[str]:
    ents = _by_section(report, "chunked_prefill")
    if not ents:
        return []
    p = ents[0]["params"]
    L = ["## Chunked prefill", ""]
    L += [f"One sequence of T = {p['T']} tokens (fp32 inputs) split at random points into P pieces, each a "
          f"`kda.chunk_kda` call starting from the previous piece's final state stored in the storage dtype "
          f"(K-first). Error against one float64 run over the whole sequence; `emu`: float64 with the state "
          f"rounded at the same cuts. Cells: final-state error kernel / emu; output error.", "",
          "![state error vs pieces](chunked_prefill.png)", ""]
    for regime in dict.fromkeys(x["params"]["regime"] for x in ents):
        xs = [x for x in ents if x["params"]["regime"] == regime]
        pieces = xs[0]["info"]["pieces"]
        header = ["pieces", *(f"state {x['params']['state']} (kernel / emu)" for x in xs),
                  *(f"out ({x['params']['state']})" for x in xs)]
        rows = [[n, *(f"{e(x['metrics']['state_rel'][i])} / {e(x['info']['emu_state_rel'][i])}" for x in xs),
                 *(e(x["metrics"]["out_rel"][i]) for x in xs)] for i, n in enumerate(pieces)]
        L += [f"**{regime}** regime", ""] + _table(header, rows)
        L += _table(["storage", "state floor", "exponent of state error vs pieces"],
                    [[x["params"]["state"], e(x["info"]["state_floor"]), _fmt_fit(x["info"]["fit_state"])] for x in xs])
    return L


def _varlen_md(report: dict) -> list[str]:
    ents = _by_section(report, "varlen")
    if not ents:
        return []
    L = ["## Varlen layouts with empty sequences", ""]
    L += ["bf16 inputs, `cu_seqlens` (and its host copy), a random dense initial state per sequence in the storage "
          "dtype. Per-sequence errors (max over the sequences), the empty sequences' final state compared bit for "
          f"bit with their initial state, and every sequence within the kernel bound ({BOUND_TEXT}).", ""]
    rows = [[x["params"]["layout"], str(x["params"]["lengths"]), x["params"]["kernel"], x["params"]["state"],
             e(x["info"]["max_seq_out_rel"]), e(x["info"]["max_seq_state_rel"]),
             e(x["checks"]["empty_keep_state_bits"]), e(x["checks"]["within_bound"]), e(x["checks"]["finite"])]
            for x in ents]
    L += _table(["layout", "lengths", "kernel", "state", "max seq out err", "max seq state err",
                 "empty: state bits kept", "bound", "finite"], rows)
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
    L += ["**Contract.** `kda.chunk_kda`: paged == dense bit for bit at any slot stride. "
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
    L += _table(["kernel", "state", "out err (dense)", *names], rows)
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
    L += _table(["kernel", "state", "out diff", "state diff", "bound (out / state)", "within bound", "bitwise",
                 "untouched_bits", "dirty_finite", "padding_rows_zero", "padding_untouched_bits"], rows)
    return L


def _adversarial_md(report: dict) -> list[str]:
    ents = _by_section(report, "adversarial")
    if not ents:
        return []
    L = ["## Adversarial inputs", ""]
    L += [f"- `{c}`: {ADVERSARIAL_DOC[c]}" for c in dict.fromkeys(x["params"]["case"] for x in ents)] + [""]
    L += [f"No initial state, T = {ents[0]['params']['T']}. `bound`: {BOUND_TEXT}.", ""]
    rows = [[x["params"]["case"], x["params"]["kernel"], x["params"]["input"], x["params"]["state"],
             e(x["metrics"]["out_rel"]), r(x["info"]["out_over_floor"]), e(x["metrics"]["state_rel"]),
             r(x["info"]["state_over_floor"]), e(x["checks"]["finite"]),
             e(x["checks"]["out_within_bound"] and x["checks"]["state_within_bound"])] for x in ents]
    L += _table(["case", "kernel", "input", "state", "out rel", "out / floor", "state rel", "state / floor",
                 "finite", "bound"], rows)
    return L


# --- plots ----------------------------------------------------------------------------------------------

STYLE = {"fp32": "tab:blue", "fp16": "tab:orange", "bf16": "tab:red"}


def plots(report: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        from matplotlib.ticker import NullFormatter

        for ax in fig.axes:
            ax.xaxis.set_minor_formatter(NullFormatter())  # no crowded labels between the decades
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=110)
        plt.close(fig)
        written.append(name)

    dec = _by_section(report, "decode")
    if dec:
        regimes = list(dict.fromkeys(x["params"]["regime"] for x in dec))
        for what, key, emu_key, name in (("output", "out_rel", "emu_out_rel", "decode_output_error.png"),
                                         ("state", "state_rel", "emu_state_rel", "decode_state_error.png")):
            fig, axes = plt.subplots(1, len(regimes), figsize=(5 * len(regimes), 4), squeeze=False)
            for ax, regime in zip(axes[0], regimes):
                for x in (x for x in dec if x["params"]["regime"] == regime):
                    st, sr = x["params"]["state"], x["params"]["stochastic_rounding"]
                    steps = x["info"]["steps"]
                    ax.loglog(steps, _pos(x["metrics"][key]), color=STYLE[st], ls=":" if sr else "-", marker=".",
                              label=f"kernel {st}{' +sr' if sr else ''}")
                    if not sr:
                        ax.loglog(steps, _pos(x["info"][emu_key]), color=STYLE[st], ls="--", alpha=0.6,
                                  label=f"emulation {st}")
                if what == "output":
                    x0 = next(x for x in dec if x["params"]["regime"] == regime)
                    ax.loglog(x0["info"]["steps"], _pos(x0["info"]["out_floor_bf16"]), color="k", ls="-.",
                              label="bf16 output floor")
                ax.set_title(f"{regime}: {what} error")
                ax.set_xlabel("decode steps")
                ax.set_ylabel("relative L2 error")
                ax.grid(True, which="both", alpha=0.3)
            axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
            save(fig, name)

    ln = _by_section(report, "length")
    if ln:
        regimes = list(dict.fromkeys(x["params"]["regime"] for x in ln))
        fig, axes = plt.subplots(2, len(regimes), figsize=(5 * len(regimes), 7), squeeze=False)
        for j, regime in enumerate(regimes):
            floors = {}
            for x in (x for x in ln if x["params"]["regime"] == regime):
                st, inp = x["params"]["state"], x["params"]["input"]
                if inp not in floors:
                    floors[inp] = x["info"]["out_floor"]
                    axes[0][j].loglog(x["info"]["T"], _pos(floors[inp]), color="k", ls="-." if inp == "fp32" else ":",
                                      label=f"{inp} output floor")
                ls = "-" if inp == "fp32" else "--"
                axes[0][j].loglog(x["info"]["T"], _pos(x["metrics"]["out_rel"]), color=STYLE[st], ls=ls, marker=".",
                                  label=f"{inp} in, {st} state")
                axes[1][j].loglog(x["info"]["T"], _pos(x["metrics"]["state_rel"]), color=STYLE[st], ls=ls,
                                  marker=".", label=f"{inp} in, {st} state")
            for i, what in enumerate(("output", "final state")):
                axes[i][j].set_title(f"{regime}: {what} error (chunk_kda)")
                axes[i][j].set_xlabel("T")
                axes[i][j].set_ylabel("relative L2 error")
                axes[i][j].grid(True, which="both", alpha=0.3)
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
        save(fig, "length_error.png")

    ch = _by_section(report, "chunked_prefill")
    if ch:
        regimes = list(dict.fromkeys(x["params"]["regime"] for x in ch))
        fig, axes = plt.subplots(1, len(regimes), figsize=(5 * len(regimes), 4), squeeze=False)
        for ax, regime in zip(axes[0], regimes):
            for x in (x for x in ch if x["params"]["regime"] == regime):
                st = x["params"]["state"]
                ax.loglog(x["info"]["pieces"], _pos(x["metrics"]["state_rel"]), color=STYLE[st], marker=".",
                          label=f"kernel {st}")
                ax.loglog(x["info"]["pieces"], _pos(x["info"]["emu_state_rel"]), color=STYLE[st], ls="--",
                          alpha=0.6, label=f"emulation {st}")
            ax.set_title(f"{regime}: final state error")
            ax.set_xlabel("pieces")
            ax.set_ylabel("relative L2 error")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
        save(fig, "chunked_prefill.png")
    return written


def _pos(values):
    """Zeros and missing values cannot sit on a log axis: leave them out (NaN)."""
    return [v if (v is not None and v > 0) else float("nan") for v in values]


def check_rule() -> str:
    return (f"new <= {CHECK_FACTOR:g} x baseline + {CHECK_SLACK:g} for every error metric (relative L2, "
            "max abs / max |exact|), and every check true in the baseline still true")
