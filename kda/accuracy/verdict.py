"""The verdict per storage dtype (from the decode study) and the summary of every check."""

from __future__ import annotations

from .config import EMULATION_RATIO_MAX, GROWING_EXPONENT, OUTPUT_FLOOR_FACTOR, PRESETS, REGIMES


def fmt_fit(fit: dict) -> str:
    """The slope and its 95% interval to 2 decimals (a fit of a constant curve reads 0.00, never -0.00)."""
    if fit.get("slope") is None:
        return "n/a"
    f = {k: round(fit[k], 2) + 0.0 for k in ("slope", "ci_low", "ci_high") if fit.get(k) is not None}
    if "ci_low" not in f:
        return f"{f['slope']:.2f}"
    return f"{f['slope']:.2f} [{f['ci_low']:.2f}, {f['ci_high']:.2f}]"


def decode_verdicts(entries: list[dict], target_steps: int | None = None) -> tuple[list[dict], list[dict]]:
    """One verdict per (storage dtype, regime) for round-to-nearest storage, then one per dtype.

    A regime passes when, at the longest measured step count,
      (1) output error <= OUTPUT_FLOOR_FACTOR x bf16 output rounding floor, and
      (2) for fp16/bf16: kernel / emulation <= EMULATION_RATIO_MAX, for the output and the state.
    When the output error's growth exponent is still above GROWING_EXPONENT (its whole 95% interval),
    the pass holds only up to that step count ("still growing").

    `target_steps` (a proxy preset: the step count of the preset it stands in for): a still-growing output
    error is also extended there with its fitted exponent (`extrapolated_over_floor`): a rough guide to
    what the target preset will measure, never a verdict."""
    per_regime, by_dtype = [], {}
    for e in entries:
        p, info = e["params"], e["info"]
        if e["section"] != "decode" or p["stochastic_rounding"]:
            continue
        out, floor = e["metrics"]["out_rel"][-1], info["out_floor_bf16"][-1]
        r_out, r_state = info["out_over_emulation"][-1], info["state_over_emulation"][-1]
        fit = info["fit_out"]
        growing = fit.get("ci_low") is not None and fit["ci_low"] > GROWING_EXPONENT
        reasons = []
        if not out <= OUTPUT_FLOOR_FACTOR * floor:
            reasons.append(f"output error {out / floor:.3g}x the bf16 output floor (> {OUTPUT_FLOOR_FACTOR:g}x)")
        if p["state"] != "fp32":
            for what, r in (("output", r_out), ("state", r_state)):
                if r is None or not r <= EMULATION_RATIO_MAX:
                    reasons.append(f"kernel {what} error {r if r is None else f'{r:.3g}'}x the emulation's "
                                   f"(> {EMULATION_RATIO_MAX:g}x)")
        over = out / floor if floor else None
        extrapolated = None
        if target_steps and growing and over is not None:
            extrapolated = over * (target_steps / p["steps"]) ** fit["slope"]
        v = dict(state=p["state"], regime=p["regime"], steps=p["steps"], passes=not reasons, reasons=reasons,
                 out_rel=out, out_floor_bf16=floor, out_over_floor=over, target_steps=target_steps,
                 extrapolated_over_floor=extrapolated,
                 out_over_emulation=r_out, state_over_emulation=r_state, state_rel=e["metrics"]["state_rel"][-1],
                 growing=growing, exponent=fmt_fit(fit), fit_out=fit)
        per_regime.append(v)
        by_dtype.setdefault(p["state"], []).append(v)
    overall = []
    for state, vs in by_dtype.items():
        failed = [v["regime"] for v in vs if not v["passes"]]
        growing = [v["regime"] for v in vs if v["growing"]]
        steps = vs[0]["steps"]
        if failed:
            text = f"FAILS in regime(s) {', '.join(failed)} (at {steps} decode steps)"
        else:
            text = f"passes in every measured regime up to {steps} decode steps"
        if growing:
            text += f"; error still growing in {', '.join(growing)}: the verdict holds only up to {steps} steps"
        overall.append(dict(state=state, passes=not failed, failed_regimes=failed, growing_regimes=growing,
                            text=text))
    return overall, per_regime


WIDTH = {"bf16": 0, "fp16": 1, "fp32": 2}  # narrowest first (bf16 has fp16's exponent range, fewer bits)


def _join(items: list[str], conj: str = "or") -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" {conj} " + items[-1]


def advice(entries: list[dict], per_regime: list[dict], preset) -> list[dict]:
    """What to do with each state storage dtype, derived from the measured verdicts (never hard-coded):
    the regimes where it is safe up to the measured step count, those where it is not and which wider
    dtype passes there, growth caveats, whether the kernel (not the dtype) is to blame, and whether
    stochastic rounding paid. One dict per dtype: state, text."""
    by_state: dict[str, list[dict]] = {}
    for v in per_regime:
        by_state.setdefault(v["state"], []).append(v)
    sr_ratio: dict[str, list[float]] = {}
    nearest = {(e["params"]["regime"], e["params"]["state"]): e["metrics"]["out_rel"][-1] for e in entries
               if e["section"] == "decode" and not e["params"]["stochastic_rounding"]}
    for e in entries:
        if e["section"] == "decode" and e["params"]["stochastic_rounding"]:
            base = nearest.get((e["params"]["regime"], e["params"]["state"]))
            if base:
                sr_ratio.setdefault(e["params"]["state"], []).append(e["metrics"]["out_rel"][-1] / base)
    out = []
    for state, vs in by_state.items():
        steps = vs[0]["steps"]
        heads = lambda rs, conj="or": _join([f"{REGIMES[v['regime']].heads} (`{v['regime']}`)" for v in rs], conj)
        ok = [v for v in vs if v["passes"]]
        bad = [v for v in vs if not v["passes"]]
        parts = []
        if ok:
            scope = "in every measured regime" if not bad else "for " + heads(ok, "and")
            parts.append(f"**{state} pools are safe {scope} up to {steps} decode steps**")
        if bad:
            worst = max(bad, key=lambda v: v["out_over_floor"] or 0)
            wider = []
            for v in bad:
                alt = [w["state"] for w in per_regime if w["regime"] == v["regime"] and w["passes"]
                       and WIDTH.get(w["state"], 9) > WIDTH.get(state, 9)]
                wider.append(min(alt, key=lambda d: WIDTH.get(d, 9)) if alt else None)
            text = (f"not for {heads(bad)}" if ok else f"**{state} pools are not safe in any measured regime**")
            text += (f" (output error up to {worst['out_over_floor']:.3g}x the bf16 output floor at {steps} steps)")
            if all(wider) and len(set(wider)) == 1:
                text += f": keep those heads in {wider[0]}"
            elif all(wider):
                text += ": keep " + _join([f"{REGIMES[v['regime']].heads} in {w}" for v, w in zip(bad, wider)],
                                          "and")
            parts.append(text)
        growing = [v for v in ok if v["growing"]]
        if growing:
            fits = ", ".join((f"`{v['regime']}` " if len(growing) > 1 else "") + f"{v['fit_out']['slope']:.2f}"
                             for v in growing)
            parts.append(f"in {heads(growing)} its error still grows (exponent {fits}): beyond {steps} steps "
                         "the verdict is not measured")
        kernel = [v for v in vs if any("emulation" in r for r in v["reasons"])]
        if kernel:
            parts.append(f"in {heads(kernel)} the kernel adds error beyond the {state} rounding (kernel/emulation > "
                         f"{EMULATION_RATIO_MAX:g}): fix the kernel before blaming the dtype")
        text = "; ".join(parts) + "."
        ratios = sr_ratio.get(state)
        if ratios:
            lo, hi = min(ratios), max(ratios)
            span = f"{lo:.2g}x" if f"{lo:.2g}" == f"{hi:.2g}" else f"{lo:.2g}-{hi:.2g}x"
            if lo > 1.05:
                text += f" Stochastic rounding costs {span} the round-to-nearest output error here: keep nearest."
            elif hi < 0.95:
                text += f" Stochastic rounding gains here ({span} the round-to-nearest output error)."
            else:
                text += f" Stochastic rounding makes no clear difference here ({span} round to nearest)."
        if preset.proxy_for:
            target = PRESETS[preset.proxy_for]
            text += (f" (Preset `{preset.name}` is a proxy: confirm with the `{target.name}` preset, "
                     f"{target.decode_steps} steps at K = V = {target.K}, before changing a default.)")
        out.append(dict(state=state, text=text))
    return out


def failed_checks(entries: list[dict]) -> list[str]:
    return [f"{e['id']}: {name}" for e in entries for name, ok in e["checks"].items() if not ok]
