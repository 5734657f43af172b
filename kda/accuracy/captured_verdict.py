"""The verdicts of a captured-input replay: per layer by `verdict.decode_verdicts` (the synthetic report's
thresholds and wording, a layer in place of a decay regime), then per storage dtype for the model as a whole,
with the worst layer named, and the notes on what the capture is too short to decide."""

from __future__ import annotations

from .config import FIT_MIN_STEP, PRESETS
from .verdict import decode_verdicts

HORIZON = PRESETS["full"].decode_steps  # the step count the synthetic decision preset measures


def layer_verdicts(entries: list[dict]) -> list[dict]:
    """One verdict per (storage dtype, layer), round-to-nearest storage: `verdict.decode_verdicts` on the
    entries (regime = layer), with a still-growing error extrapolated to HORIZON steps."""
    as_decode = [dict(e, section="decode") for e in entries]
    steps = max((e["params"]["steps"] for e in entries), default=0)
    _, per_layer = decode_verdicts(as_decode, HORIZON if steps < HORIZON else None)
    for v in per_layer:
        v["layer"] = v.pop("regime")
    return per_layer


def model_verdicts(per_layer: list[dict]) -> list[dict]:
    """Per storage dtype: passes when every layer passes; names the failing layers, the worst layer (the
    largest output error over the bf16 output floor) and the layers whose error still grows."""
    out = []
    for state in dict.fromkeys(v["state"] for v in per_layer):
        vs = [v for v in per_layer if v["state"] == state]
        failed = [v["layer"] for v in vs if not v["passes"]]
        growing = [v["layer"] for v in vs if v["growing"]]
        worst = max(vs, key=lambda v: v["out_over_floor"] or 0.0)
        steps = min(v["steps"] for v in vs)
        if failed:
            text = f"FAILS in layer(s) {', '.join(failed)} (at {steps} decode steps)"
        else:
            text = f"passes in every captured layer up to {steps} decode steps"
        over = worst["out_over_floor"]
        text += (f"; worst layer {worst['layer']}: output error {over:.3g}x the bf16 output floor" if over is not None
                 else f"; worst layer {worst['layer']}")
        if growing:
            text += f"; error still growing in {', '.join(growing)}: the verdict holds only up to {steps} steps"
        out.append(dict(state=state, passes=not failed, failed_layers=failed, growing_layers=growing,
                        worst_layer=worst["layer"], worst_out_over_floor=over, steps=steps, text=text))
    return out


def notes(layers: list[dict], index: dict) -> list[str]:
    """What the capture cannot decide: too few decode steps for the horizon or for a fit, layers with no
    continuation, a budget stop, and what was left out."""
    out = []
    if index.get("stopped"):
        out.append(f"The capture stopped recording before the model finished ({index['stopped']['reason']}): "
                   "later calls are missing, so sequences may end early.")
    steps = [L["decode_steps"] for L in layers if L["sequences"]]
    if steps and max(steps) < HORIZON:
        out.append(f"The capture holds at most {max(steps)} decode steps per sequence; the synthetic decision preset "
                   f"`full` measures {HORIZON}. The verdicts hold up to the captured step count only; where an error "
                   f"still grows, `x floor at {HORIZON}` extrapolates it with its fitted exponent (a guide, not a "
                   "verdict). Capture longer generations to decide.")
    if steps and max(steps) < 4 * FIT_MIN_STEP:
        out.append(f"Fewer than 3 checkpoints at or beyond step {FIT_MIN_STEP} (at least {4 * FIT_MIN_STEP} decode "
                   "steps are needed): the growth exponents are fitted on every checkpoint from step 1 and are "
                   "rough.")
    for L in layers:
        if L["sequences"] and not L["decode_steps"]:
            out.append(f"Layer {L['name']}: no decode steps captured (prefill only): no decode verdict for it.")
        for reason in L["left_out"]:
            out.append(f"Layer {L['name']}: left out: {reason}.")
    return out
