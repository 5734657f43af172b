"""The verdict per storage dtype (from the decode study) and the summary of every check."""

from __future__ import annotations

from .config import EMULATION_RATIO_MAX, GROWING_EXPONENT, OUTPUT_FLOOR_FACTOR


def _fmt_fit(fit: dict) -> str:
    if fit.get("slope") is None:
        return "n/a"
    if fit.get("ci_low") is None:
        return f"{fit['slope']:.2f}"
    return f"{fit['slope']:.2f} [{fit['ci_low']:.2f}, {fit['ci_high']:.2f}]"


def decode_verdicts(entries: list[dict]) -> list[dict]:
    """One verdict per (storage dtype, regime) for round-to-nearest storage, then one per dtype.

    A regime passes when, at the longest measured step count,
      (1) output error <= OUTPUT_FLOOR_FACTOR x bf16 output rounding floor, and
      (2) for fp16/bf16: kernel / emulation <= EMULATION_RATIO_MAX, for the output and the state.
    When the output error's growth exponent is still above GROWING_EXPONENT (its whole 95% interval),
    the pass holds only up to that step count ("still growing")."""
    per_regime, by_dtype = [], {}
    for e in entries:
        p, info = e["params"], e["info"]
        if e["section"] != "decode" or p["stochastic_rounding"]:
            continue
        out, floor = e["metrics"]["out_rel"][-1], info["out_floor_bf16"][-1]
        r_out, r_state = info["out_over_emulation"][-1], info["state_over_emulation"][-1]
        reasons = []
        if not out <= OUTPUT_FLOOR_FACTOR * floor:
            reasons.append(f"output error {out / floor:.2f}x the bf16 output floor (> {OUTPUT_FLOOR_FACTOR:g}x)")
        if p["state"] != "fp32":
            for what, r in (("output", r_out), ("state", r_state)):
                if r is None or not r <= EMULATION_RATIO_MAX:
                    reasons.append(f"kernel {what} error {r if r is None else f'{r:.2f}'}x the emulation's "
                                   f"(> {EMULATION_RATIO_MAX:g}x)")
        fit = info["fit_out"]
        growing = fit.get("ci_low") is not None and fit["ci_low"] > GROWING_EXPONENT
        v = dict(state=p["state"], regime=p["regime"], steps=p["steps"], passes=not reasons, reasons=reasons,
                 out_rel=out, out_floor_bf16=floor, out_over_floor=out / floor if floor else None,
                 out_over_emulation=r_out, state_over_emulation=r_state, state_rel=e["metrics"]["state_rel"][-1],
                 growing=growing, exponent=_fmt_fit(fit), fit_out=fit)
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


def failed_checks(entries: list[dict]) -> list[str]:
    return [f"{e['id']}: {name}" for e in entries for name, ok in e["checks"].items() if not ok]
