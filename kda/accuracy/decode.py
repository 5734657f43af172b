"""Growth with decode steps: a prefill, then one token per call through a paged pool stored in each
dtype (rounded every step), against one float64 run over the whole sequence, beside the float64
emulation of the same storage.

Setup. N = regimes x reps sequences in one batch (sequence n of regime n // reps), fp32 q, k, v (so the
output error is the error the state storage causes; the bf16 output rounding floor is reported beside
it). Per storage configuration (dtype, and stochastic rounding where asked) one pool of N + 2 slots,
V-first planes, the slots permuted, the two unused slots poisoned with NaN (they must stay so):

    prefill:  kda.chunk_kda(tokens [0, P)) into the pool (has_initial_state = False)
    step s:   kda.fused_recurrent_kda(token P + s - 1) reading and writing the pool, seed = s for SR

The oracle: the prefill in float64 (`oracle.exact`), then `oracle.Recurrence` carrying the float64 state
one token per step for all sequences and heads at once. The emulation: the prefill state rounded to the
storage dtype, then `Recurrence(store_dtype=...)`.

Measured per regime at checkpoints s = 1, 2, 4, ..., steps: the output error over the last
min(64, ceil(s / 2)) steps (relative L2 over that window) and the state error at step s, for the kernel
and the emulation, their ratio, the bf16 output floor over the same window, and the fitted exponent of
error vs s (checkpoints s >= 16).
"""

from __future__ import annotations

import math

import torch

from .config import DTYPES, FIT_MIN_STEP, OUTPUT_WINDOW, REGIMES, dtype_name
from .context import Context, entry
from .inputs import Inputs, regime_inputs
from .kernels import call
from .measure import fit_exponent, same_bits
from .oracle import Recurrence, exact, prepared, selfcheck
from .prefill import pick

F64 = torch.float64


def checkpoints(steps: int) -> list[int]:
    out = [1]
    while out[-1] * 2 <= steps:
        out.append(out[-1] * 2)
    if out[-1] != steps:
        out.append(steps)
    return out


def window(s: int) -> int:
    return min(OUTPUT_WINDOW, max(1, math.ceil(s / 2)))


def _sq_rows(x: torch.Tensor) -> torch.Tensor:
    """Sum of squares per sequence (dim 0), float64."""
    return x.double().square().flatten(1).sum(1)


def configs(preset) -> list[tuple[str, bool]]:
    return [(d, False) for d in preset.decode_states] + [(d, True) for d in preset.decode_sr]


def config_name(st_name: str, sr: bool) -> str:
    return f"{st_name}+sr" if sr else st_name


def decode_growth(ctx: Context, part: dict | None = None) -> tuple[list[dict], dict]:
    """The study of the module docstring, for every regime of the preset or the one `part` names."""
    P, dev = ctx.preset, ctx.device
    regimes, reps = pick(P.decode_regimes, part, "regime"), P.decode_reps
    N, H, HV, K = len(regimes) * reps, P.H, P.HV, P.K
    T0, steps = P.decode_prefill, P.decode_steps
    scale = K**-0.5
    parts = [regime_inputs(REGIMES[r], reps, T0 + steps, H, HV, K, K, ctx.gen(f"decode/{r}")) for r in regimes]
    inp = Inputs(*(torch.cat([getattr(p, n) for p in parts]) for n in ("q", "k", "v", "g", "beta")),
                 opts=parts[0].opts).to(dev)

    # oracle and emulations
    _, S0, method = exact(inp, tokens=slice(0, T0))
    check = selfcheck(Inputs(*inp.args(slice(T0, None)), opts=inp.opts), S0, H, scale, min(8, steps))
    if not check < 1e-10:
        raise RuntimeError(f"the vectorised float64 recurrence disagrees with kda_reference ({check:.2e})")
    oracle = Recurrence(S0, H, scale)
    emus = {d: Recurrence(S0, H, scale, store_dtype=DTYPES[d]) for d in P.decode_states}
    qd, kd, vd, gd, bd = prepared(inp, slice(T0, None))

    # kernel pools, filled by the prefill kernel
    slots, plane = N + 2, (HV, K, K)
    idx = torch.randperm(slots, generator=ctx.gen(f"decode/slots/{','.join(regimes)}"))[:N].to(torch.int32).to(dev)
    unused = torch.tensor([i for i in range(slots) if i not in idx.tolist()], device=dev)
    cfgs = configs(P)
    pools = {}
    for st_name, sr in cfgs:
        pool = torch.full((slots, *plane), float("nan"), dtype=DTYPES[st_name], device=dev)
        call("chunk", *inp.args(slice(0, T0)), state_cache=pool, state_indices=idx, state_v_first=True,
             has_initial_state=torch.zeros(N, dtype=torch.bool, device=dev), **inp.opts)
        pools[(st_name, sr)] = pool
    untouched_before = {c: pool[unused].clone() for c, pool in pools.items()}

    cps = checkpoints(steps)
    ref2 = torch.zeros(steps, N, dtype=F64, device=dev)
    floor2 = torch.zeros(steps, N, dtype=F64, device=dev)  # the bf16 output rounding floor
    out2 = {c: torch.zeros(steps, N, dtype=F64, device=dev) for c in cfgs}
    emu_out2 = {d: torch.zeros(steps, N, dtype=F64, device=dev) for d in emus}
    st_ref2 = torch.zeros(len(cps), N, dtype=F64, device=dev)
    st2 = {c: torch.zeros(len(cps), N, dtype=F64, device=dev) for c in cfgs}
    emu_st2 = {d: torch.zeros(len(cps), N, dtype=F64, device=dev) for d in emus}
    finite = {c: True for c in cfgs}
    ctx.sync()

    for s in range(steps):
        t = T0 + s
        o_ref = oracle.step(qd[:, s], kd[:, s], vd[:, s], gd[:, s], bd[:, s])
        ref2[s] = _sq_rows(o_ref)
        floor2[s] = _sq_rows(o_ref.to(torch.bfloat16).double() - o_ref)
        for d, emu in emus.items():
            emu_out2[d][s] = _sq_rows(emu.step(qd[:, s], kd[:, s], vd[:, s], gd[:, s], bd[:, s]) - o_ref)
        for (st_name, sr), pool in pools.items():
            o, _ = call("fused_recurrent", *inp.args(slice(t, t + 1)), state_cache=pool, state_indices=idx,
                        state_v_first=True, stochastic_rounding=sr, seed=s + 1, **inp.opts)
            out2[(st_name, sr)][s] = _sq_rows(o[:, 0].double() - o_ref)
        if s + 1 in cps:
            i = cps.index(s + 1)
            st_ref2[i] = _sq_rows(oracle.S)
            for c, pool in pools.items():
                S = pool[idx].double().transpose(-1, -2)  # V-first planes -> [N, HV, K, V]
                finite[c] &= bool(torch.isfinite(S).all())
                st2[c][i] = _sq_rows(S - oracle.S)
            for d, emu in emus.items():
                emu_st2[d][i] = _sq_rows(emu.S - oracle.S)
            if s + 1 >= 16 or s + 1 == steps:
                ctx.progress(f"decode {','.join(regimes)}: step {s + 1}/{steps} ({len(cfgs)} kernel configurations x "
                             f"N={N} sequences)")

    # per regime: windowed output errors and state errors at each checkpoint
    def per_regime(sq: torch.Tensor, den: torch.Tensor, r: int, windowed: bool) -> list[float]:
        rows = slice(r * reps, (r + 1) * reps)
        vals = []
        for i, s in enumerate(cps):
            sel = slice(s - window(s), s) if windowed else slice(i, i + 1)
            d = den[sel, rows].sum().item()
            vals.append(math.sqrt(sq[sel, rows].sum().item() / d) if d > 0 else 0.0)
        return vals

    fit_from = [i for i, s in enumerate(cps) if s >= FIT_MIN_STEP]
    if len(fit_from) < 3:
        fit_from = list(range(len(cps)))

    def fit(vals):
        return fit_exponent([cps[i] for i in fit_from], [vals[i] for i in fit_from])

    entries = []
    for r, regime in enumerate(regimes):
        floor = per_regime(floor2, ref2, r, True)
        emu = {d: (per_regime(emu_out2[d], ref2, r, True), per_regime(emu_st2[d], st_ref2, r, False)) for d in emus}
        for c in cfgs:
            st_name, sr = c
            out_rel = per_regime(out2[c], ref2, r, True)
            state_rel = per_regime(st2[c], st_ref2, r, False)
            emu_out, emu_state = emu[st_name]
            info = dict(
                steps=cps, out_floor_bf16=floor, emu_out_rel=emu_out, emu_state_rel=emu_state,
                out_over_emulation=[_ratio(a, b) for a, b in zip(out_rel, emu_out)],
                state_over_emulation=[_ratio(a, b) for a, b in zip(state_rel, emu_state)],
                out_over_floor_bf16=[_ratio(a, b) for a, b in zip(out_rel, floor)],
                fit_out=fit(out_rel), fit_state=fit(state_rel), fit_emu_out=fit(emu_out),
                fit_emu_state=fit(emu_state), fit_steps=[cps[i] for i in fit_from],
            )
            params = dict(kernel="fused_recurrent", prefill_kernel="chunk", regime=regime, state=st_name,
                          stochastic_rounding=sr, prefill=T0, steps=steps, reps=reps, input="fp32", H=H, HV=HV,
                          K=K, V=K, oracle=f"prefill: {method}; decode: vectorised float64 recurrence",
                          emulation=f"float64, state rounded to {st_name} (nearest even) after every token")
            checks = dict(finite=finite[c], unused_slots_bits=same_bits(pools[c][unused], untouched_before[c]))
            entries.append(entry("decode", f"{regime}/{config_name(st_name, sr)}", params,
                                 dict(out_rel=out_rel, state_rel=state_rel), info, checks))
    summary = dict(oracle_selfcheck_rel=check, checkpoints=cps, sequences=N,
                   configs=[config_name(*c) for c in cfgs], state_dtypes=[dtype_name(DTYPES[d]) for d in emus])
    return entries, summary


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None
