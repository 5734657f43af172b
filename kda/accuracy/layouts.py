"""Studies of the sequence and state contracts: varlen layouts with empty sequences, and the paged pool
against dense state (bitwise). Each returns a list of entries (`context.entry`)."""

from __future__ import annotations

import torch

from .config import DTYPES, REGIMES
from .context import Context, entry
from .inputs import regime_inputs
from .kernels import call
from .measure import all_finite, errors, rel_l2, same_bits
from .oracle import exact
from .prefill import KERNEL_NAMES, pick, within_bound

# sequence lengths per layout (clipped to the preset's varlen_max_len); 70 and 65 cross a 64-token chunk
LAYOUTS = {
    "leading_empty": [0, 37, 20],
    "trailing_empty": [29, 40, 0],
    "consecutive_empty": [17, 0, 0, 0, 33],
    "all_empty": [0, 0, 0],
    "single_tokens": [1, 1, 1, 1],
    "mixed": [0, 1, 70, 0, 0, 65, 1, 0],
}


def _cu(lengths: list[int], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cpu = torch.tensor(bounds, dtype=torch.int32)
    return cpu.to(device), cpu


def varlen(ctx: Context, part: dict | None = None) -> list[dict]:
    """bf16 inputs with `cu_seqlens`, a random dense initial state per sequence (K-first) in each storage
    dtype: per-sequence output and final-state error, and the empty sequences' final state compared bit
    for bit with their initial state."""
    P, dev = ctx.preset, ctx.device
    out = []
    for layout in pick(list(LAYOUTS), part, "layout"):
        full_lengths = LAYOUTS[layout]
        lengths = [min(n, P.varlen_max_len) for n in full_lengths]
        N, T = len(lengths), sum(lengths)
        cu, cu_cpu = _cu(lengths, dev)
        inp = regime_inputs(REGIMES["strong"], 1, T, P.H, P.HV, P.K, P.K, ctx.gen(f"varlen/{layout}"))
        inp = inp.cast(torch.bfloat16).to(dev)
        h0 = torch.randn(N, P.HV, P.K, P.K, generator=ctx.gen(f"varlen/{layout}/h0"))
        for st_name in P.contract_states:
            h = h0.to(DTYPES[st_name]).to(dev)
            o_ref, s_ref, method = exact(inp, initial_state=h, cu_seqlens=cu)
            for kern in KERNEL_NAMES:
                o, s = call(kern, *inp.args(), initial_state=h.clone(), output_final_state=True, cu_seqlens=cu,
                            cu_seqlens_cpu=cu_cpu, **inp.opts)
                seq_out, seq_state, bounded, empty_bits = [], [], True, True
                for n, (a, b) in enumerate(zip(cu_cpu.tolist(), cu_cpu.tolist()[1:])):
                    m_s, i_s = errors(s[n], s_ref[n], DTYPES[st_name], "state")
                    seq_state.append(m_s["state_rel"])
                    bounded &= within_bound(m_s, i_s, "state", inp.v.dtype)
                    if a == b:
                        seq_out.append(0.0)  # no rows
                        empty_bits &= same_bits(s[n], h[n])
                        continue
                    m_o, i_o = errors(o[:, a:b], o_ref[:, a:b], inp.v.dtype, "out")
                    seq_out.append(m_o["out_rel"])
                    bounded &= within_bound(m_o, i_o, "out", inp.v.dtype)
                metrics = dict(seq_out_rel=seq_out, seq_state_rel=seq_state)
                info = dict(lengths=lengths, max_seq_out_rel=max(seq_out), max_seq_state_rel=max(seq_state),
                            out_floor=rel_l2(o_ref.to(inp.v.dtype), o_ref) if T else 0.0,
                            state_floor=rel_l2(s_ref.to(DTYPES[st_name]), s_ref))
                checks = dict(finite=all_finite(o, s), within_bound=bounded, empty_keep_state_bits=empty_bits,
                              output_rows=tuple(o.shape) == (1, T, P.HV, P.K))
                params = dict(kernel=kern, layout=layout, lengths=lengths, input="bf16", state=st_name, H=P.H,
                              HV=P.HV, K=P.K, V=P.K, oracle=method)
                out.append(entry("varlen", f"{layout}/{kern}/state={st_name}", params, metrics, info, checks))
        ctx.progress(f"varlen: {layout} {lengths} done")
    return out


def poisoned_pool(slots: int, plane: tuple, dtype: torch.dtype, device: str, pad: int) -> torch.Tensor:
    """A pool of `slots` dense planes, slot stride one plane + `pad` elements, every slot poisoned with
    NaN or a huge value (alternating): unread, unwritten slots must keep these bits."""
    numel = plane[0] * plane[1] * plane[2]
    big = torch.empty(slots, numel + pad, dtype=torch.float32)
    big[0::2] = float("nan")
    big[1::2] = 6e4 if dtype == torch.float16 else 1e30
    return big.to(dtype).to(device)[:, :numel].view(slots, *plane)


def paged_vs_dense(ctx: Context, part: dict | None = None) -> list[dict]:
    """Per kernel and storage dtype, V-first planes (the serving layout), varlen with an empty sequence:
    - the paged call (permuted slots of a padded pool poisoned with NaN/1e30) gives bit for bit the
      dense call's output and final states, and leaves every other slot's bits unchanged;
    - dirty slots (NaN) with has_initial_state = False: bit for bit the dense call from zeros there;
    - a padding sequence (slot -1): zero output rows, nothing written, the others unchanged."""
    P, dev = ctx.preset, ctx.device
    lengths = [min(n, P.varlen_max_len) for n in (3, 0, 17, 1, 9)]
    N, T = len(lengths), sum(lengths)
    cu, cu_cpu = _cu(lengths, dev)
    plane = (P.HV, P.K, P.K)
    slots = 2 * N + 3
    inp = regime_inputs(REGIMES["strong"], 1, T, P.H, P.HV, P.K, P.K, ctx.gen("paged")).cast(torch.bfloat16).to(dev)
    h0 = torch.randn(N, *plane, generator=ctx.gen("paged/h0"))
    idx = torch.randperm(slots, generator=ctx.gen("paged/slots"))[:N].to(torch.int32)
    others = torch.tensor([i for i in range(slots) if i not in idx.tolist()])
    fresh = torch.tensor([n % 2 == 1 for n in range(N)])  # has_initial_state = False here (dirty slots)
    pad_seq = 2  # a sequence with tokens, turned into padding
    seq_rows = [(a, b) for a, b in zip(cu_cpu.tolist(), cu_cpu.tolist()[1:])]
    kw = dict(cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, state_v_first=True, **inp.opts)
    out = []
    for st_name in pick(P.contract_states, part, "state"):
        st = DTYPES[st_name]
        h = h0.to(st).to(dev)
        idx_d, others_d = idx.to(dev), others.to(dev)
        o_ref, s_ref, method = exact(inp, initial_state=h, state_v_first=True, cu_seqlens=cu)
        for kern in KERNEL_NAMES:
            o_d, s_d = call(kern, *inp.args(), initial_state=h.clone(), output_final_state=True, **kw)
            checks = {}
            # 1. paged == dense, bit for bit; untouched slots unchanged
            pool = poisoned_pool(slots, plane, st, dev, pad=7)
            pool[idx_d] = h
            before = pool.clone()
            o_p, _ = call(kern, *inp.args(), state_cache=pool, state_indices=idx_d,
                          has_initial_state=torch.ones(N, dtype=torch.bool, device=dev), **kw)
            checks.update(out_bits=same_bits(o_p, o_d), state_bits=same_bits(pool[idx_d], s_d),
                          untouched_bits=same_bits(pool[others_d], before[others_d]))
            # 2. dirty slots with has_initial_state = False == dense from zeros
            h_zero = h.clone()
            h_zero[fresh.to(dev)] = 0
            o_z, s_z = call(kern, *inp.args(), initial_state=h_zero, output_final_state=True, **kw)
            pool = poisoned_pool(slots, plane, st, dev, pad=7)
            pool[idx_d] = h
            pool[idx_d[fresh.to(dev)]] = float("nan")
            o_p, _ = call(kern, *inp.args(), state_cache=pool, state_indices=idx_d,
                          has_initial_state=(~fresh).to(dev), **kw)
            checks.update(dirty_out_bits=same_bits(o_p, o_z), dirty_state_bits=same_bits(pool[idx_d], s_z),
                          dirty_finite=all_finite(o_p, pool[idx_d]))
            # 3. a padding sequence: zero rows, its slot untouched, the other sequences as in the dense call
            pool = poisoned_pool(slots, plane, st, dev, pad=7)
            pool[idx_d] = h
            before = pool.clone()
            idx_pad = idx_d.clone()
            idx_pad[pad_seq] = -1
            o_p, _ = call(kern, *inp.args(), state_cache=pool, state_indices=idx_pad,
                          has_initial_state=torch.ones(N, dtype=torch.bool, device=dev), **kw)
            a, b = seq_rows[pad_seq]
            keep = torch.ones(T, dtype=torch.bool)
            keep[a:b] = False
            live = torch.tensor([n for n in range(N) if n != pad_seq])
            checks.update(padding_rows_zero=bool((o_p[:, a:b] == 0).all()),
                          padding_others_bits=same_bits(o_p[:, keep.to(dev)], o_d[:, keep.to(dev)])
                          and same_bits(pool[idx_d[live.to(dev)]], s_d[live.to(dev)]),
                          padding_untouched_bits=same_bits(pool[idx_d[pad_seq]], before[idx_d[pad_seq]])
                          and same_bits(pool[others_d], before[others_d]))
            m_o, i_o = errors(o_d, o_ref, inp.v.dtype, "out")
            m_s, i_s = errors(s_d, s_ref, st, "state")
            params = dict(kernel=kern, lengths=lengths, input="bf16", state=st_name, slots=slots,
                          slot_stride=pool.stride(0), plane_numel=plane[0] * plane[1] * plane[2],
                          state_indices=idx.tolist(), fresh=fresh.tolist(), padding_sequence=pad_seq,
                          H=P.H, HV=P.HV, K=P.K, V=P.K, oracle=method)
            out.append(entry("paged", f"{kern}/state={st_name}", params, {**m_o, **m_s}, {**i_o, **i_s}, checks))
        ctx.progress(f"paged: {st_name} storage done")
    return out
