"""Prefix-cache checkpoints: a varlen paged prefill that stores the state every CHECKPOINT_EVERY tokens of each
sequence, against the float64 oracle and against the states a step-by-step decode of the same tokens reaches.

Setup. Sequences of LENGTHS tokens (one empty, one ending exactly at a checkpoint), fp32 q, k, v of the strong
regime, V-first planes, a pool poisoned with NaN / 1e30, random initial states in the final slots:

    kda.chunk_kda(..., state_cache=pool, state_indices=FINAL, checkpoint_every=CHECKPOINT_EVERY,
                  checkpoint_indices=CHECKPOINTS)       (entries < 0 skipped; past a sequence's end unused)

The oracle: `kda_reference.chunk_kda` on the same call, float64 arithmetic, each checkpoint rounded once to the
pool's dtype as the kernel stores it. The step-by-step decode: each sequence's tokens through
`kda.fused_recurrent_kda`, one call per token, from the same initial state in an fp32 pool; its state after
token (j + 1) * CHECKPOINT_EVERY, rounded to the pool's dtype, is what checkpoint j must equal, to the rounding
of two orders of the same sums (`layouts.reorder_bound`) plus the chunked form's own fp32 error.
"""

from __future__ import annotations

import torch

import kda_reference as ref

from .config import DTYPES, REGIMES
from .context import Context, entry
from .inputs import regime_inputs
from .kernels import call
from .layouts import cu_bounds, poisoned_pool, reorder_bound
from .measure import all_finite, errors, rel_l2, same_bits
from .prefill import pick

CHECKPOINT_EVERY = 64
LENGTHS = [200, 0, 64, 130]
FINAL = [0, 1, 2, 3]
CHECKPOINTS = [[4, 5, 6], [7, 8, -1], [9, 10, -1], [11, -1, 12]]  # sequence 3 skips its second
# the chunked form against a token-by-token recurrence in fp32: a few fp32 ulps carried over the tokens
# (the chunk tests' FP32 tolerance); the checks add the storage dtype's reorder bound
CHUNK_VS_STEP_FP32 = 1e-5


def _reached():
    """(sequence, checkpoint column, slot, token count) of every checkpoint the call stores."""
    out = []
    for n, (length, row) in enumerate(zip(LENGTHS, CHECKPOINTS)):
        for j, slot in enumerate(row):
            if slot >= 0 and (j + 1) * CHECKPOINT_EVERY <= length:
                out.append((n, j, slot, (j + 1) * CHECKPOINT_EVERY))
    return out


def checkpoints(ctx: Context, part: dict | None = None) -> list[dict]:
    P, dev = ctx.preset, ctx.device
    N = len(LENGTHS)
    plane = (P.HV, P.K, P.K)
    slots = 1 + max(max(FINAL), max(s for row in CHECKPOINTS for s in row)) + 2  # two slots nobody names
    cu, bounds = cu_bounds(LENGTHS, dev)
    final = torch.tensor(FINAL, dtype=torch.int32, device=dev)
    ck = torch.tensor(CHECKPOINTS, dtype=torch.int32, device=dev)
    has = torch.ones(N, dtype=torch.bool, device=dev)
    inp = regime_inputs(REGIMES["strong"], 1, bounds[-1], P.H, P.HV, P.K, P.K, ctx.gen("checkpoints/x")).to(dev)
    h0 = 0.5 * torch.randn(N, *plane, generator=ctx.gen("checkpoints/h0"))
    reached = _reached()
    stored = torch.tensor([s for _, _, s, _ in reached], device=dev)
    named = sorted(set(FINAL) | {s for _, _, s, _ in reached})
    unnamed = torch.tensor([s for s in range(slots) if s not in named], device=dev)

    def run(fn, st):
        pool0 = poisoned_pool(slots, plane, st, dev, pad=0)
        pool0[final.long()] = h0.to(st).to(dev)
        pool = pool0.clone()
        o, _ = fn(*inp.args(), cu_seqlens=cu, cu_seqlens_cpu=bounds, state_cache=pool, state_indices=final,
                  has_initial_state=has, state_v_first=True, checkpoint_every=CHECKPOINT_EVERY,
                  checkpoint_indices=ck, **inp.opts)
        return pool0, o, pool

    def oracle(*args, cu_seqlens_cpu=None, **kw):
        return ref.chunk_kda(*args, **kw)

    out = []
    for st_name in pick(P.contract_states, part, "state"):
        st = DTYPES[st_name]
        pool0, o, pool = run(lambda *a, **k: call("chunk", *a, **k), st)
        _, r_o, r_pool = run(oracle, st)
        # the step-by-step decode from the same initial states, in an fp32 pool
        p = pool0[final.long()].float().clone()
        snaps = {}
        for n in range(N):
            offsets = {upto for m, _, _, upto in reached if m == n}
            one = torch.tensor([n], dtype=torch.int32, device=dev)
            for i in range(max(offsets, default=0)):
                t = bounds[n] + i
                call("fused_recurrent", *inp.args(slice(t, t + 1)), state_cache=p, state_indices=one,
                     state_v_first=True, **inp.opts)
                if i + 1 in offsets:
                    snaps[n, i + 1] = p[n].to(st, copy=True)  # a copy also for fp32: p moves on
        step = torch.stack([snaps[n, upto] for n, _, _, upto in reached])
        m1, i1 = errors(o, r_o, inp.v.dtype, "out")
        m2, i2 = errors(pool[stored], r_pool[stored], st, "checkpoint")
        m3, i3 = errors(pool[final.long()], r_pool[final.long()], st, "final_state")
        bound = reorder_bound(st) + CHUNK_VS_STEP_FP32
        info = dict(i1, **i2, **i3, step_diff_rel=rel_l2(pool[stored], step),
                    step_bitwise=same_bits(pool[stored], step), step_bound=bound)
        checks = dict(
            finite=all_finite(o, pool[stored], pool[final.long()]),
            unnamed_untouched_bits=same_bits(pool[unnamed], pool0[unnamed]),
            step_decode_agrees=info["step_diff_rel"] <= bound,
        )
        params = dict(kernel="chunk", input="fp32", state=st_name, lengths=LENGTHS, checkpoint_every=CHECKPOINT_EVERY,
                      state_indices=FINAL, checkpoint_indices=CHECKPOINTS, stored=[s for _, _, s, _ in reached],
                      slots=slots, H=P.H, HV=P.HV, K=P.K, V=P.K, oracle="chunk")
        out.append(entry("checkpoints", f"chunk/state={st_name}", params, {**m1, **m2, **m3}, info, checks))
        ctx.progress(f"checkpoints: {st_name} storage done")
    return out
