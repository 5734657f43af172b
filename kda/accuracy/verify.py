"""Speculative verify: a verify step with rejected drafts, then a continuation from the
last accepted draft, through a paged pool stored in each dtype, against the float64 oracle and against the
same tokens decoded one call at a time.

Setup. N = 5 sequences (the last one padding: read slot -1), fp32 q, k, v of the strong regime, V-first
planes, a pool of 4 x DRAFTS + 3 slots poisoned with NaN / 1e30, random initial states in each real
sequence's first slot:

    verify:        kda.fused_recurrent_kda(DRAFTS tokens each, state_indices [N, DRAFTS])
    continuation:  kda.fused_recurrent_kda(lengths CONTINUATION, the same rows, num_accepted_tokens
                   ACCEPTED: some drafts rejected, some all accepted; one continuation slot -1)

The oracle: `kda_reference.recurrent_kda` on the same calls, in float64 arithmetic, the pool in the storage
dtype (it rounds the carried state to the pool's dtype after every token, as the kernel does). The
step-by-step decode: the accepted drafts and the continuation, one `kda.fused_recurrent_kda` call per token
(1-D state_indices). Bitwise agreement with it is recorded (info); the checks ask for rounding
(`layouts.reorder_bound`), because on a GPU a V-first one-token call runs another binary.
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

DRAFTS = 4
ACCEPTED = [1, 2, 4, 3, 1]  # per sequence; the last sequence is padding
CONTINUATION = [3, 1, 2, 4, 2]


def spec_verify(ctx: Context, part: dict | None = None) -> list[dict]:
    P, dev = ctx.preset, ctx.device
    N = len(ACCEPTED)
    plane = (P.HV, P.K, P.K)
    slots = (N - 1) * DRAFTS + 3
    rows = [[n * DRAFTS + j for j in range(DRAFTS)] for n in range(N - 1)] + [[-1] * DRAFTS]
    cont_rows = [list(r) for r in rows]
    cont_rows[0][1] = -1  # the continuation keeps no state after sequence 0's second token
    named = sorted({s for r in rows for s in r if s >= 0})
    unnamed = torch.tensor([s for s in range(slots) if s not in named], device=dev)
    idx1 = torch.tensor(rows, dtype=torch.int32, device=dev)
    idx2 = torch.tensor(cont_rows, dtype=torch.int32, device=dev)
    accepted = torch.tensor(ACCEPTED, dtype=torch.int32, device=dev)
    (cu1, b1), (cu2, b2) = cu_bounds([DRAFTS] * N, dev), cu_bounds(CONTINUATION, dev)
    inp1 = regime_inputs(REGIMES["strong"], 1, b1[-1], P.H, P.HV, P.K, P.K, ctx.gen("verify/drafts")).to(dev)
    inp2 = regime_inputs(REGIMES["strong"], 1, b2[-1], P.H, P.HV, P.K, P.K, ctx.gen("verify/continue")).to(dev)
    h0 = 0.5 * torch.randn(N - 1, *plane, generator=ctx.gen("verify/h0"))
    named_d = torch.tensor(named, device=dev)

    def scenario(fn, st):
        pool0 = poisoned_pool(slots, plane, st, dev, pad=0)
        pool0[idx1[:N - 1, 0].long()] = h0.to(st).to(dev)
        pool = pool0.clone()
        o1, _ = fn(*inp1.args(), cu_seqlens=cu1, cu_seqlens_cpu=b1, state_cache=pool, state_indices=idx1,
                   state_v_first=True, **inp1.opts)
        pool1 = pool.clone()
        o2, _ = fn(*inp2.args(), cu_seqlens=cu2, cu_seqlens_cpu=b2, state_cache=pool, state_indices=idx2,
                   num_accepted_tokens=accepted, state_v_first=True, **inp2.opts)
        return pool0, o1, pool1, o2, pool

    def oracle(*args, cu_seqlens_cpu=None, **kw):
        return ref.recurrent_kda(*args, **kw)

    out = []
    for st_name in pick(P.contract_states, part, "state"):
        st = DTYPES[st_name]
        pool0, o1, pool1, o2, pool = scenario(lambda *a, **k: call("fused_recurrent", *a, **k), st)
        _, r1, ref1, r2, ref_pool = scenario(oracle, st)
        # the same tokens decoded one call at a time: accepted drafts, then the continuation
        step_out, step_state = [], []
        for n in range(N - 1):
            toks = [(inp1, t) for t in range(b1[n], b1[n] + ACCEPTED[n])]
            toks += [(inp2, t) for t in range(b2[n], b2[n + 1])]
            p = pool0.clone()
            one = idx1[n, :1].contiguous()
            outs = []
            for x, t in toks:
                o, _ = call("fused_recurrent", *x.args(slice(t, t + 1)), state_cache=p, state_indices=one,
                            state_v_first=True, **x.opts)
                outs.append(o[0, 0])
            a = ACCEPTED[n]
            step_out.append((o2[0, b2[n]:b2[n + 1]], torch.stack(outs[a:])))
            # every sequence keeps its last continuation token's state: the final state of the step decode
            step_state.append((pool[cont_rows[n][CONTINUATION[n] - 1]], p[rows[n][0]]))
        so = (torch.cat([x for x, _ in step_out]), torch.cat([y for _, y in step_out]))
        ss = (torch.stack([x for x, _ in step_state]), torch.stack([y for _, y in step_state]))
        out_bound, state_bound = reorder_bound(inp1.v.dtype), reorder_bound(st)
        m1, i1 = errors(o1, r1, inp1.v.dtype, "verify_out")
        m2, i2 = errors(o2, r2, inp2.v.dtype, "continue_out")
        m3, i3 = errors(pool[named_d], ref_pool[named_d], st, "state")
        m4, i4 = errors(pool1[named_d], ref1[named_d], st, "verify_state")
        info = dict(i1, **i2, **i3, **i4, step_out_bitwise=same_bits(*so), step_state_bitwise=same_bits(*ss),
                    step_out_diff_rel=rel_l2(*so), step_state_diff_rel=rel_l2(*ss))
        checks = dict(
            finite=all_finite(o1, o2, pool1[named_d], pool[named_d]),
            padding_rows_zero=bool((o1[0, b1[-2]:] == 0).all() and (o2[0, b2[-2]:] == 0).all()),
            unnamed_untouched_bits=same_bits(pool1[unnamed], pool0[unnamed])
            and same_bits(pool[unnamed], pool0[unnamed]),
            step_out_rounding=info["step_out_diff_rel"] <= out_bound,
            step_state_rounding=info["step_state_diff_rel"] <= state_bound,
        )
        params = dict(kernel="fused_recurrent", input="fp32", state=st_name, drafts=DRAFTS, accepted=ACCEPTED,
                      continuation=CONTINUATION, state_indices=rows, continuation_state_indices=cont_rows,
                      slots=slots, H=P.H, HV=P.HV, K=P.K, V=P.K, oracle="recurrent")
        out.append(entry("spec_verify", f"fused_recurrent/state={st_name}", params, {**m1, **m2, **m3, **m4},
                         info, checks))
        ctx.progress(f"spec_verify: {st_name} storage done")
    return out
