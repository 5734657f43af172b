"""Studies of whole-sequence calls: the dtype matrix, growth with length, chunked prefill, adversarial
inputs. Each returns a list of entries (`context.entry`)."""

from __future__ import annotations

import torch

from .config import (
    DTYPES,
    KERNEL_FLOOR_FACTOR,
    KERNEL_FP32_TERM,
    KERNEL_NARROW_TERM,
    REGIMES,
)
from .context import Context, entry
from .inputs import ADVERSARIAL_DOC, adversarial_inputs, gate_form_inputs, regime_inputs
from .kernels import call
from .measure import all_finite, errors, fit_exponent, rel_l2
from .oracle import exact

KERNEL_NAMES = ("chunk", "fused_recurrent")


def pick(values, part: dict | None, key: str) -> list:
    """The values a work unit covers: all, or the one `part[key]` names (see cli.work_units)."""
    return [v for v in values if part is None or key not in part or part[key] == v]


def kernel_bound(floor: float, input_dtype: torch.dtype) -> float:
    """The kernel sanity bound on a relative error (config.py explains the two forms)."""
    if input_dtype == torch.float32:
        return KERNEL_FLOOR_FACTOR * floor + KERNEL_FP32_TERM
    return max(KERNEL_FLOOR_FACTOR * floor, floor + KERNEL_NARROW_TERM)


def within_bound(metrics: dict, info: dict, prefix: str, input_dtype: torch.dtype) -> bool:
    """Whether the `prefix` ("out" or "state") error of a call with `input_dtype` inputs is within
    `kernel_bound`."""
    return metrics[f"{prefix}_rel"] <= kernel_bound(info[f"{prefix}_floor"], input_dtype)


def _measure(o, s, o_ref, s_ref, out_dtype, state_dtype) -> tuple[dict, dict, dict]:
    m_o, i_o = errors(o, o_ref, out_dtype, "out")
    m_s, i_s = errors(s, s_ref, state_dtype, "state")
    metrics, info = {**m_o, **m_s}, {**i_o, **i_s}
    for p in ("out", "state"):
        info[f"{p}_over_floor"] = metrics[f"{p}_rel"] / info[f"{p}_floor"] if info[f"{p}_floor"] else None
        info[f"{p}_bound"] = kernel_bound(info[f"{p}_floor"], out_dtype)
    checks = dict(finite=all_finite(o, s), out_within_bound=within_bound(metrics, info, "out", out_dtype),
                  state_within_bound=within_bound(metrics, info, "state", out_dtype))
    return metrics, info, checks


def dtype_matrix(ctx: Context, part: dict | None = None) -> list[dict]:
    """Input dtype x state storage x gate form, both kernels, one call each from a random initial state
    (V-first planes, stored in the storage dtype): output and final state against the oracle."""
    P, dev = ctx.preset, ctx.device
    out = []
    for gate in pick(P.matrix_gates, part, "gate"):
        base = gate_form_inputs(gate, P.matrix_B, P.matrix_T, P.H, P.HV, P.K, P.K, ctx.gen(f"matrix/{gate}"))
        h0 = torch.randn(P.matrix_B, P.HV, P.K, P.K, generator=ctx.gen(f"matrix/{gate}/h0"))
        for in_name in pick(P.matrix_inputs, part, "input"):
            inp = base.cast(DTYPES[in_name]).to(dev)
            for st_name in P.matrix_states:
                h = h0.to(DTYPES[st_name]).to(dev)
                o_ref, s_ref, method = exact(inp, initial_state=h, state_v_first=True)
                for kern in KERNEL_NAMES:
                    o, s = call(kern, *inp.args(), initial_state=h.clone(), output_final_state=True,
                                state_v_first=True, **inp.opts)
                    metrics, info, checks = _measure(o, s, o_ref, s_ref, inp.v.dtype, DTYPES[st_name])
                    params = dict(kernel=kern, input=in_name, state=st_name, gate=gate, B=P.matrix_B,
                                  T=P.matrix_T, H=P.H, HV=P.HV, K=P.K, V=P.K, oracle=method)
                    out.append(entry("dtype_matrix", f"{kern}/in={in_name}/state={st_name}/gate={gate}",
                                     params, metrics, info, checks))
            ctx.progress(f"dtype_matrix: gate {gate}, {in_name} inputs done")
    return out


def length_growth(ctx: Context, part: dict | None = None) -> list[dict]:
    """chunk_kda on prefixes T = length_Ts of one long sequence per batch row (no initial state; final
    state in each storage dtype): output error over the whole prefix and over its last 64 tokens, final
    state error, and their growth exponents in T."""
    P, dev = ctx.preset, ctx.device
    Ts, out = P.length_Ts, []
    for regime in pick(P.length_regimes, part, "regime"):
        base = regime_inputs(REGIMES[regime], P.length_B, Ts[-1], P.H, P.HV, P.K, P.K, ctx.gen(f"length/{regime}"))
        for in_name in pick(P.length_inputs, part, "input"):
            inp = base.cast(DTYPES[in_name]).to(dev)
            # the oracle once over the longest sequence, the float64 state carried between prefixes
            o_parts, s_ref, prev, method = [], {}, 0, None
            state = None
            for T in Ts:
                o, state, method = exact(inp, initial_state=state, tokens=slice(prev, T))
                o_parts.append(o)
                s_ref[T], prev = state, T
            o_ref = torch.cat(o_parts, dim=1)
            for st_name in P.matrix_states:
                curves = {n: [] for n in ("out_rel", "out_tail_rel", "state_rel", "out_max_abs_rel",
                                          "state_max_abs_rel", "out_floor", "out_tail_floor", "state_floor")}
                finite = True
                for T in Ts:
                    o, s = call("chunk", *inp.args(slice(0, T)), output_final_state=True,
                                state_dtype=DTYPES[st_name], **inp.opts)
                    finite &= all_finite(o, s)
                    m_o, i_o = errors(o, o_ref[:, :T], inp.v.dtype, "out")
                    m_s, i_s = errors(s, s_ref[T], DTYPES[st_name], "state")
                    tail = slice(max(0, T - 64), T)
                    for n, x in (*m_o.items(), *m_s.items(), ("out_floor", i_o["out_floor"]),
                                 ("state_floor", i_s["state_floor"]),
                                 ("out_tail_rel", rel_l2(o[:, tail], o_ref[:, tail])),
                                 ("out_tail_floor", rel_l2(o_ref[:, tail].to(inp.v.dtype), o_ref[:, tail]))):
                        curves[n].append(x)
                metrics = {n: curves[n] for n in ("out_rel", "out_tail_rel", "state_rel", "out_max_abs_rel",
                                                  "state_max_abs_rel")}
                info = dict(T=list(Ts), out_floor=curves["out_floor"], out_tail_floor=curves["out_tail_floor"],
                            state_floor=curves["state_floor"],
                            fit_out=fit_exponent(Ts, curves["out_rel"]),
                            fit_out_tail=fit_exponent(Ts, curves["out_tail_rel"]),
                            fit_state=fit_exponent(Ts, curves["state_rel"]))
                params = dict(kernel="chunk", regime=regime, input=in_name, state=st_name, B=P.length_B,
                              H=P.H, HV=P.HV, K=P.K, V=P.K, oracle=method)
                out.append(entry("length", f"{regime}/in={in_name}/state={st_name}", params, metrics, info,
                                 dict(finite=finite)))
            ctx.progress(f"length: {regime} regime, {in_name} inputs, T up to {Ts[-1]} done")
    return out


def chunked_prefill(ctx: Context, part: dict | None = None) -> list[dict]:
    """One sequence split at random points into 1..64 pieces, each a chunk_kda call whose initial state
    is the previous piece's final state, stored in the storage dtype (K-first planes). Against one float64
    run over the whole sequence, beside the emulation (float64, the state rounded at the same cuts)."""
    P, dev = ctx.preset, ctx.device
    T, out = P.chunked_T, []
    for regime in pick(P.chunked_regimes, part, "regime"):
        inp = regime_inputs(REGIMES[regime], 1, T, P.H, P.HV, P.K, P.K, ctx.gen(f"chunked/{regime}")).to(dev)
        o_ref, s_ref, method = exact(inp)
        for st_name in pick(P.matrix_states, part, "state"):
            st = DTYPES[st_name]
            curves = {n: [] for n in ("out_rel", "state_rel", "out_max_abs_rel", "state_max_abs_rel",
                                      "emu_out_rel", "emu_state_rel")}
            finite = True
            for pieces in P.chunked_pieces:
                cuts = (torch.randperm(T - 1, generator=ctx.gen(f"chunked/{regime}/{pieces}"))[: pieces - 1] + 1)
                bounds = [0, *sorted(cuts.tolist()), T]
                state, emu_state, outs, emu_outs = None, None, [], []
                for a, b in zip(bounds, bounds[1:]):
                    first = {} if state is not None else dict(state_dtype=st)
                    o, state = call("chunk", *inp.args(slice(a, b)), initial_state=state, output_final_state=True,
                                    **first, **inp.opts)
                    outs.append(o)
                    o_e, s_e, _ = exact(inp, initial_state=emu_state, tokens=slice(a, b))
                    emu_outs.append(o_e)
                    emu_state = s_e.to(st)  # the emulation stores the state in the storage dtype at each cut
                o, o_e = torch.cat(outs, dim=1), torch.cat(emu_outs, dim=1)
                finite &= all_finite(o, state)
                m_o, _ = errors(o, o_ref, inp.v.dtype, "out")
                m_s, _ = errors(state, s_ref, st, "state")
                for n, x in (*m_o.items(), *m_s.items(), ("emu_out_rel", rel_l2(o_e, o_ref)),
                             ("emu_state_rel", rel_l2(emu_state, s_ref))):
                    curves[n].append(x)
            metrics = {n: curves[n] for n in ("out_rel", "state_rel", "out_max_abs_rel", "state_max_abs_rel")}
            info = dict(pieces=list(P.chunked_pieces), emu_out_rel=curves["emu_out_rel"],
                        emu_state_rel=curves["emu_state_rel"],
                        state_over_emulation=[_ratio(a, b) for a, b in
                                              zip(curves["state_rel"], curves["emu_state_rel"])],
                        out_floor_bf16=rel_l2(o_ref.to(torch.bfloat16), o_ref), state_floor=rel_l2(s_ref.to(st), s_ref),
                        fit_state=fit_exponent(P.chunked_pieces, curves["state_rel"]),
                        fit_out=fit_exponent(P.chunked_pieces, curves["out_rel"]))
            params = dict(kernel="chunk", regime=regime, input="fp32", state=st_name, T=T, H=P.H, HV=P.HV,
                          K=P.K, V=P.K, oracle=method)
            out.append(entry("chunked_prefill", f"{regime}/state={st_name}", params, metrics, info,
                             dict(finite=finite)))
            ctx.progress(f"chunked_prefill: {regime} regime, {st_name} storage, {len(P.chunked_pieces)} splits done")
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def adversarial(ctx: Context, part: dict | None = None) -> list[dict]:
    """The adversarial cases of `inputs.ADVERSARIAL_DOC`, both kernels, no initial state."""
    P, dev = ctx.preset, ctx.device
    out = []
    for case in pick(P.adversarial_cases, part, "case"):
        base = adversarial_inputs(case, 1, P.adversarial_T, P.H, P.HV, P.K, P.K, ctx.gen(f"adversarial/{case}"))
        for in_name in P.adversarial_inputs:
            inp = base.cast(DTYPES[in_name]).to(dev)
            o_ref, s_ref, method = exact(inp, method="recurrent")
            for st_name in P.adversarial_states:
                for kern in KERNEL_NAMES:
                    o, s = call(kern, *inp.args(), output_final_state=True, state_dtype=DTYPES[st_name], **inp.opts)
                    metrics, info, checks = _measure(o, s, o_ref, s_ref, inp.v.dtype, DTYPES[st_name])
                    params = dict(kernel=kern, case=case, input=in_name, state=st_name, T=P.adversarial_T, H=P.H,
                                  HV=P.HV, K=P.K, V=P.K, oracle=method, what=ADVERSARIAL_DOC[case])
                    out.append(entry("adversarial", f"{case}/{kern}/in={in_name}/state={st_name}", params,
                                     metrics, info, checks))
        ctx.progress(f"adversarial: {case} done")
    return out
