"""report.md and report.json of a captured-input replay (`python -m kda.accuracy --inputs DIR`), written into
`accuracy_reports/inputs-<name>/` or `--out-dir`. Numbers are formatted as in the synthetic report
(`report.e`, `report.r`, `report.sanitize`); the verdict columns are the synthetic verdict table's."""

from __future__ import annotations

import os

from . import report as synthetic
from .config import EMULATION_RATIO_MAX, FIT_MIN_STEP, OUTPUT_FLOOR_FACTOR, OUTPUT_WINDOW
from .verdict import fmt_fit

e, r, table = synthetic.e, synthetic.r, synthetic.table


def write(result: dict, run_meta: dict, out_dir: str) -> list[str]:
    """Write report.json (every number, rounded as the synthetic report's), meta.json and report.md into
    `out_dir`, replacing those three files only. Returns the names written."""
    os.makedirs(out_dir, exist_ok=True)
    synthetic.write_json(result, os.path.join(out_dir, "report.json"))
    synthetic.write_json(run_meta, os.path.join(out_dir, "meta.json"))
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(markdown(result))
    return ["report.md", "report.json", "meta.json"]


def markdown(result: dict) -> str:
    """report.md: a function of report.json alone (the run's commit, date, host and run time are in meta.json)."""
    meta, env = result["meta"], result["meta"]["environment"]
    L = [f"# KDA accuracy on captured inputs: `{meta['inputs']}` on `{env['device']}`", ""]
    L += ["The decode study of the synthetic report (`python -m kda.accuracy`, docs/accuracy.md) run on a model's own "
          "activations, recorded by `kda.accuracy.capture`: per layer, each captured sequence's prefill through "
          "`kda.chunk_kda` into a paged pool, then its continuation one token per `kda.fused_recurrent_kda` call, the "
          f"pool stored in {', '.join(meta['configs'])} (`+sr`: stochastic rounding, seed = step), against "
          "`kda_reference.recurrent_kda` in float64 with the layer's own options (gate parameters, lower bound, scale, "
          "flags) on the same tokens. q, k, v run in fp32 (their captured values, exactly), so the output error is "
          "what the state storage causes. Same thresholds and wording as the synthetic verdict. Regenerate with "
          f"`python -m kda.accuracy --inputs <capture directory> --device {env['device']}`.", ""]
    L += ["The run's commit, date, host and run time are in `meta.json` beside this file.", ""]
    L += _capture_md(meta["capture"])
    if result["notes"]:
        L += ["## What this capture cannot decide", ""] + [f"- {n}" for n in result["notes"]] + [""]
    L += _verdict_md(result)
    L += _layers_md(result["layers"])
    L += _prefill_md(result["layers"])
    L += _decode_md(result)
    return "\n".join(L)


def _capture_md(c: dict) -> list[str]:
    stopped = "no" if not c.get("stopped") else f"**yes**: {c['stopped']['reason']}"
    return ["## The capture", "", *table(["", ""], [
        ["calls recorded / seen", f"{c.get('calls_recorded')} / {c.get('calls_seen')}"],
        ["tokens / budget", f"{c.get('tokens')} / {c.get('max_tokens')}"],
        ["bytes / budget", f"{c.get('bytes')} / {c.get('max_bytes')}"], ["stopped by the budget", stopped]])]


def _verdict_md(result: dict) -> list[str]:
    per, horizon = result["verdicts_per_layer"], result["meta"]["horizon"]
    if not per:
        return ["## Verdict", "", "No layer has decode steps to judge: no verdict (see above).", ""]
    L = ["## Verdict for the model", "",
         f"A storage dtype passes a layer when, at the layer's last captured decode step, (1) its output error is at "
         f"most **{OUTPUT_FLOOR_FACTOR:g}x the bf16 rounding floor of the exact output**, and (2) for fp16/bf16, the "
         f"kernel's output and state errors are at most **{EMULATION_RATIO_MAX:g}x the emulation's** (float64, the "
         "state rounded to the same dtype after every token). It passes the model when it passes every layer; the "
         "worst layer is the one with the largest output error over its floor.", ""]
    L += [f"- **{v['state']}**: {v['text']}" for v in result["verdicts"]] + [""]
    L += ["### Per layer", "",
          f"Columns as in the synthetic verdict table: output error over the last min({OUTPUT_WINDOW}, s/2) steps at "
          f"the last step s; `exponent`: slope of log(output error) on log(steps), 95% interval, fitted on steps >= "
          f"{FIT_MIN_STEP} when there are 3 such checkpoints, else on all; `x floor at {horizon}`: a still-growing "
          "error extrapolated with its exponent (a guide, not a verdict).", ""]
    rows = []
    for v in per:
        fp32 = v["state"] == "fp32"
        x = v.get("extrapolated_over_floor")
        rows.append([v["state"], v["layer"], v["steps"], e(v["out_rel"]), e(v["out_floor_bf16"]),
                     r(v["out_over_floor"]),
                     synthetic.FP32_RATIO if fp32 else r(v["out_over_emulation"]),
                     synthetic.FP32_RATIO if fp32 else r(v["state_over_emulation"]), e(v["state_rel"]),
                     v["exponent"] + (" (growing)" if v["growing"] else ""),
                     r(x) if x is not None else "not growing",
                     "pass" if v["passes"] else "**FAIL**: " + "; ".join(v["reasons"])])
    L += table(["storage", "layer", "steps", "output err", "bf16 out floor",
                f"err / floor (<= {OUTPUT_FLOOR_FACTOR:g})",
                f"kernel/emu out (<= {EMULATION_RATIO_MAX:g})", f"kernel/emu state (<= {EMULATION_RATIO_MAX:g})",
                "state err", "output exponent [95% CI]", f"x floor at {horizon}", "verdict"], rows)
    return L


def _layers_md(layers: list[dict]) -> list[str]:
    rows = [[x["name"], x["calls"], " / ".join(str(x.get(k, "-")) for k in ("H", "HV", "K", "V")), x["input_dtype"],
             x["state_dtype"] or "none", x["sequences"], ", ".join(map(str, x["prefill_lengths"])) or "-",
             x["decode_steps"], ", ".join(f"{k}={v}" for k, v in x["options"].items()),
             ", ".join(x["gate_parameters"]) or "-"] for x in layers]
    return ["## Layers", "", "As captured: `state` is the model's own pool or state dtype; `prefill`: each sequence's "
            "prefill length; `decode steps`: the longest continuation.", "",
            *table(["layer", "calls", "H / HV / K / V", "inputs", "state", "sequences", "prefill", "decode steps",
                    "options", "gate parameters"], rows)]


def _prefill_md(layers: list[dict]) -> list[str]:
    rows = [[x["name"], c, e(p["out_rel"]), e(p["out_floor_bf16"]), e(p["state_rel"])]
            for x in layers for c, p in x.get("prefill", {}).items()]
    if not rows:
        return []
    return ["## Prefill", "", "`kda.chunk_kda` over every sequence's prefill (one varlen call) into a pool of each "
            "dtype: output error over the prefill tokens, its bf16 floor, and the error of the state it stores.", "",
            *table(["layer", "pool", "output err", "bf16 out floor", "stored state err"], rows)]


def _decode_md(result: dict) -> list[str]:
    L = ["## Error against decode steps", ""] if result["entries"] else []
    for name in dict.fromkeys(x["params"]["regime"] for x in result["entries"]):
        rs = [x for x in result["entries"] if x["params"]["regime"] == name]
        steps, names = rs[0]["info"]["steps"], [x["id"].split("/")[-1] for x in rs]
        emus = {x["params"]["state"]: x for x in rs if not x["params"]["stochastic_rounding"]
                and x["params"]["state"] != "fp32"}
        for what, key, emu_key in (("output", "out_rel", "emu_out_rel"), ("state", "state_rel", "emu_state_rel")):
            rows = [[s, *(e(x["metrics"][key][i]) for x in rs), *(e(x["info"][emu_key][i]) for x in emus.values()),
                     *([e(rs[0]["info"]["out_floor_bf16"][i])] if what == "output" else [])]
                    for i, s in enumerate(steps)]
            floor = ["bf16 out floor"] if what == "output" else []
            L += [f"**{name}**: {what} error", "", *table(["step", *names, *(f"emu {d}" for d in emus), *floor], rows)]
        L += [f"**{name}**: fitted exponents (output, state) and kernel / emulation at the last step (`+sr` rows: "
              "against the round-to-nearest emulation, i.e. what stochastic rounding costs (> 1) or gains (< 1))", "",
              *table(["config", "output", "state", "kernel/emu out @end", "kernel/emu state @end"],
                     [[n, fmt_fit(x["info"]["fit_out"]), fmt_fit(x["info"]["fit_state"]),
                       *((synthetic.FP32_RATIO,) * 2 if x["params"]["state"] == "fp32" else
                         (r(x["info"]["out_over_emulation"][-1]), r(x["info"]["state_over_emulation"][-1])))]
                      for n, x in zip(names, rs)])]
    return L
