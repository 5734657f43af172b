"""Studies of the sequence and state contracts: varlen layouts with empty sequences, and the paged pool
against dense state (bitwise with a 16-element-aligned slot stride; with an odd one, chunk bitwise and
fused_recurrent within rounding). Each returns a list of entries (`context.entry`)."""

from __future__ import annotations

import torch

from .config import DTYPES, REGIMES, REORDER_FP32_TERM
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


def cu_bounds(lengths: list[int], device: str) -> tuple[torch.Tensor, list[int]]:
    """(cu_seqlens int32 on `device`, the same bounds as a host list: `cu_seqlens_cpu`) of these lengths."""
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32, device=device), bounds


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
        cu, cu_cpu = cu_bounds(lengths, dev)
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
                for n, (a, b) in enumerate(zip(cu_cpu, cu_cpu[1:])):
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


# Slot strides of the paged study, in elements past one plane. ALIGNED_PAD keeps stride(0) a multiple of
# 16 elements (every plane is one too): Triton then proves the planes 16-byte aligned and compiles the
# paged call to the dense call's code, so paged == dense bit for bit for both kernels. ODD_PAD (7) breaks
# that: on a GPU fused_recurrent_kda then loads the state tile with another register layout and sums over
# K in another order (the last fp32 bits differ); chunk_kda reduces through tl.dot, whose layout does not
# depend on the load, and stays bitwise. The interpreter has no layouts: bitwise at both strides.
ALIGNED_PAD = 16
ODD_PAD = 7


def reorder_bound(dtype: torch.dtype) -> float:
    """Bound on the relative L2 difference between two results of one call that differ only in the order
    of the fp32 sums over K (fused_recurrent_kda, paged with an odd slot stride vs dense), stored in `dtype`:
    2 x the unit roundoff u of `dtype` + REORDER_FP32_TERM (u = 2^-24 fp32, 2^-11 fp16, 2^-8 bf16).

    Why. Both calls do the same operations on the same values; only each K reduction (S'^T k and S'^T q
    per token, K fp32 products) adds its terms in another order. Reordering moves a sum of K terms by at
    most 2 gamma_(K-1) sum|terms| (gamma_n ~ n u_fp32), in practice a few fp32 ulps; the recurrence carries
    these differences over the tokens without amplifying them (decay <= 1; I - beta k k^T with |k| = 1 and
    0 < beta < 1 is a contraction). So the fp32 values a (paged) and b (dense) differ by some delta,
    relative, below 1e-6: a one-off fp32 emulation of the kernel's recurrence (K = V = 128, HV = 4, 1 to 64
    tokens, the strong regime, 20 draws) gave delta <= 3.1e-7 for the output and 3.4e-8 for the state
    between a fully sequential order and the tree-shaped ones of a warp (4 contiguous or 4 strided elements
    per lane, then a tree over 32 lanes). Each result is then rounded once to its dtype, fl(x) = x (1 + e)
    with |e| <= u, so
        ||fl(a) - fl(b)|| <= ||a - b|| + u (||a|| + ||b||)  =>  relative <= delta + 2u (to first order):
    two roundings that fall on either side of a rounding boundary cost at most an ulp each, whatever
    delta is. For fp32 2u = 1.2e-7 and delta dominates: the bound is 1.1e-6 (about 19 fp32 ulps), 33x the
    largest emulated state delta and 3.6x the largest emulated fp32 output delta. For bf16 and fp16 the
    rounding term dominates (the emulation: bf16 outputs differed by at most 5e-4 and bf16 states by
    1.4e-5, against a bound of 7.8e-3)."""
    return 2 * (torch.finfo(dtype).eps / 2) + REORDER_FP32_TERM


def _bitwise(r: dict, dense: dict, prefix: str = "") -> dict:
    """The bitwise checks of one stride: paged results `r` (`paged_runs`) against the dense ones."""
    same = {n: same_bits(r[n], d) for n, d in dense.items()}
    return {f"{prefix}out_bits": same["out"], f"{prefix}state_bits": same["state"],
            f"{prefix}untouched_bits": r["untouched_bits"], f"{prefix}dirty_out_bits": same["dirty_out"],
            f"{prefix}dirty_state_bits": same["dirty_state"], f"{prefix}dirty_finite": r["dirty_finite"],
            f"{prefix}padding_rows_zero": r["padding_rows_zero"],
            f"{prefix}padding_others_bits": same["padding_out"] and same["padding_state"],
            f"{prefix}padding_untouched_bits": r["padding_untouched_bits"]}


def paged_vs_dense(ctx: Context, part: dict | None = None) -> list[dict]:
    """Per kernel and storage dtype, V-first planes (the serving layout), varlen with an empty sequence,
    through a pool of permuted slots poisoned with NaN/1e30 whose slot stride is padded past the plane by
    ALIGNED_PAD (a multiple of 16 elements) and then by ODD_PAD elements:
    - the paged call gives the dense call's output and final states, and leaves every other slot's bits
      unchanged;
    - dirty slots (NaN) with has_initial_state = False: the dense call from zeros there;
    - a padding sequence (slot -1): zero output rows, nothing written, the others as in the dense call.
    The contract: with the aligned stride, both kernels bit for bit (checks `out_bits`, ...); with the odd
    stride, chunk_kda bit for bit (`odd_out_bits`, ...) and fused_recurrent_kda within `reorder_bound`
    (`odd_out_rounding`, `odd_state_rounding`; the differences are in info `odd_*_diff_rel`); the slots
    the call must not write keep their bits at both strides, for both kernels. chunk_kda's odd-stride calls
    (and the dense calls they are compared with) run without host bounds: with them, its sequences of
    1..16 tokens go to the recurrent loop kernel (`kda.plan.Route`), whose contract is
    fused_recurrent_kda's; the aligned-stride calls keep them."""
    P, dev = ctx.preset, ctx.device
    lengths = [min(n, P.varlen_max_len) for n in (3, 0, 17, 1, 9)]
    N, T = len(lengths), sum(lengths)
    cu, cu_cpu = cu_bounds(lengths, dev)
    plane = (P.HV, P.K, P.K)
    slots = 2 * N + 3
    inp = regime_inputs(REGIMES["strong"], 1, T, P.H, P.HV, P.K, P.K, ctx.gen("paged")).cast(torch.bfloat16).to(dev)
    h0 = torch.randn(N, *plane, generator=ctx.gen("paged/h0"))
    idx = torch.randperm(slots, generator=ctx.gen("paged/slots"))[:N].to(torch.int32)
    others = torch.tensor([i for i in range(slots) if i not in idx.tolist()])
    fresh = torch.tensor([n % 2 == 1 for n in range(N)])  # has_initial_state = False here (dirty slots)
    pad_seq = 2  # a sequence with tokens, turned into padding
    seq_rows = [(a, b) for a, b in zip(cu_cpu, cu_cpu[1:])]
    a_pad, b_pad = seq_rows[pad_seq]
    keep = torch.ones(T, dtype=torch.bool)
    keep[a_pad:b_pad] = False
    keep = keep.to(dev)
    live = torch.tensor([n for n in range(N) if n != pad_seq]).to(dev)
    kw = dict(cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, state_v_first=True, **inp.opts)
    idx_d, others_d, fresh_d = idx.to(dev), others.to(dev), fresh.to(dev)
    ones = torch.ones(N, dtype=torch.bool, device=dev)

    def paged_runs(kern: str, h: torch.Tensor, st: torch.dtype, pad: int, kw: dict = kw) -> dict:
        """The three paged calls through a pool of slot stride plane + `pad`: results and slot checks."""

        def live_pool():  # poisoned, the live sequences' initial states in their slots
            pool = poisoned_pool(slots, plane, st, dev, pad=pad)
            pool[idx_d] = h
            return pool

        r = {}
        # 1. every sequence from its slot
        pool = live_pool()
        before = pool.clone()
        r["out"], _ = call(kern, *inp.args(), state_cache=pool, state_indices=idx_d, has_initial_state=ones, **kw)
        r["state"] = pool[idx_d]
        r["untouched_bits"] = same_bits(pool[others_d], before[others_d])
        r["stride"] = pool.stride(0)
        # 2. dirty slots (NaN) with has_initial_state = False
        pool = live_pool()
        pool[idx_d[fresh_d]] = float("nan")
        r["dirty_out"], _ = call(kern, *inp.args(), state_cache=pool, state_indices=idx_d,
                                 has_initial_state=~fresh_d, **kw)
        r["dirty_state"] = pool[idx_d]
        r["dirty_finite"] = all_finite(r["dirty_out"], r["dirty_state"])
        # 3. a padding sequence: zero rows, its slot untouched, the other sequences as in the dense call
        pool = live_pool()
        before = pool.clone()
        idx_pad = idx_d.clone()
        idx_pad[pad_seq] = -1
        o_p, _ = call(kern, *inp.args(), state_cache=pool, state_indices=idx_pad, has_initial_state=ones, **kw)
        r["padding_out"], r["padding_state"] = o_p[:, keep], pool[idx_d[live]]
        r["padding_rows_zero"] = bool((o_p[:, a_pad:b_pad] == 0).all())
        r["padding_untouched_bits"] = (same_bits(pool[idx_d[pad_seq]], before[idx_d[pad_seq]])
                                       and same_bits(pool[others_d], before[others_d]))
        return r

    def dense_runs(kern: str, h: torch.Tensor, kw: dict) -> dict:
        """The dense calls the paged ones are compared with: from `h`, and from zeros in the fresh sequences."""
        o_d, s_d = call(kern, *inp.args(), initial_state=h.clone(), output_final_state=True, **kw)
        h_zero = h.clone()
        h_zero[fresh_d] = 0
        o_z, s_z = call(kern, *inp.args(), initial_state=h_zero, output_final_state=True, **kw)
        return dict(out=o_d, state=s_d, dirty_out=o_z, dirty_state=s_z, padding_out=o_d[:, keep],
                    padding_state=s_d[live])

    out = []
    for st_name in pick(P.contract_states, part, "state"):
        st = DTYPES[st_name]
        h = h0.to(st).to(dev)
        o_ref, s_ref, method = exact(inp, initial_state=h, state_v_first=True, cu_seqlens=cu)
        for kern in KERNEL_NAMES:
            dense = dense_runs(kern, h, kw)
            o_d, s_d = dense["out"], dense["state"]
            # aligned stride: paged == dense bit for bit, both kernels
            aligned = paged_runs(kern, h, st, ALIGNED_PAD)
            checks = _bitwise(aligned, dense)
            # odd stride: chunk bit for bit (without host bounds: every sequence through the chunk kernels);
            # fused_recurrent within the reordering bound. Every kernel keeps the slots it must not write, and
            # both get the bound checks (bitwise implies them).
            if kern == "chunk":
                kw_odd = {n: x for n, x in kw.items() if n != "cu_seqlens_cpu"}
                dense = dense_runs(kern, h, kw_odd)
                odd = paged_runs(kern, h, st, ODD_PAD, kw_odd)
            else:
                odd = paged_runs(kern, h, st, ODD_PAD)
            odd_bits = _bitwise(odd, dense, "odd_")
            diffs = {f"odd_{n}_diff_rel": rel_l2(odd[n], d) for n, d in dense.items()}
            out_bound, state_bound = reorder_bound(inp.v.dtype), reorder_bound(st)
            slot_checks = ("odd_untouched_bits", "odd_dirty_finite", "odd_padding_rows_zero",
                           "odd_padding_untouched_bits")
            checks.update({n: odd_bits[n] for n in slot_checks})
            if kern == "chunk":
                checks.update(odd_bits)
            checks.update(odd_out_rounding=all(diffs[f"odd_{n}_diff_rel"] <= out_bound
                                               for n in ("out", "dirty_out", "padding_out")),
                          odd_state_rounding=all(diffs[f"odd_{n}_diff_rel"] <= state_bound
                                                 for n in ("state", "dirty_state", "padding_state")))
            m_o, i_o = errors(o_d, o_ref, inp.v.dtype, "out")
            m_s, i_s = errors(s_d, s_ref, st, "state")
            odd_info = dict(diffs, odd_out_bound=out_bound, odd_state_bound=state_bound,
                            odd_bitwise=all(v for n, v in odd_bits.items() if n not in slot_checks))
            params = dict(kernel=kern, lengths=lengths, input="bf16", state=st_name, slots=slots,
                          slot_stride=aligned["stride"], odd_slot_stride=odd["stride"],
                          plane_numel=plane[0] * plane[1] * plane[2], state_indices=idx.tolist(),
                          fresh=fresh.tolist(), padding_sequence=pad_seq, H=P.H, HV=P.HV, K=P.K, V=P.K,
                          oracle=method)
            out.append(entry("paged", f"{kern}/state={st_name}", params, {**m_o, **m_s}, {**i_o, **i_s, **odd_info},
                             checks))
        ctx.progress(f"paged: {st_name} storage done")
    return out
