"""The state walk of `chunk_kda`: the serial part of the chunked form, after the prepare stage
(`kda.ops.chunk_prepare`) has written Qd, Kd, M = Xb^T Kr, N = A_qk Xb, gt, M's and N's scales and max|V| per chunk
(Xb = (I + A_kk)^-1 diag(beta), folded in by the prepare). Per chunk, K-first state S [K, V] (the loop body of
`kda_reference.chunk.chunk_kda`, whose `V_new` = U = Xb D here), V read from the input itself:

    D = V - Kd S          O = Qd S + N D          S <- gt * S + M^T D

Plain walk (`_chunk_state_kernel`): one program per (V block, value head, sequence) walks all chunks of
its sequence with S on chip: N * HV * V / BV programs and a serial depth of one step per chunk.

Prefix-cache checkpoints (the state after every `checkpoint_every` tokens of a sequence, into pool slots)
are stored by the walk as it passes the chunk that ends at the offset: no extra pass.

It reads the initial state from, and write the final state to, the pools of `kda.plan.StatePlan`
(dense or paged, in place, rounded to nearest in the storage dtype); the recurrence is in fp32. With fp16
workspaces (16-bit inputs, q and k l2-normalised) the dots take fp16 operands, S and D scaled by a power of
two (D's from a bound, so that no reduction of D sits on the serial chain); with tf32 dots on fp32
workspaces, the fp32 operands are rounded to nearest tf32 first (`tf32_round`).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents
from triton.tools.ragged_tma import load_ragged

from .common import (
    ERROR_KEPT_SLOT,
    chunk_program,
    flag_errors,
    guard_slot,
    kept_item,
    pow2_of,
    pow2_scale,
    round_to,
    seq_bounds,
    slot_of,
    tf32_round,
    tile_mask,
    zero_rows,
    zero_trailing_rows,
)
from .launch import direct
from .overlap import counted_after, ready_counter, ready_zero, spin_zero


@triton.jit
def _walk(S, t_begin, t_end, p_first, i_hv, o_h, s_ot, n_ws, kd_ws, v_h, s_vt, qd_ws, m_ws, gt_ws, sc_ws,
          o_k, k_ok, o_c, c_ok,
          HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
          DOT_PREC: tl.constexpr,
          EVEN_K: tl.constexpr, EVEN_C: tl.constexpr,
          ck_row=None, n_ck=0, ck_every=1, seq_start=0, pool=None, pool_stride=0, n_slots=0,
          HAS_CHECKPOINTS: tl.constexpr = False, V_FIRST: tl.constexpr = False, TMA: tl.constexpr = False,
          i_c0=0, V_TMA: tl.constexpr = False, ready_h=None, WAIT: tl.constexpr = 0, SPIN: tl.constexpr = False,
          x_ws=None, FOLD: tl.constexpr = True, bail=0, bail_flag=None):
    """(S, bail): S [BK, BC] (columns o_c of the state) through the chunks
    starting at t_begin, t_begin + BT, ... below t_end; the j-th chunk's gt is at prepare program
    p_first + j (EVEN_K, EVEN_C: every o_k, o_c is in range). D = V - Kd S (V: columns o_c of the input v of
    this head, `v_h`, token stride s_vt), O = Qd S + N D (stored to `o_h`, token stride s_ot),
    S <- gt * S + M^T D.
    With fp16 workspaces (Qd, Kd, M, N) the dots take fp16 operands: S and D enter scaled by a power of
    two, so they keep tf32's significand within fp16's range, and the fp32 products are scaled back
    exactly (M and N were stored times a power of two per chunk, whose inverse the chunk's row of `sc_ws`
    holds: `chunk_prepare._store_folded`). fp16 dots run at twice the tf32 rate and the workspaces need no
    conversion. S's scale is its maximum's (`pow2_scale`); D's comes from a bound, so that no reduction of
    D waits on the step's chain (`pow2_of`): |D| <= max|V| + sqrt(K) max|S| (each row of Kd has an l2 norm
    of at most 1), max|S| < 2^15 / ps, and max|V| of the chunk's rows, which the prepare stored beside M's
    and N's scales (loaded a chunk ahead, as gt).
    HAS_CHECKPOINTS (a sequence starting at token seq_start; `ck_row` its n_ck checkpoint slots): after a
    whole chunk that ends (j + 1) * ck_every tokens into the sequence, S (columns o_c of the state) is
    stored to slot ck_row[j] of `pool` (rounded to its dtype, in its layout) when that slot is in
    [0, n_slots); the walk goes on from the unrounded S. ck_every is a multiple of BT and t_begin - seq_start
    a multiple of BT, so every checkpoint offset is a chunk end. The next slot is loaded a checkpoint ahead,
    off the step's serial chain.
    WAIT > 0: the prepare runs beside this walk, counting groups of WAIT chunks into `ready_h` (one counter a
    group, HV apart); every chunk's loads wait on its group there (`ready_zero`; SPIN as the kernel's). A wait
    that gives up (`spin_zero`) sets this thread's `bail` and the program's `bail_flag`: from there on the thread
    waits for nothing (the chunks after it are walked from tiles not yet stored, their output rows and checkpoints
    garbage), the final state is not stored, and the kernel's resume launch walks this program again, rewriting
    all of them.
    TMA: the workspaces are ragged tensor descriptors (`triton.tools.ragged_tma`) of `[tokens, HV, *]`, the
    tiles loaded by the copy engine with rows past the chunk's sequence (and columns past K) read as zeros:
    no per-element addresses or masks, which the pointer loads spend most of their issue slots on. V comes
    from the caller's input: with V_TMA `v_h` is its ragged descriptor (columns o_c from i_c0), else a pointer
    to this head's columns (its strides need not suit a descriptor).
    FOLD off (`ChunkPlan.fold`, fp16 workspaces): the prepare stored A_qk in N's place, Kr in M's and Xb (times a
    power of two, `x_ws`), and the scales' row holds 1 / px and R, Xb's largest row sum, where M's and N's
    inverse scales were: the walk forms U = Xb D (scaled by pu from |U| <= R max|D|, no reduction on the chain) and
    takes O = Qd S + A_qk U, S <- gt * S + Kr^T U."""
    F16: tl.constexpr = (kd_ws.dtype if TMA else kd_ws.dtype.element_ty) == tl.float16
    BK: tl.constexpr = o_k.shape[0]
    BC: tl.constexpr = o_c.shape[0]
    # Kd S and Qd S as one [2 BT, BK] x [BK, BC] dot: the step waits on one tensor-core round trip for both
    # (each dot's result is awaited where it is issued). Columns of 64 spill with it and walk slower.
    KQ: tl.constexpr = F16 and BC <= 32
    o_t = tl.arange(0, BT)
    # int32 offsets inside a chunk from int64 chunk bases: 64-bit per-element addresses cost registers
    ws_k = o_t[:, None] * (HV * K) + o_k[None, :]
    ws_n = o_t[:, None] * (HV * BT) + o_t[None, :]  # the [BT, BT] workspaces (N, or A_qk and Xb unfolded)
    if not V_TMA:
        v_off = o_t[:, None] * s_vt + o_c[None, :]
    # gt one chunk ahead: a plain load, so its latency would otherwise sit on the step's serial chain
    gt_ptr = gt_ws + (p_first * HV + i_hv) * K + o_k
    # the waits' zeros, one chain for the gt loads and one for the tiles (below)
    z_g = tl.zeros([], dtype=tl.int32)
    z_t = tl.zeros([], dtype=tl.int32)
    if WAIT > 0:
        z_g, bail = ready_zero(ready_h, t_begin, t_begin, t_end, HV, BT, WAIT, SPIN, z_g, bail, bail_flag)
    gt_next = tl.load(gt_ptr + z_g, mask=k_ok & (o_k * 0 + t_begin < t_end), other=0.0)
    if F16:  # M's and N's inverse scales and max|V|, one chunk ahead as gt
        sc_ptr = sc_ws + (p_first * HV + i_hv) * 4 + z_g
        sm_next = tl.load(sc_ptr, mask=t_begin < t_end, other=0.0)
        sn_next = tl.load(sc_ptr + 1, mask=t_begin < t_end, other=0.0)
        vm_next = tl.load(sc_ptr + 2, mask=t_begin < t_end, other=0.0)
    if HAS_CHECKPOINTS:
        ck_j = (t_begin - seq_start) // ck_every  # the first checkpoint a chunk of this walk can end at
        ck_at = seq_start + (ck_j + 1) * ck_every  # its token
        ck_slot = tl.load(ck_row + ck_j, mask=ck_j < n_ck, other=-1).to(tl.int64)
    for t0 in range(t_begin, t_end, BT):
        gt = gt_next
        gt_ptr += HV * K
        if WAIT > 0:  # the next chunk's gt and scales, stored by the prepare (gt where there is no gate pass)
            z_g, bail = ready_zero(ready_h, t0 + BT, t_begin, t_end, HV, BT, WAIT, SPIN, z_g, bail, bail_flag)
        gt_next = tl.load(gt_ptr + z_g, mask=k_ok & (o_k * 0 + t0 + BT < t_end), other=0.0)
        if F16:
            s_m = sm_next
            s_n = sn_next
            v_max = vm_next
            sc_ptr += HV * 4
            sm_next = tl.load(sc_ptr + z_g, mask=t0 + BT < t_end, other=0.0)
            sn_next = tl.load(sc_ptr + 1 + z_g, mask=t0 + BT < t_end, other=0.0)
            vm_next = tl.load(sc_ptr + 2 + z_g, mask=t0 + BT < t_end, other=0.0)
        row_ok = o_t < t_end - t0
        m_k = tile_mask(row_ok, k_ok, EVEN_K)
        m_c = tile_mask(row_ok, c_ok, EVEN_C)
        base_k = (t0 * HV + i_hv) * K
        n_in = tl.minimum(t_end - t0, BT).to(tl.int32)
        t0_32 = tl.cast(t0, tl.int32)
        if WAIT > 0:  # the chunk stored by the prepare: its tiles' coordinates depend on the wait
            z_t, bail = ready_zero(ready_h, t0, t_begin, t_end, HV, BT, WAIT, SPIN, z_t, bail, bail_flag)
            t0 = t0 + z_t
            t0_32 = t0_32 + z_t
            base_k = base_k + z_t
        base_n = (t0 * HV + i_hv) * BT  # the [BT, BT] workspaces' chunk base
        # V's tile first: it does not wait on S
        if V_TMA:  # v as a ragged descriptor of the input (`chunk._v_tiles`): rows past the sequence read 0
            vt = tl.reshape(load_ragged(v_h, t0_32, n_in, [0, i_hv, i_c0]), [BT, BC])
        else:
            vt = tl.load(v_h + t0 * s_vt + v_off, mask=m_c, other=0.0)
        kd = _k_tile(kd_ws, t0_32, n_in, i_hv, base_k + ws_k, m_k, TMA)
        if F16:
            ps = pow2_scale(S)
            Sr = (S * ps).to(tl.float16)
            inv_ps = 1.0 / ps
            d_bound = v_max + (K ** 0.5) * (32768.0 * inv_ps)  # |D| <= d_bound (and |U| <= R d_bound)
            pd = pow2_of(d_bound)
            # D pd formed scaled, V pd - (Kd Sr) pd / ps: one rounding as in V - Kd S, every factor a power of two
            if KQ:
                qd = _k_tile(qd_ws, t0_32, n_in, i_hv, base_k + ws_k, m_k, TMA)
                kq = tl.reshape(tl.permute(tl.join(kd, qd), (2, 0, 1)), [2 * BT, BK])  # [Kd; Qd]
                kd_s, qd_s = tl.split(tl.permute(tl.reshape(tl.dot(kq, Sr), [2, BT, BC]), (1, 2, 0)))
                Dd = kd_s * (-pd * inv_ps)
            else:
                Dd = tl.dot(kd, Sr) * (-pd * inv_ps)
            Dd += vt.to(tl.float32) * pd
            Dr = Dd.to(tl.float16)
            inv_pd = 1.0 / pd  # one division for both products' factors
            if not FOLD:  # U = Xb D, scaled by pu into fp16: what A_qk and Kr^T multiply below
                xt = _k_tile(x_ws, t0_32, n_in, i_hv, base_n + ws_n, row_ok[:, None], TMA)
                pu = pow2_of(s_n * d_bound)  # s_n: R here, s_m: 1 / px
                Dr = (tl.dot(xt, Dr) * ((pu * s_m) * inv_pd)).to(tl.float16)
                inv_pd = 1.0 / pu
                s_m = 1.0
                s_n = 1.0
        else:
            Sr = tf32_round(S, DOT_PREC)
            D = -tl.dot(tf32_round(kd, DOT_PREC), Sr, input_precision=DOT_PREC)
            D += vt.to(tl.float32)
            Dr = tf32_round(D, DOT_PREC)
        if not KQ:
            qd = _k_tile(qd_ws, t0_32, n_in, i_hv, base_k + ws_k, m_k, TMA)
        # the prepare stored N's rows whole, zeros above the diagonal: masked by rows only
        nt = _k_tile(n_ws, t0_32, n_in, i_hv, base_n + ws_n, row_ok[:, None], TMA)
        if F16:
            if not KQ:
                qd_s = tl.dot(qd, Sr)
            out = qd_s * inv_ps + tl.dot(nt, Dr) * (s_n * inv_pd)
        else:
            out = (tl.dot(tf32_round(qd, DOT_PREC), Sr, input_precision=DOT_PREC)
                   + tl.dot(tf32_round(nt, DOT_PREC), Dr, input_precision=DOT_PREC))
        tl.store(o_h + t0 * s_ot + o_t[:, None] * s_ot + o_c[None, :], round_to(out, o_h.dtype.element_ty),
                 mask=m_c)
        mt = _k_tile(m_ws, t0_32, n_in, i_hv, base_k + ws_k, m_k, TMA)
        if F16:
            S = S * gt[:, None] + tl.dot(tl.trans(mt), Dr) * (s_m * inv_pd)
        else:
            S = S * gt[:, None] + tl.dot(tl.trans(tf32_round(mt, DOT_PREC)), Dr, input_precision=DOT_PREC)
        if HAS_CHECKPOINTS:
            if t0 + BT == ck_at:
                if (t0 + BT <= t_end) & (ck_slot >= 0) & (ck_slot < n_slots):  # a whole chunk, a slot in the pool
                    # the tile's offsets formed here, not kept live through the loop (a [BK, BC] int32 tile)
                    tl.store(pool + ck_slot * pool_stride + _plane_offsets(i_hv, o_k, o_c, K, V, V_FIRST),
                             round_to(S, pool.dtype.element_ty), mask=k_ok[:, None] & c_ok[None, :])
                ck_j += 1
                ck_at += ck_every
                ck_slot = tl.load(ck_row + ck_j, mask=ck_j < n_ck, other=-1).to(tl.int64)
    return S, bail


@triton.jit
def _k_tile(ws, t0_32, n_in, i_hv, offs, mask, TMA: tl.constexpr):
    """A chunk's tile of a token-major workspace ([BT, BK] of Kd, Qd, M; [BT, BT] of N, Xb): by TMA from its ragged
    descriptor `ws` (rows past the sequence read 0), or at pointer offsets `offs` under `mask`."""
    if TMA:
        return tl.reshape(load_ragged(ws, t0_32, n_in, [0, i_hv, 0]), offs.shape)
    else:
        return tl.load(ws + offs, mask=mask, other=0.0)


@triton.jit
def _plane_offsets(i_hv, o_k, o_v, K: tl.constexpr, V: tl.constexpr, V_FIRST: tl.constexpr):
    """Offset of element (k, v) of value head i_hv inside one state plane, in the caller's layout."""
    if V_FIRST:
        return i_hv * (K * V) + o_v[None, :] * K + o_k[:, None]
    else:
        return i_hv * (K * V) + o_k[:, None] * V + o_v[None, :]


@triton.jit
def _sequence_tile(i_n, i_v, i_hv, cu_seqlens, state_src, slot_of_seq, has_initial_state, src_stride, n_slots, T,
                   HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   IS_VARLEN: tl.constexpr, HAS_SRC: tl.constexpr, PAGED: tl.constexpr,
                   HAS_INIT_FLAGS: tl.constexpr, V_FIRST: tl.constexpr):
    """For a program over (V block, sequence i_n, value head): the sequence's token range, the tile's K and V
    indices and their masks, the plane offsets, the slot (< 0: padding) and the initial state tile in
    fp32 (zeros when there is no source, the flag is false, or the sequence is padding: then the slot is
    never read). A slot at or past n_slots (the pool's), or bounds out of range (`seq_bounds`), is taken as
    padding: never an access outside the tensors. i_v, i_hv: the program's V block and value head."""
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    k_ok = o_k < K
    v_ok = o_v < V
    plane_off = _plane_offsets(i_hv, o_k, o_v, K, V, V_FIRST)
    slot, code = guard_slot(slot_of(slot_of_seq, i_n, PAGED), n_slots, eos)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_SRC:
        read = slot >= 0
        if HAS_INIT_FLAGS:
            read = read & (tl.load(has_initial_state + i_n) != 0)
        if read:
            S = tl.load(state_src + slot * src_stride + plane_off, mask=k_ok[:, None] & v_ok[None, :],
                        other=0.0).to(tl.float32)
    return bos, eos, o_k, k_ok, o_v, v_ok, plane_off, slot, S, code


@triton.jit
def _report(errors, code, slot, i_n, bos, eos, ck_row, n_ck, ck_every, n_slots, first, HAS_CHECKPOINTS: tl.constexpr,
            HAS_ERRORS: tl.constexpr):
    """The error word of sequence i_n (`flag_errors`), from one program of the sequence: `code` from
    `_sequence_tile`, and ERROR_KEPT_SLOT for a checkpoint a live sequence reaches whose slot is past the
    pool (the walk skips its store)."""
    if HAS_ERRORS:
        if first:
            if HAS_CHECKPOINTS:
                if slot >= 0:
                    for j in range(0, tl.minimum(n_ck, (eos - bos) // ck_every)):
                        code = code | tl.where(tl.load(ck_row + j) >= n_slots, ERROR_KEPT_SLOT, 0)
            flag_errors(errors, i_n, code, HAS_ERRORS)


@direct
@triton.jit(do_not_specialize=["n_slots", "resume"])
def _chunk_state_kernel(
    o, cu_seqlens, n_ws, kd_ws, v, qd_ws, m_ws, gt_ws, sc_ws,
    state_src, state_dst, slot_of_seq, has_initial_state,
    s_ot, s_oh, s_vt, s_vh, src_stride, dst_stride,
    checkpoint_indices, s_ck, n_ck, ck_every, n_slots, errors, ready, x_ws,
    T, N, NT, resume,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_SRC: tl.constexpr, HAS_DST: tl.constexpr, PAGED: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
    V_FIRST: tl.constexpr, DOT_PREC: tl.constexpr, WARPS: tl.constexpr, HAS_CHECKPOINTS: tl.constexpr = False,
    HAS_ERRORS: tl.constexpr = False, SHORT: tl.constexpr = 0, TMA: tl.constexpr = False,
    V_TMA: tl.constexpr = False, WAIT_CHUNKS: tl.constexpr = 0, WAIT_IN_LOOP: tl.constexpr = False,
    SPIN: tl.constexpr = False, FOLD: tl.constexpr = True, DEPENDENTS: tl.constexpr = False,
):
    """The plain walk: one program per (V block, value head, sequence) over all chunks of the sequence.
    TMA: the workspaces come as ragged descriptors (`_walk`); V_TMA: v too (`chunk._v_tiles`), else it is read
    by pointers (token stride s_vt, head stride s_vh).
    WARPS: the launch's num_warps (`counted_after` reads the counters a thread a group).
    SHORT > 0 (varlen): sequences of 1..SHORT tokens are the recurrent loop kernel's in this call
    (`kda.plan.Route`), and program i_n walks the i_n-th of the others (`kept_item`).
    IS_VARLEN: the programs of the grid's first sequence index (one per V block and head) also zero the rows past
    the last bound, [cu_seqlens[N], T) (`zero_trailing_rows`); the walk runs in every varlen call that has a
    sequence for it, so the loop kernel does this only where it runs alone.
    HAS_CHECKPOINTS: the prefix-cache checkpoints of the sequence (row i_n of `checkpoint_indices`, row stride
    s_ck, n_ck columns, one every ck_every tokens) stored into the pool `state_dst` of n_slots slots as
    the walk passes them (`_walk`).
    WAIT_CHUNKS > 0 (dense): the prepare runs beside this walk, counting each group of WAIT_CHUNKS chunks into
    `ready` (`[B, groups, HV]` int32), and each group is walked once counted: by an outer loop over the groups
    (`spin_zero`; a wait's group and the groups counted already after it, `counted_after`, walked in one
    pipelined loop, restarted only where the walk caught up with the prepare), or with WAIT_IN_LOOP (TMA walks)
    inside the walk's pipelined loop, a chunk's tiles and scales loaded once `ready_zero` has seen its group counted (the
    pipeliner prefetches behind the wait). SPIN: the waits in PTX (off under the interpreter).
    The grid is (V block, value head, sequence): a sequence's programs are dispatched together, sequence after
    sequence, so that a batch's long sequences do not wait behind the programs of every head's short ones.
    With SPIN each program first lets a prepare launched after it as a programmatic dependent start
    (`kda.replay`: a recorded call runs the walk and then the prepare on one stream); with DEPENDENTS it lets the
    routed short sequences' loop kernel launched after it start (`kda.ops.chunk`: it runs in the SMs the walk
    leaves).
    Every wait is bounded (`spin_zero`), so the walk finishes whatever the SMs: a program whose wait gave up
    stores no final state (a pool's slot keeps the initial state; by groups it stores nothing more), and its flag in
    `ready` after the counters is set (one int32 a program: cleared as it starts, set by any of its threads whose
    wait gives up, read after a barrier, so that the program decides once). `resume` set: the launch after
    the prepare, on the caller's stream (`kda.ops.chunk`), the same binary and grid: a program whose flag is clear
    ends at once, the others walk their columns again from the start (their waits find every group counted), so
    every output row and state column is the one walk's, bit for bit."""
    WAITS: tl.constexpr = WAIT_CHUNKS > 0
    tl.static_assert(not (WAITS and SHORT > 0), "a walk beside the prepare is dense")
    if DEPENDENTS:
        gdc_launch_dependents()
    bail_flag = ready  # a stand-in without waits
    if WAITS:  # this program's flag, after the [N, groups, HV] counters
        bail_flag = (ready + N * tl.cdiv(NT, WAIT_CHUNKS) * HV
                     + (tl.program_id(2) * HV + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0))
        if resume != 0:
            flagged = tl.load(bail_flag)
            tl.debug_barrier()  # read by every thread before it is cleared
            if flagged == 0:
                return
        tl.store(bail_flag, 0)  # set again by any thread whose wait gives up (`spin_zero`)
        tl.debug_barrier()
        if SPIN:
            gdc_launch_dependents()
    bail = tl.zeros([], dtype=tl.int32)
    i_hv = tl.program_id(1)
    i_n = tl.program_id(2)
    if IS_VARLEN:
        if i_n == 0:  # the rows past the last bound (padding for a CUDA graph): zeros, by programs dispatched first
            o_v = tl.program_id(0) * BV + tl.arange(0, BV)
            zero_trailing_rows(o + i_hv * s_oh, s_ot, cu_seqlens, N, T, o_v, o_v < V, BT, BV)
        i_n = tl.num_programs(2) - 1 - i_n  # the last sequence first: serving batches put decodes before prefills
    if SHORT > 0:
        i_n, _ = kept_item(cu_seqlens, i_n, N, SHORT, 0)
        if i_n < 0:  # fewer kept sequences than the host counted (bounds changed under a replayed graph)
            return
    bos, eos, o_k, k_ok, o_v, v_ok, plane_off, slot, S, code = _sequence_tile(
        i_n, tl.program_id(0), i_hv, cu_seqlens, state_src, slot_of_seq, has_initial_state, src_stride, n_slots,
        T, HV, K, V, BK, BV, IS_VARLEN, HAS_SRC, PAGED, HAS_INIT_FLAGS, V_FIRST)
    _report(errors, code, slot, i_n, bos, eos, checkpoint_indices + i_n.to(tl.int64) * s_ck, n_ck, ck_every,
            n_slots, (tl.program_id(0) == 0) & (i_hv == 0), HAS_CHECKPOINTS, HAS_ERRORS)
    kv_ok = k_ok[:, None] & v_ok[None, :]
    o_h = o + i_hv * s_oh
    if slot < 0:  # padding sequence: no state read or write, zero output rows
        zero_rows(o_h, s_ot, bos, eos, o_v, v_ok, BT, BV)
    else:
        p_first = chunk_program(i_n, bos, bos, NT, IS_VARLEN, BT)
        if V_TMA:
            v_h = v
        else:
            v_h = v + i_hv * s_vh
        ck_row = checkpoint_indices + i_n.to(tl.int64) * s_ck
        ready_h = ready
        if WAITS:  # the counter of this sequence's and head's first group
            ready_h = ready_counter(ready, i_n, bos, T, NT, i_hv, HV, BT, WAIT_CHUNKS)
        if WAITS and not WAIT_IN_LOOP:
            SPAN: tl.constexpr = WAIT_CHUNKS * BT
            g_lo = bos
            while g_lo < eos:
                # z (0) enters every address the group's walk loads from: the spin is a pure op to the compiler,
                # so only that dependence keeps those loads after it
                g_hi = tl.minimum(g_lo + SPAN, eos)
                z, _ = spin_zero(ready_h + ((g_lo - bos) // SPAN) * HV, tl.cdiv(g_hi - g_lo, BT).to(tl.int32),
                                 1 - bail, bail - bail, SPIN, bail_flag)  # bail is 0 here (a tensor: the mask)
                tl.debug_barrier()  # every thread's spin done: one decision for the program
                bail = tl.load(bail_flag, volatile=True)
                if bail == 0:  # this group and the counted ones after it in one pipelined loop
                    g_hi, z = counted_after(ready_h, g_hi, bos, eos, HV, BT, WAIT_CHUNKS, SPIN, z, 32 * WARPS)
                    S, _ = _walk(S, g_lo + z, g_hi, p_first + (g_lo - bos) // BT + z, i_hv,
                                 o_h, s_ot, n_ws, kd_ws, v_h, s_vt, qd_ws, m_ws, gt_ws, sc_ws, o_k, k_ok, o_v, v_ok, HV,
                                 K, V, BT, DOT_PREC, K == BK, V % BV == 0, ck_row, n_ck, ck_every, bos, state_dst,
                                 dst_stride, n_slots, HAS_CHECKPOINTS, V_FIRST, TMA, tl.program_id(0) * BV, V_TMA,
                                 x_ws=x_ws, FOLD=FOLD)
                g_lo = tl.where(bail == 0, g_hi, eos)  # given up: no group more
        else:
            S, bail = _walk(S, bos, eos, p_first, i_hv, o_h, s_ot, n_ws, kd_ws, v_h, s_vt, qd_ws, m_ws, gt_ws,
                            sc_ws, o_k, k_ok, o_v, v_ok, HV, K, V, BT, DOT_PREC, K == BK, V % BV == 0,
                            ck_row, n_ck, ck_every, bos, state_dst, dst_stride, n_slots, HAS_CHECKPOINTS, V_FIRST, TMA,
                            tl.program_id(0) * BV, V_TMA, ready_h, WAIT_CHUNKS, SPIN, x_ws, FOLD,
                            bail, bail_flag)
            if WAITS:  # a thread's give-up is the program's
                tl.debug_barrier()
                bail = tl.load(bail_flag, volatile=True)
        if HAS_DST:
            tl.store(state_dst + slot * dst_stride + plane_off, round_to(S, state_dst.dtype.element_ty),
                     mask=kv_ok & (o_k[:, None] * 0 + bail == 0))
