"""The state walk of `chunk_kda`: the sequential part of the chunked form, after the prepare kernels
(`kda.ops.chunk`) have written Qd, Kr, W, U0, A_qk and gt per chunk. Per chunk, K-first state S [K, V]:

    U = U0 - W S          O = Qd S + A_qk U          S <- gt * S + Kr^T U

Plain walk (`_chunk_state_kernel`): one program per (V block, sequence, value head) walks all chunks of
its sequence with S on chip: N * HV * V / BV programs and a serial depth of one step per chunk.

Segmented walk, for few long sequences (too few programs to fill the GPU): each chunk is affine in its
incoming state, S' = A_c S + b_c with A_c = diag(gt) - Kr^T W and b_c = Kr^T U0, and so is a segment of
G chunks, S' = A_seg S + b_seg (KERNEL_NOTES section 4). Three launches:
- `_segment_summary_kernel`, every segment in parallel: b_seg = the walk from S = 0 (columns of V),
  A_seg = the walk from S = I with U0 = 0 (columns of K);
- `_segment_scan_kernel`, per (V block, sequence, head): h_0 = initial state, h_{s+1} = A_seg h_s + b_seg,
  storing each segment's incoming state and, at the end, the final state;
- `_segment_output_kernel`, every segment in parallel: the walk from its incoming state, writing o.
Serial depth 2 G + segments instead of the number of chunks, for about three times the work.

Both read the initial state from, and write the final state to, the pools of `kda.ops.common.StatePlan`
(dense or paged, in place, rounded to nearest in the storage dtype); the recurrence is in fp32.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ..contract import KDACall, interpreting
from .common import StatePlan, locate_block, round_to, seq_bounds, slot_of, token_stride

SEGMENT_CHUNKS = 16  # G: chunks per segment of the segmented walk
# "auto" (segment when the plain walk has too few programs and long sequences), "always", "never"
SEGMENT_MODE = os.environ.get("KDA_SEGMENT", "auto")


@triton.jit
def _walk(S, t_begin, t_end, p_first, i_hv, o_h, s_ot, aqk_ws, w_ws, u_ws, qd_ws, kr_ws, gt_ws,
          o_k, k_ok, o_c, c_ok,
          HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
          HAS_U0: tl.constexpr, WRITE_O: tl.constexpr, DOT_PREC: tl.constexpr):
    """S [BK, BC] (columns o_c of the state, or of the identity for a segment operator) through the chunks
    starting at t_begin, t_begin + BT, ... below t_end; the j-th chunk's gt is at prepare program
    p_first + j. U = U0 - W S (no U0 without HAS_U0), O = Qd S + A_qk U (stored with WRITE_O),
    S <- gt * S + Kr^T U."""
    o_t = tl.arange(0, BT)
    for t0 in range(t_begin, t_end, BT):
        rows = t0 + o_t
        row_ok = rows < t_end
        m_k = row_ok[:, None] & k_ok[None, :]
        m_c = row_ok[:, None] & c_ok[None, :]
        ws_k = rows[:, None] * (HV * K) + i_hv * K + o_k[None, :]
        w = tl.load(w_ws + ws_k, mask=m_k, other=0.0).to(tl.float32)
        U = -tl.dot(w, S, input_precision=DOT_PREC)
        if HAS_U0:
            U += tl.load(u_ws + rows[:, None] * (HV * V) + i_hv * V + o_c[None, :], mask=m_c, other=0.0)
        if WRITE_O:
            qd = tl.load(qd_ws + ws_k, mask=m_k, other=0.0).to(tl.float32)
            aqk = tl.load(aqk_ws + rows[:, None] * (HV * BT) + i_hv * BT + o_t[None, :],
                          mask=row_ok[:, None] & (o_t[None, :] <= o_t[:, None]), other=0.0)
            out = tl.dot(qd, S, input_precision=DOT_PREC) + tl.dot(aqk, U, input_precision=DOT_PREC)
            tl.store(o_h + rows[:, None] * s_ot + o_c[None, :], round_to(out, o_h.dtype.element_ty), mask=m_c)
        kr = tl.load(kr_ws + ws_k, mask=m_k, other=0.0).to(tl.float32)
        gt = tl.load(gt_ws + ((p_first + (t0 - t_begin) // BT) * HV + i_hv) * K + o_k, mask=k_ok, other=0.0)
        S = S * gt[:, None] + tl.dot(tl.trans(kr), U, input_precision=DOT_PREC)
    return S


@triton.jit
def _first_chunk_program(i_n, bos, t, NT, IS_VARLEN: tl.constexpr, BT: tl.constexpr):
    """The prepare program (see `locate_block`) of the chunk of sequence i_n that starts at token t."""
    if IS_VARLEN:
        p = bos // BT + i_n
    else:
        p = i_n.to(tl.int64) * NT
    return p + (t - bos) // BT


@triton.jit
def _plane_offsets(i_hv, o_k, o_v, K: tl.constexpr, V: tl.constexpr, V_FIRST: tl.constexpr):
    """Offset of element (k, v) of value head i_hv inside one state plane, in the caller's layout."""
    if V_FIRST:
        return i_hv * (K * V) + o_v[None, :] * K + o_k[:, None]
    else:
        return i_hv * (K * V) + o_k[:, None] * V + o_v[None, :]


@triton.jit
def _sequence_tile(cu_seqlens, state_src, slot_of_seq, has_initial_state, src_stride, T,
                   HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   IS_VARLEN: tl.constexpr, HAS_SRC: tl.constexpr, PAGED: tl.constexpr,
                   HAS_INIT_FLAGS: tl.constexpr, V_FIRST: tl.constexpr):
    """For a program over (V block, sequence, value head): the sequence's token range, the tile's K and V
    indices and their masks, the plane offsets, the slot (< 0: padding) and the initial state tile in
    fp32 (zeros when there is no source, the flag is false, or the sequence is padding: then the slot is
    never read)."""
    i_v = tl.program_id(0)
    i_n = tl.program_id(1)
    i_hv = tl.program_id(2)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    k_ok = o_k < K
    v_ok = o_v < V
    plane_off = _plane_offsets(i_hv, o_k, o_v, K, V, V_FIRST)
    slot = slot_of(slot_of_seq, i_n, PAGED)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_SRC:
        read = slot >= 0
        if HAS_INIT_FLAGS:
            read = read & (tl.load(has_initial_state + i_n) != 0)
        if read:
            S = tl.load(state_src + slot * src_stride + plane_off, mask=k_ok[:, None] & v_ok[None, :],
                        other=0.0).to(tl.float32)
    return bos, eos, o_k, k_ok, o_v, v_ok, plane_off, slot, S


@triton.jit
def _zero_rows(o_h, s_ot, t_begin, t_end, o_v, v_ok, BT: tl.constexpr, BV: tl.constexpr):
    """Output rows [t_begin, t_end) of a padding sequence: zeros."""
    for t0 in range(t_begin, t_end, BT):
        rows = t0 + tl.arange(0, BT)
        m = (rows < t_end)[:, None] & v_ok[None, :]
        tl.store(o_h + rows[:, None] * s_ot + o_v[None, :], tl.zeros([BT, BV], dtype=o_h.dtype.element_ty), mask=m)


@triton.jit
def _chunk_state_kernel(
    o, cu_seqlens, aqk_ws, w_ws, u_ws, qd_ws, kr_ws, gt_ws,
    state_src, state_dst, slot_of_seq, has_initial_state,
    s_ot, s_oh, src_stride, dst_stride,
    T, NT,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_SRC: tl.constexpr, HAS_DST: tl.constexpr, PAGED: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
    V_FIRST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """The plain walk: one program per (V block, sequence, value head) over all chunks of the sequence."""
    i_n = tl.program_id(1)
    i_hv = tl.program_id(2)
    bos, eos, o_k, k_ok, o_v, v_ok, plane_off, slot, S = _sequence_tile(
        cu_seqlens, state_src, slot_of_seq, has_initial_state, src_stride, T, HV, K, V, BK, BV,
        IS_VARLEN, HAS_SRC, PAGED, HAS_INIT_FLAGS, V_FIRST)
    kv_ok = k_ok[:, None] & v_ok[None, :]
    o_h = o + i_hv * s_oh
    if slot < 0:  # padding sequence: no state read or write, zero output rows
        _zero_rows(o_h, s_ot, bos, eos, o_v, v_ok, BT, BV)
    else:
        p_first = _first_chunk_program(i_n, bos, bos, NT, IS_VARLEN, BT)
        S = _walk(S, bos, eos, p_first, i_hv, o_h, s_ot, aqk_ws, w_ws, u_ws, qd_ws, kr_ws, gt_ws,
                  o_k, k_ok, o_v, v_ok, HV, K, V, BT, True, True, DOT_PREC)
        if HAS_DST:
            tl.store(state_dst + slot * dst_stride + plane_off, round_to(S, state_dst.dtype.element_ty), mask=kv_ok)


@triton.jit
def _segment_summary_kernel(
    cu_seqlens, w_ws, u_ws, kr_ws, gt_ws, a_seg, b_seg,
    T, N, NT, NSEG,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program per (column block, segment, value head). Column blocks below cdiv(V, BV): b_seg, the
    walk from S = 0; the others: A_seg, the walk of the identity's columns with U0 = 0. Both [K, *] fp32."""
    i_c = tl.program_id(0)
    i_s = tl.program_id(1)
    i_hv = tl.program_id(2)
    i_n, bos, s0, eos = locate_block(i_s, cu_seqlens, N, T, NSEG, IS_VARLEN, BT * G)
    if s0 >= eos:
        return
    s_end = tl.minimum(s0 + BT * G, eos)
    p_first = _first_chunk_program(i_n, bos, s0, NT, IS_VARLEN, BT)
    o_k = tl.arange(0, BK)
    k_ok = o_k < K
    n_vb = tl.cdiv(V, BV)
    if i_c < n_vb:
        o_c = i_c * BV + tl.arange(0, BV)
        c_ok = o_c < V
        S = _walk(tl.zeros([BK, BV], dtype=tl.float32), s0, s_end, p_first, i_hv, w_ws, 0, w_ws, w_ws, u_ws,
                  w_ws, kr_ws, gt_ws, o_k, k_ok, o_c, c_ok, HV, K, V, BT, True, False, DOT_PREC)
        off = ((i_s * HV + i_hv) * K + o_k[:, None]).to(tl.int64) * V + o_c[None, :]
        tl.store(b_seg + off, S, mask=k_ok[:, None] & c_ok[None, :])
    else:
        o_c = (i_c - n_vb) * BV + tl.arange(0, BV)
        c_ok = o_c < K
        eye = tl.where(o_k[:, None] == o_c[None, :], 1.0, 0.0)
        S = _walk(eye, s0, s_end, p_first, i_hv, w_ws, 0, w_ws, w_ws, u_ws,
                  w_ws, kr_ws, gt_ws, o_k, k_ok, o_c, c_ok, HV, K, V, BT, False, False, DOT_PREC)
        off = ((i_s * HV + i_hv) * K + o_k[:, None]).to(tl.int64) * K + o_c[None, :]
        tl.store(a_seg + off, S, mask=k_ok[:, None] & c_ok[None, :])


@triton.jit
def _segment_scan_kernel(
    cu_seqlens, a_seg, b_seg, h_seg,
    state_src, state_dst, slot_of_seq, has_initial_state, src_stride, dst_stride,
    T, NSEG,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_SRC: tl.constexpr, HAS_DST: tl.constexpr, PAGED: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
    V_FIRST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program per (V block, sequence, value head): h_0 = the initial state, h_{s+1} = A_s h_s + b_s
    over the sequence's segments, each h_s stored for the output pass; the last one is the final state."""
    i_n = tl.program_id(1)
    i_hv = tl.program_id(2)
    bos, eos, o_k, k_ok, o_v, v_ok, plane_off, slot, S = _sequence_tile(
        cu_seqlens, state_src, slot_of_seq, has_initial_state, src_stride, T, HV, K, V, BK, BV,
        IS_VARLEN, HAS_SRC, PAGED, HAS_INIT_FLAGS, V_FIRST)
    kv_ok = k_ok[:, None] & v_ok[None, :]
    if slot >= 0:
        if IS_VARLEN:
            q0 = bos // (BT * G) + i_n
        else:
            q0 = i_n.to(tl.int64) * NSEG
        for s0 in range(bos, eos, BT * G):
            sp = q0 + (s0 - bos) // (BT * G)
            base = (sp * HV + i_hv) * K
            tl.store(h_seg + (base + o_k[:, None]) * V + o_v[None, :], S, mask=kv_ok)
            A = tl.load(a_seg + (base + o_k[:, None]) * K + o_k[None, :], mask=k_ok[:, None] & k_ok[None, :],
                        other=0.0)
            b = tl.load(b_seg + (base + o_k[:, None]) * V + o_v[None, :], mask=kv_ok, other=0.0)
            S = tl.dot(A, S, input_precision=DOT_PREC) + b
        if HAS_DST:
            tl.store(state_dst + slot * dst_stride + plane_off, round_to(S, state_dst.dtype.element_ty), mask=kv_ok)


@triton.jit
def _segment_output_kernel(
    o, cu_seqlens, aqk_ws, w_ws, u_ws, qd_ws, kr_ws, gt_ws, h_seg, slot_of_seq,
    s_ot, s_oh,
    T, N, NT, NSEG,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, PAGED: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program per (V block, segment, value head): the walk from the segment's incoming state,
    writing o (zeros for a padding sequence)."""
    i_v = tl.program_id(0)
    i_s = tl.program_id(1)
    i_hv = tl.program_id(2)
    i_n, bos, s0, eos = locate_block(i_s, cu_seqlens, N, T, NSEG, IS_VARLEN, BT * G)
    if s0 >= eos:
        return
    s_end = tl.minimum(s0 + BT * G, eos)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    k_ok = o_k < K
    v_ok = o_v < V
    o_h = o + i_hv * s_oh
    slot = slot_of(slot_of_seq, i_n, PAGED)
    if slot < 0:
        _zero_rows(o_h, s_ot, s0, s_end, o_v, v_ok, BT, BV)
    else:
        base = (i_s * HV + i_hv) * K
        S = tl.load(h_seg + (base + o_k[:, None]) * V + o_v[None, :], mask=k_ok[:, None] & v_ok[None, :], other=0.0)
        p_first = _first_chunk_program(i_n, bos, s0, NT, IS_VARLEN, BT)
        _walk(S, s0, s_end, p_first, i_hv, o_h, s_ot, aqk_ws, w_ws, u_ws, qd_ws, kr_ws, gt_ws,
              o_k, k_ok, o_v, v_ok, HV, K, V, BT, True, True, DOT_PREC)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def use_segments(call: KDACall, programs: int, BT: int) -> bool:
    """Segment the walk when the plain walk leaves most of the GPU idle (at most half as many programs as
    SMs, AIT's threshold) and the sequences are long (on average at least 4 segments), from shapes alone:
    no sync. Measured on the H200 (docs/perf_notes.md): 48 programs (1x16384 H=12) 1.02 ms segmented vs
    1.25 ms plain; at 128 programs (1x16384 H=32) the segmented walk took 2.54 ms, about twice what the
    plain walk's per-program time predicts (its summary and output passes each cost a whole walk), so the
    threshold moved from "fewer than the SMs" to half of them."""
    if SEGMENT_MODE != "auto":
        return SEGMENT_MODE == "always"
    if interpreting() or call.q.device.type != "cuda":
        return False
    avg_chunks = (call.B * call.T) / max(call.N, 1) / BT
    return 2 * programs <= _sm_count(call.q.device.index or 0) and avg_chunks >= 4 * SEGMENT_CHUNKS


# The plain walk's launch: BV None is the rule below (32, or 16 for V <= 16). scripts/profile_chunk.py
# sweeps it. H200 (benchmarks/results/2026-11-29-h200-session4.md), BV 32 at 8 / 4 warps: 1230 / 1159 us
# at 1x16384 H=32, 1234 / 810 at 4x4096 H=32, 1901 / 1435 at 1x8192 H=96, 1229 / 1080 at 1x16384 H=12,
# 4909 / 4327 at 1x65536 H=12; BV 16 at 8 / 4 warps: 2241 / 1436 at 1x16384 H=32.
_WALK_LAUNCH = {"BV": None, "num_warps": 4}


def state_walk(call: KDACall, st: StatePlan, o: torch.Tensor, ws: dict, BT: int, NT: int, prec: str,
               stages: int) -> None:
    """Launch the plain or the segmented walk (module docstring) for a call whose prepare stage ran."""
    B, T, HV, K, V, N = call.B, call.T, call.HV, call.K, call.V, call.N
    varlen = call.cu_seqlens is not None
    cu = call.cu_seqlens if varlen else o
    BK = max(16, triton.next_power_of_2(K))
    BV = _WALK_LAUNCH["BV"] or (32 if V > 16 else 16)
    dummy = ws["gt"]
    pools = (st.src if st.src is not None else dummy, st.dst if st.dst is not None else dummy,
             st.slot_of_seq if st.slot_of_seq is not None else dummy,
             st.has_initial_state if st.has_initial_state is not None else dummy)
    flags = dict(HAS_SRC=st.src is not None, HAS_DST=st.dst is not None, PAGED=call.state_mode == "paged",
                 HAS_INIT_FLAGS=st.has_initial_state is not None, V_FIRST=call.state_v_first)
    walk_ws = (ws["aqk"], ws["w"], ws["u"], ws["qd"], ws["kr"], ws["gt"])
    n_vb = triton.cdiv(V, BV)
    if not use_segments(call, N * HV * n_vb, BT):
        _chunk_state_kernel[(n_vb, N, HV)](
            o, cu, *walk_ws, *pools,
            token_stride(o, T), o.stride(2), st.src_stride, st.dst_stride, T, NT,
            HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, IS_VARLEN=varlen, DOT_PREC=prec, **flags,
            num_warps=_WALK_LAUNCH["num_warps"], num_stages=stages,
        )
        return
    G = SEGMENT_CHUNKS
    NSEG = triton.cdiv(T, BT * G)
    n_seg = (T // (BT * G) + N) if varlen else B * NSEG
    if n_seg == 0:
        return
    dev = o.device
    a_seg = torch.empty((n_seg, HV, K, K), dtype=torch.float32, device=dev)
    b_seg = torch.empty((n_seg, HV, K, V), dtype=torch.float32, device=dev)
    h_seg = torch.empty((n_seg, HV, K, V), dtype=torch.float32, device=dev)
    shape = dict(HV=HV, K=K, V=V, BT=BT, G=G, BK=BK, BV=BV, IS_VARLEN=varlen, DOT_PREC=prec)
    _segment_summary_kernel[(n_vb + triton.cdiv(K, BV), n_seg, HV)](
        cu, ws["w"], ws["u"], ws["kr"], ws["gt"], a_seg, b_seg, T, N, NT, NSEG, **shape,
        num_warps=8, num_stages=stages,
    )
    _segment_scan_kernel[(n_vb, N, HV)](
        cu, a_seg, b_seg, h_seg, *pools, st.src_stride, st.dst_stride, T, NSEG, **shape, **flags,
        num_warps=8, num_stages=1,
    )
    _segment_output_kernel[(n_vb, n_seg, HV)](
        o, cu, *walk_ws, h_seg, pools[2], token_stride(o, T), o.stride(2), T, N, NT, NSEG,
        PAGED=call.state_mode == "paged", **shape, num_warps=8, num_stages=stages,
    )
