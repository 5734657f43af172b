"""The decode study of `decode.py` on captured activations: per layer, its sequences' prefill through
`kda.chunk_kda` into a paged pool, then their continuation one token per `kda.fused_recurrent_kda` call,
the pool stored in each configuration (fp32, fp16, bf16, and fp16/bf16 with stochastic rounding, seed =
step), against the float64 oracle.

What differs from the synthetic study, and why:
- q, k, v are upcast to fp32 (exactly: every bf16/fp16 value is an fp32 value), g and beta kept as
  captured: the output is then fp32 and its error is what the state storage causes, as in `decode.py`;
  the model's own input rounding is not counted (it is the same for every state dtype).
- The sequences have their own prefill and continuation lengths: a varlen prefill call, then at decode step
  s one varlen call over the sequences that have an s-th continuation token. At checkpoint s the
  output error sums the last `decode.window(s)` steps of every sequence still decoding there, the state
  error the sequences with at least s steps.
- The oracle is `kda_reference.recurrent_kda` (float64, state never rounded) on each sequence's whole
  token history with the layer's options, from its captured initial state: its outputs are the reference
  of every output; `oracle.Recurrence`, checked against it on every run, carries the float64 state for the
  state errors and, with `store_dtype`, is the emulation.
- A sequence captured mid-way starts from its captured state (stored into the pool in each dtype).
"""

from __future__ import annotations

import math
import os

import torch

import kda_reference as ref

from .captured import Layer
from .config import DTYPES, FIT_MIN_STEP
from .context import entry
from .decode import checkpoints, config_name, window
from .kernels import call
from .measure import fit_exponent, rel_l2

F64 = torch.float64
NAMES = ("q", "k", "v", "g", "beta")
CONFIGS = (("fp32", False), ("fp16", False), ("bf16", False), ("fp16", True), ("bf16", True))


def _padded(layer: Layer, part: str, length: int) -> dict:
    """The sequences' `part` ("prefill" or "decode") stacked to `[N, length, ...]`, zero-padded."""
    out = {}
    for n in NAMES:
        xs = [getattr(s, part)[n] for s in layer.sequences]
        buf = torch.zeros(len(xs), length, *xs[0].shape[1:], dtype=xs[0].dtype)
        for i, x in enumerate(xs):
            buf[i, :x.shape[0]] = x
        out[n] = buf
    return out


def _kernel_inputs(x: dict, device: str) -> tuple:
    """(q, k, v, g, beta) on the device, q, k, v in fp32 (module docstring)."""
    return tuple((x[n].float() if n in ("q", "k", "v") else x[n]).to(device).contiguous() for n in NAMES)


def oracle(layer: Layer) -> list[dict]:
    """Per sequence: the float64 outputs `o` `[T, HV, V]` over its whole history (`kda_reference.recurrent_kda`)
    and its exact state after the prefill `S0` `[HV, K, V]`."""
    out = []
    for s in layer.sequences:
        xs = [torch.cat([s.prefill[n], s.decode[n]]).unsqueeze(0) for n in NAMES]
        init = (dict(initial_state=s.initial_state.to(F64).unsqueeze(0)) if s.initial_state is not None
                else dict(state_dtype=F64))
        o, _ = ref.recurrent_kda(*xs, output_final_state=True, allow_float64=True, **init, **layer.options)
        if s.prefill_len:
            _, S0 = ref.recurrent_kda(*(x[:, :s.prefill_len] for x in xs), output_final_state=True,
                                      allow_float64=True, **init, **layer.options)
            S0 = S0[0]
        else:
            S0 = s.initial_state.to(F64) if s.initial_state is not None else torch.zeros(
                s.decode["v"].shape[1], s.decode["q"].shape[2], s.decode["v"].shape[2], dtype=F64)
        out.append(dict(o=o[0], S0=S0))
    return out


def study_layer(layer: Layer, device: str = "cpu", progress=lambda msg: None) -> tuple[list[dict], dict]:
    """(entries, prefill) for one layer: decode entries in `decode.py`'s format (params `regime` = the layer's
    name, so `verdict.decode_verdicts` judges them) and the prefill errors per configuration."""
    from .oracle import Recurrence

    seqs, N = layer.sequences, len(layer.sequences)
    dims = layer.shape
    H, scale = dims["H"], layer.options.get("scale") or dims["K"] ** -0.5
    P = [s.prefill_len for s in seqs]
    D = [s.decode_len for s in seqs]
    steps = max(D)
    exact = oracle(layer)
    S0 = torch.stack([x["S0"] for x in exact])
    opts = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in layer.options.items()}

    # float64 state carried over the continuation (padded sequences step on zeros: never measured)
    dec = _padded(layer, "decode", steps)
    qd, kd, vd, gd, bd = ref.prepare_inputs(*(dec[n] for n in NAMES),
                                           **{n: x for n, x in layer.options.items() if n != "scale"})
    carried = Recurrence(S0, H, scale)
    emus = {d: Recurrence(S0, H, scale, store_dtype=DTYPES[d]) for d in ("fp16", "bf16")}

    # pools: sequence n in slot N - 1 - n, one spare slot poisoned with NaN; captured states stored first
    slots = torch.arange(N - 1, -1, -1, dtype=torch.int32, device=device)
    has = torch.tensor([s.initial_state is not None for s in seqs], device=device)
    bounds = [0]
    for p in P:
        bounds.append(bounds[-1] + p)
    pre = {n: torch.cat([s.prefill[n] for s in seqs]).unsqueeze(0) for n in NAMES}
    pools, prefill = {}, {}
    o_pre_ref = torch.cat([x["o"][:p] for x, p in zip(exact, P)])
    for c in CONFIGS:
        pool = torch.full((N + 1, dims["HV"], dims["V"], dims["K"]), float("nan"), dtype=DTYPES[c[0]], device=device)
        for i, s in enumerate(seqs):
            if s.initial_state is not None:
                pool[N - 1 - i] = s.initial_state.transpose(-1, -2).to(device, DTYPES[c[0]])
        if bounds[-1]:
            o, _ = call("chunk", *_kernel_inputs(pre, device), cu_seqlens=torch.tensor(bounds, device=device),
                        cu_seqlens_cpu=bounds, state_cache=pool, state_indices=slots, has_initial_state=has,
                        state_v_first=True, **opts)
            prefill[config_name(*c)] = dict(out_rel=rel_l2(o[0].cpu(), o_pre_ref),
                                            state_rel=rel_l2(pool[slots].cpu().transpose(-1, -2), S0),
                                            out_floor_bf16=rel_l2(o_pre_ref.to(torch.bfloat16), o_pre_ref))
        pools[c] = pool
    progress(f"{layer.name}: prefill of {N} sequence(s), {bounds[-1]} tokens, {len(CONFIGS)} configurations")

    cps = checkpoints(steps) if steps else []
    sq = {c: torch.zeros(steps, N, dtype=F64) for c in CONFIGS}
    ref2, floor2 = torch.zeros(steps, N, dtype=F64), torch.zeros(steps, N, dtype=F64)
    emu2 = {d: torch.zeros(steps, N, dtype=F64) for d in emus}
    st = {c: torch.zeros(len(cps), N, dtype=F64) for c in CONFIGS}
    st_ref, emu_st = torch.zeros(len(cps), N, dtype=F64), {d: torch.zeros(len(cps), N, dtype=F64) for d in emus}
    selfcheck = 0.0
    for s in range(steps):
        active = [n for n in range(N) if D[n] > s]
        o_ref = torch.stack([exact[n]["o"][P[n] + s] for n in active])
        o_car = carried.step(qd[:, s], kd[:, s], vd[:, s], gd[:, s], bd[:, s])
        selfcheck = max(selfcheck, rel_l2(o_car[active], o_ref))
        ref2[s, active] = o_ref.square().flatten(1).sum(1)
        floor2[s, active] = (o_ref.to(torch.bfloat16).double() - o_ref).square().flatten(1).sum(1)
        for d, emu in emus.items():
            emu2[d][s, active] = (emu.step(qd[:, s], kd[:, s], vd[:, s], gd[:, s], bd[:, s])[active]
                                  - o_ref).square().flatten(1).sum(1)
        tok = {n: torch.stack([seqs[i].decode[n][s] for i in active]).unsqueeze(0) for n in NAMES}
        one = list(range(len(active) + 1))
        for c, pool in pools.items():
            o, _ = call("fused_recurrent", *_kernel_inputs(tok, device), cu_seqlens=torch.tensor(one, device=device),
                        cu_seqlens_cpu=one, state_cache=pool, state_indices=slots[active], state_v_first=True,
                        stochastic_rounding=c[1], seed=s + 1, **opts)
            sq[c][s, active] = (o[0].cpu().double() - o_ref).square().flatten(1).sum(1)
        if s + 1 in cps:
            i, have = cps.index(s + 1), [n for n in range(N) if D[n] >= s + 1]
            st_ref[i, have] = carried.S[have].square().flatten(1).sum(1)
            for c, pool in pools.items():
                S = pool[slots[have]].cpu().double().transpose(-1, -2)
                st[c][i, have] = (S - carried.S[have]).square().flatten(1).sum(1)
            for d, emu in emus.items():
                emu_st[d][i, have] = (emu.S[have] - carried.S[have]).square().flatten(1).sum(1)
            progress(f"{layer.name}: decode step {s + 1}/{steps}")
    if selfcheck > 1e-10:
        raise RuntimeError(f"{layer.name}: the float64 recurrence disagrees with kda_reference ({selfcheck:.2e})")
    entries = _entries(layer, cps, sq, ref2, floor2, emu2, st, st_ref, emu_st, P, D)
    return entries, dict(prefill=prefill, oracle_selfcheck_rel=selfcheck, prefill_tokens=bounds[-1], steps=steps)


def _curve(num: torch.Tensor, den: torch.Tensor, cps: list[int], windowed: bool) -> list[float]:
    """Relative L2 at each checkpoint: over the window's steps (outputs) or at the checkpoint (states)."""
    vals = []
    for i, s in enumerate(cps):
        sel = slice(s - window(s), s) if windowed else slice(i, i + 1)
        d = den[sel].sum().item()
        vals.append(math.sqrt(num[sel].sum().item() / d) if d > 0 else 0.0)
    return vals


def _entries(layer, cps, sq, ref2, floor2, emu2, st, st_ref, emu_st, P, D) -> list[dict]:
    """One entry per configuration, in `decode.py`'s format."""
    if not cps:
        return []
    fit_from = [i for i, s in enumerate(cps) if s >= FIT_MIN_STEP]
    if len(fit_from) < 3:
        fit_from = list(range(len(cps)))

    def fit(vals):
        return fit_exponent([cps[i] for i in fit_from], [vals[i] for i in fit_from])

    ratio = lambda a, b: a / b if b else None  # noqa: E731
    floor = _curve(floor2, ref2, cps, True)
    out = []
    for c in CONFIGS:
        st_name, sr = c
        out_rel, state_rel = _curve(sq[c], ref2, cps, True), _curve(st[c], st_ref, cps, False)
        emu_out = _curve(emu2[st_name], ref2, cps, True) if st_name in emu2 else [None] * len(cps)
        emu_state = _curve(emu_st[st_name], st_ref, cps, False) if st_name in emu_st else [None] * len(cps)
        info = dict(steps=cps, out_floor_bf16=floor, emu_out_rel=emu_out, emu_state_rel=emu_state,
                    out_over_emulation=[ratio(a, b) for a, b in zip(out_rel, emu_out)],
                    state_over_emulation=[ratio(a, b) for a, b in zip(state_rel, emu_state)],
                    out_over_floor_bf16=[ratio(a, b) for a, b in zip(out_rel, floor)],
                    fit_out=fit(out_rel), fit_state=fit(state_rel), fit_steps=[cps[i] for i in fit_from])
        params = dict(kernel="fused_recurrent", prefill_kernel="chunk", regime=layer.name, state=st_name,
                      stochastic_rounding=sr, prefill=max(P), steps=max(D), sequences=len(P), **layer.shape)
        out.append(entry("captured", f"{layer.name}/{config_name(st_name, sr)}", params,
                         dict(out_rel=out_rel, state_rel=state_rel), info))
    return out


def run(directory: str, device: str = "cpu", progress=lambda msg: None) -> dict:
    """The report of a capture directory (before `report.sanitize`): per layer its shape, dtypes, sequences,
    prefill errors and decode entries, the verdicts per layer and for the model, and the notes on what the
    capture cannot decide."""
    from . import captured, captured_verdict
    from .config import thresholds
    from .measure import environment

    layers, index = captured.load(directory)
    entries, summaries = [], []
    for layer in layers:
        summary = dict(name=layer.name, calls=layer.calls, input_dtype=layer.input_dtype,
                       state_dtype=layer.state_dtype, sequences=len(layer.sequences), left_out=layer.left_out,
                       prefill_lengths=[s.prefill_len for s in layer.sequences],
                       decode_steps=max((s.decode_len for s in layer.sequences), default=0),
                       options={n: x for n, x in layer.options.items() if n not in ("A_log", "dt_bias")},
                       gate_parameters=[n for n in ("A_log", "dt_bias") if n in layer.options])
        if layer.sequences:
            summary.update(layer.shape)
            got, measured = study_layer(layer, device, progress)
            entries += got
            summary.update(measured)
        summaries.append(summary)
    per_layer = captured_verdict.layer_verdicts(entries)
    capture = {n: index.get(n) for n in ("stopped", "tokens", "bytes", "calls_seen", "calls_recorded", "max_tokens",
                                         "max_bytes")}
    meta = dict(kind="captured inputs", inputs=os.path.basename(os.path.normpath(directory)), capture=capture,
                configs=[config_name(*c) for c in CONFIGS], horizon=captured_verdict.HORIZON,
                thresholds=thresholds(), environment=environment(device, 0))
    return dict(meta=meta, verdicts=captured_verdict.model_verdicts(per_layer), verdicts_per_layer=per_layer,
                notes=captured_verdict.notes(summaries, index), layers=summaries, entries=entries)
