"""`chunk_kda`: the chunked (WY/UT) prefill kernels. They must equal `kda_reference.chunk_kda` (and so
`kda_reference.recurrent_kda`).

Per value head, per chunk of BT tokens with b = cumsum of the log2 decay inside the chunk (b <= 0,
non-increasing per channel), K-first state S [K, V]:

    A_kk[i, j] = beta_i * sum_c k_ic k_jc 2^(b_ic - b_jc)    j < i     (strictly lower)
    A_qk[i, j] = scale  * sum_c q_ic k_jc 2^(b_ic - b_jc)    j <= i
    X  = (I + A_kk)^-1                                       forward substitution, fp32
    W  = X diag(beta) (2^b * K)        U0 = X diag(beta) V
    U  = U0 - W S                      O  = (scale 2^b * Q) S + A_qk U
    S <- 2^b_last * S + (2^(b_last - b) * K)^T U

The cumulative log2 decay b is summed in float64: kernels only ever use differences b_i - b_j of nearby
tokens, and after a step of -1000 both terms are about -1443 where fp32 keeps 1e-4 absolute, a 1e-4
relative error in every later decay factor. In float64 the difference is exact to fp32; every
exponential is still taken in fp32. Every exponent evaluated is <= 0: blocks below the diagonal are
anchored on the first row of the row block (both factors <= 1), diagonal 16 x 16 blocks take
2^(b_i - b_j) pairwise for i >= j. So a per-token log-decay of -1000 gives exact zeros, never inf * 0.

The prepare stage (all chunks in parallel; workspaces in token space): `_chunk_intra_kernel`, one program
per (chunk, 16-row block, value head): gate, fp64 cumsum in registers, the block's strip of A_kk and
A_qk, its rows of Kd, Qd, Kr (and gt); then `_chunk_solve_kernel`, one program per (chunk, value head):
the inverse (diagonal blocks all at once, then block rows) in place of A_kk, W and U0. (A single fused
prepare kernel with an fp64 scratch of 1 KB per token and head was 7-17% faster on the H200 and was
removed for that scratch: docs/perf_notes.md.) With a bounded gate (`bounded_gate`: Kimi's in-kernel
lower-bound gate with |lb| <= 5.17 and in-kernel q/k l2norm) `_chunk_intra_bounded_kernel` replaces
`_chunk_intra_kernel`: one program per (chunk, value head), the diagonal blocks anchored too (factors
<= 2^112), every product a tensor-core dot; 2.2x faster on the H200 (6.09 -> 2.77 ms at 1x16384 H = 32).
Then the state walk (`kda.ops.chunk_state`): the sequential part, plain (one program per V block,
sequence and value head) or, for few long sequences, segmented (affine segment summaries, a scan, the
outputs); it reads the initial state (dense, paged or none) and writes o and the final state (dense or
paged, in place) in the storage dtype; the recurrence accumulates in fp32.

Chunks map to sequences on the device (`kda.ops.common.locate_block`): no host copy of the bounds is
needed.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..contract import KDACall
from .chunk_state import state_walk
from .common import (
    LOG2E,
    decay_rate,
    dot_precision,
    dt_bias_slice,
    gate_params,
    kda_gate_log2,
    locate_block,
    output_buffer,
    plan_state,
    pow2_at_least,
    token_stride,
)

CHUNK = 64  # BT: tokens per chunk
SUB = 16  # BC: tokens per sub-block of the intra-chunk matrices


@triton.jit
def _qk_inv_norm(x_ptr, rows, row_mask, stride_t, K: tl.constexpr, BK: tl.constexpr, USE_L2NORM: tl.constexpr):
    """1 / sqrt(sum x^2 + 1e-6) per row (l2norm), or ones."""
    if USE_L2NORM:
        ssq = tl.zeros([rows.shape[0]], dtype=tl.float32)
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            m = row_mask[:, None] & (cols < K)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_t + cols[None, :], mask=m, other=0.0).to(tl.float32)
            ssq += tl.sum(x * x, 1)
        return 1.0 / tl.sqrt(ssq + 1e-6)
    else:
        return tl.full([rows.shape[0]], 1.0, dtype=tl.float32)


@triton.jit
def _load_beta(beta, rows, row_ok, s_bt, s_bh, i_hv, USE_BETA_SIGMOID: tl.constexpr):
    """beta of `rows` for value head i_hv in fp32 (sigmoid applied in the kernel if asked), 0 past the
    sequence."""
    b = tl.load(beta + rows * s_bt + i_hv * s_bh, mask=row_ok, other=0.0).to(tl.float32)
    if USE_BETA_SIGMOID:
        b = tl.sigmoid(b)
    return tl.where(row_ok, b, 0.0)


@triton.jit
def _gate_tile(g_h, rows, cols, m, s_gt, a, bias, lower_bound, USE_GATE: tl.constexpr,
               USE_LOWER_BOUND: tl.constexpr):
    """The log2 decay of the [rows, cols] tile in fp64 (the cumsums are taken in fp64), 0 outside `m`."""
    gl = kda_gate_log2(tl.load(g_h + rows[:, None] * s_gt + cols[None, :], mask=m, other=0.0),
                       a, bias, lower_bound, USE_GATE, USE_LOWER_BOUND)
    return tl.where(m, gl, 0.0).to(tl.float64)


@triton.jit
def _store_decayed(kd_ws, qd_ws, kr_ws, ws, cols, m, kx, qx, rk, rq, scale, b, b_last):
    """What the solve and the state walk read, for the rows of `b` (log2 decay from the chunk start):
    Kd = 2^b k~, Qd = scale 2^b q~, Kr = 2^(b_last - b) k~, with k~ = rk k and q~ = rq q (l2norm), at row
    offsets `ws` and channels `cols`."""
    d = tl.exp2(b.to(tl.float32))
    kn = kx * rk[:, None]
    tl.store(kd_ws + ws + cols[None, :], kn * d, mask=m)
    tl.store(qd_ws + ws + cols[None, :], qx * (rq * scale)[:, None] * d, mask=m)
    tl.store(kr_ws + ws + cols[None, :], kn * tl.exp2((b_last[None, :] - b).to(tl.float32)), mask=m)


@triton.jit
def _chunk_intra_kernel(
    q, k, g, beta, A_log, dt_bias, cu_seqlens,
    akk_ws, aqk_ws, kd_ws, qd_ws, kr_ws, gt_ws,
    s_qt, s_qh, s_kt, s_kh, s_gt, s_gh, s_bt, s_bh,
    T, N, NT, scale, lower_bound,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, USE_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Split prepare, part 1: one program per (chunk, row block r of BC rows, value head). Walks K in
    BK-wide slices; per slice it recomputes the gate of the whole chunk and its fp64 cumsum in registers
    (no scratch), then adds to row block r's strip of A_kk / A_qk: columns of earlier blocks through one
    dot anchored on the first row of block r, the diagonal block pairwise. Also writes block r's rows of
    Kd = 2^b k, Qd = scale 2^b q, Kr = 2^(b_last - b) k (l2-normalised) and, for r = 0, gt = 2^b_last.
    This is the path of any gate; a bounded one takes `_chunk_intra_bounded_kernel`."""
    i_p = tl.program_id(0)
    i_r = tl.program_id(1)
    i_hv = tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n, _, t0, eos = locate_block(i_p, cu_seqlens, N, T, NT, IS_VARLEN, BT)
    if t0 >= eos:
        return
    n_rows = tl.minimum(eos - t0, BT)
    r0 = i_r * BC
    if r0 >= n_rows:
        return
    o_t = tl.arange(0, BT)
    row_ok = o_t < n_rows
    before = o_t < r0  # rows of the earlier blocks (all valid)
    rows = t0 + o_t
    o_c = tl.arange(0, BC)
    ok_r = (r0 + o_c) < n_rows
    rows_r = t0 + r0 + o_c
    q_h = q + i_h * s_qh
    k_h = k + i_h * s_kh
    g_h = g + i_hv * s_gh

    rk_all = _qk_inv_norm(k_h, rows, row_ok, s_kt, K, BK, USE_L2NORM)
    rq_r = _qk_inv_norm(q_h, rows_r, ok_r, s_qt, K, BK, USE_L2NORM)
    rk_r = _qk_inv_norm(k_h, rows_r, ok_r, s_kt, K, BK, USE_L2NORM)
    beta_r = _load_beta(beta, rows_r, ok_r, s_bt, s_bh, i_hv, USE_BETA_SIGMOID)
    a = decay_rate(A_log, i_hv, HAS_A_LOG)

    lower = ((o_c[:, None] >= o_c[None, :]) & ok_r[:, None] & ok_r[None, :])[:, :, None]
    acc_off_kk = tl.zeros([BC, BT], dtype=tl.float32)
    acc_off_qk = tl.zeros([BC, BT], dtype=tl.float32)
    acc_dg_kk = tl.zeros([BC, BC], dtype=tl.float32)
    acc_dg_qk = tl.zeros([BC, BC], dtype=tl.float32)
    ws_r = rows_r[:, None] * (HV * K) + i_hv * K
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        col_ok = cols < K
        m_all = row_ok[:, None] & col_ok[None, :]
        m_r = ok_r[:, None] & col_ok[None, :]
        bias = dt_bias_slice(dt_bias, i_hv, cols, K, HAS_DT_BIAS)
        # the cumulative log2 decay of every row of the chunk, and of block r, in fp64
        g_all = _gate_tile(g_h, rows, cols, m_all, s_gt, a, bias, lower_bound, USE_GATE, USE_LOWER_BOUND)
        b_all = tl.cumsum(g_all, axis=0)
        b_last = tl.sum(g_all, 0)
        prefix = tl.sum(tl.where(before[:, None], g_all, 0.0), 0)
        g_r = _gate_tile(g_h, rows_r, cols, m_r, s_gt, a, bias, lower_bound, USE_GATE, USE_LOWER_BOUND)
        b_r = prefix[None, :] + tl.cumsum(g_r, axis=0)
        anchor = prefix + tl.sum(tl.where(o_c[:, None] == 0, g_r, 0.0), 0)
        q_r = tl.load(q_h + rows_r[:, None] * s_qt + cols[None, :], mask=m_r, other=0.0).to(tl.float32)
        k_r = tl.load(k_h + rows_r[:, None] * s_kt + cols[None, :], mask=m_r, other=0.0).to(tl.float32)
        # earlier blocks: 2^(b_i - b_j) = 2^(b_i - anchor) 2^(anchor - b_j), both factors <= 1
        m_before = before[:, None] & col_ok[None, :]
        k_all = tl.load(k_h + rows[:, None] * s_kt + cols[None, :], mask=m_before, other=0.0).to(tl.float32)
        ke_all = k_all * tl.exp2(tl.where(m_before, anchor[None, :] - b_all, 0.0).to(tl.float32))
        e_r = tl.exp2(tl.where(m_r, b_r - anchor[None, :], 0.0).to(tl.float32))
        ke_t = tl.trans(ke_all)
        acc_off_kk += tl.dot(k_r * e_r, ke_t, input_precision=DOT_PREC)
        acc_off_qk += tl.dot(q_r * e_r, ke_t, input_precision=DOT_PREC)
        # the diagonal block: 2^(b_i - b_j) for i >= j, pairwise
        e = tl.exp2(tl.where(lower, b_r[:, None, :] - b_r[None, :, :], float("-inf")).to(tl.float32))
        ke = k_r[None, :, :] * e
        acc_dg_kk += tl.sum(k_r[:, None, :] * ke, 2)
        acc_dg_qk += tl.sum(q_r[:, None, :] * ke, 2)
        _store_decayed(kd_ws, qd_ws, kr_ws, ws_r, cols, m_r, k_r, q_r, rk_r, rq_r, scale, b_r, b_last)
        if i_r == 0:
            tl.store(gt_ws + (i_p * HV + i_hv) * K + cols, tl.exp2(b_last.to(tl.float32)), mask=col_ok)

    a_off = rows_r[:, None] * (HV * BT) + i_hv * BT
    kk = acc_off_kk * (rk_r * beta_r)[:, None] * rk_all[None, :]
    qk = acc_off_qk * (rq_r * scale)[:, None] * rk_all[None, :]
    m_off = ok_r[:, None] & before[None, :]
    tl.store(akk_ws + a_off + o_t[None, :], kk, mask=m_off)
    tl.store(aqk_ws + a_off + o_t[None, :], qk, mask=m_off)
    kk = tl.where(o_c[:, None] > o_c[None, :], acc_dg_kk, 0.0) * (rk_r * beta_r)[:, None] * rk_r[None, :]
    qk = tl.where(o_c[:, None] >= o_c[None, :], acc_dg_qk, 0.0) * (rq_r * scale)[:, None] * rk_r[None, :]
    m_dg = ok_r[:, None] & ok_r[None, :]
    tl.store(akk_ws + a_off + r0 + o_c[None, :], kk, mask=m_dg)
    tl.store(aqk_ws + a_off + r0 + o_c[None, :], qk, mask=m_dg)


@triton.jit
def _chunk_intra_bounded_kernel(
    q, k, g, beta, A_log, dt_bias, cu_seqlens,
    akk_ws, aqk_ws, kd_ws, qd_ws, kr_ws, gt_ws,
    s_qt, s_qh, s_kt, s_kh, s_gt, s_gh, s_bt, s_bh,
    T, N, NT, scale, lower_bound,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr, DOT_PREC: tl.constexpr, A_PREC: tl.constexpr,
    ROW_BATCHED: tl.constexpr = False,
):
    """The intra stage for a bounded gate (`bounded_gate`: in-kernel lower-bound gate, q/k l2norm in the
    kernel), one program per (chunk, value head) instead of one per (chunk, 16-row block, value head):
    the gate, its fp64 cumsum and the q/k loads are done once per K slice for all BT rows, not once per
    row block. Per K slice, with the anchor a_r = b of row block r's first row, X's rows scaled by
    2^(b - a_r) (<= 1) and K's columns by 2^(a_r - b):
    - the diagonal 16 x 16 blocks of A_kk and A_qk come from one batched dot [NB, BC, BK] x [NB, BK, BC]
      (column factors <= 2^112 inside block r: the gate's bound), so they go through the tensor cores too;
    - the earlier blocks' columns (factors <= 1) from a dot of row block r = 1 .. NB - 1 against the
      columns before it (the other row blocks' rows zeroed in the left operand; row block 0 has none).
    Writes what `_chunk_intra_kernel` writes: A_kk (strictly lower) and A_qk (lower) with zeros above, Kd,
    Qd, Kr, gt. Precision: A_qk's diagonal blocks at A_PREC, "tf32x3" where DOT_PREC is "tf32"
    (`intra_dot_precision`), everything else at DOT_PREC. This is the pairwise kernel's split (its
    diagonal blocks are fp32): under a strong decay the diagonal blocks hold most of A_qk's weight, and
    plain tf32 there raised the bf16-input output error from 2.00e-3 to 2.43e-3 on the H200 (full
    accuracy preset at c42b4d6, T = 1024, strong regime; bf16 floor 1.66e-3). A_kk's diagonal stays at
    DOT_PREC: the final-state error did not move with it (8.16e-4 both ways).
    Measured on the H200 at 1x16384 H=32 (scripts/profile_chunk.py, benchmarks/results/
    2026-11-29-h200-session4.md): 2.96 ms, against 3.71 ms when every row block's dot also covered its
    diagonal block (A_qk's all in tf32x3) and 3.34 ms at a 16-wide K slice.
    ROW_BATCHED (behind KDA_DEV_INTRA_FORM=rowbatched until timed): one batched dot per matrix and K slice,
    [NB, BC, BK] x [NB, BK, BT]: row block r against every column up to its last row, all anchored at a_r
    (column factors <= 1 before block r, <= 2^112 inside it). No zeroed rows: 3x fewer multiply-adds
    than the per-row-block dots over the earlier blocks, and A_qk entirely at A_PREC (as at 9c15198,
    output error 2.00e-3) for fewer passes than today's split; the price is an [NB, BT, BK] fp64
    exponent tile."""
    i_p = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, _, t0, eos = locate_block(i_p, cu_seqlens, N, T, NT, IS_VARLEN, BT)
    if t0 >= eos:
        return
    n_rows = tl.minimum(eos - t0, BT)
    o_t = tl.arange(0, BT)
    row_ok = o_t < n_rows
    rows = t0 + o_t
    blk = o_t // BC  # row block of each row
    q_h = q + i_h * s_qh
    k_h = k + i_h * s_kh
    g_h = g + i_hv * s_gh

    rk = _qk_inv_norm(k_h, rows, row_ok, s_kt, K, BK, True)
    rq = _qk_inv_norm(q_h, rows, row_ok, s_qt, K, BK, True)
    b_beta = _load_beta(beta, rows, row_ok, s_bt, s_bh, i_hv, USE_BETA_SIGMOID)
    a = decay_rate(A_log, i_hv, HAS_A_LOG)

    NB: tl.constexpr = BT // BC
    acc_kk = tl.zeros([BT, BT], dtype=tl.float32)
    acc_qk = tl.zeros([BT, BT], dtype=tl.float32)
    dg_kk = tl.zeros([NB, BC, BC], dtype=tl.float32)
    dg_qk = tl.zeros([NB, BC, BC], dtype=tl.float32)
    rb_kk = tl.zeros([NB, BC, BT], dtype=tl.float32)  # ROW_BATCHED's accumulators
    rb_qk = tl.zeros([NB, BC, BT], dtype=tl.float32)
    ws = rows[:, None] * (HV * K) + i_hv * K
    o_blk = tl.arange(0, BT // BC)
    first = (o_t % BC) == 0
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        col_ok = cols < K
        m = row_ok[:, None] & col_ok[None, :]
        bias = dt_bias_slice(dt_bias, i_hv, cols, K, HAS_DT_BIAS)
        gl = _gate_tile(g_h, rows, cols, m, s_gt, a, bias, lower_bound, True, True)
        b = tl.cumsum(gl, axis=0)  # log2 decay from the chunk start, fp64 (differences stay exact to fp32)
        b_last = tl.sum(gl, 0)
        # anchors: b at the first row of every row block, [BT // BC, BK], and per row
        b3 = tl.reshape(b, [BT // BC, BC, BK])
        anchors = tl.sum(tl.where(tl.reshape(first, [BT // BC, BC])[:, :, None], b3, 0.0), 1)
        row_anchor = tl.reshape(tl.broadcast_to(anchors[:, None, :], [BT // BC, BC, BK]), [BT, BK])
        kx = tl.load(k_h + rows[:, None] * s_kt + cols[None, :], mask=m, other=0.0).to(tl.float32)
        qx = tl.load(q_h + rows[:, None] * s_qt + cols[None, :], mask=m, other=0.0).to(tl.float32)
        e_row = tl.exp2((b - row_anchor).to(tl.float32))  # <= 1
        ke_row = kx * e_row
        qe_row = qx * e_row
        if ROW_BATCHED:
            # row block r (dim 0) against the columns j up to its last row (dim 1), anchored at a_r
            # (built one row block at a time: an [NB, BT, BK] fp64 exponent tile spilled 1.3 KB)
            kc3 = tl.zeros([NB, BT, BK], dtype=tl.float32)
            for r in tl.static_range(NB):
                a_r = tl.sum(tl.where(o_blk[:, None] == r, anchors, 0.0), 0)  # [BK]
                mc = ((o_t < (r + 1) * BC) & row_ok)[:, None] & col_ok[None, :]
                kc_r = tl.where(mc, kx * tl.exp2(tl.where(mc, a_r[None, :] - b, 0.0).to(tl.float32)), 0.0)
                kc3 = tl.where((o_blk == r)[:, None, None], kc_r[None, :, :], kc3)
            kc3 = tl.permute(kc3, (0, 2, 1))  # [NB, BK, BT]
            rb_kk += tl.dot(tl.reshape(ke_row, [NB, BC, BK]), kc3, input_precision=DOT_PREC)
            rb_qk += tl.dot(tl.reshape(qe_row, [NB, BC, BK]), kc3, input_precision=A_PREC)
        else:
            # the diagonal blocks, all at once: column factors 2^(a_r - b_j) inside block r (<= 2^112)
            kd3 = tl.reshape(kx, [NB, BC, BK]) * tl.exp2((anchors[:, None, :] - b3).to(tl.float32))
            kd3 = tl.permute(kd3, (0, 2, 1))
            dg_kk += tl.dot(tl.reshape(ke_row, [NB, BC, BK]), kd3, input_precision=DOT_PREC)
            dg_qk += tl.dot(tl.reshape(qe_row, [NB, BC, BK]), kd3, input_precision=A_PREC)
            for r in tl.static_range(1, NB):
                # row block r against the columns of the earlier blocks (factors <= 1)
                a_r = tl.sum(tl.where(o_blk[:, None] == r, anchors, 0.0), 0)  # [BK]
                mc = ((o_t < r * BC) & row_ok)[:, None] & col_ok[None, :]
                kc = kx * tl.exp2(tl.where(mc, a_r[None, :] - b, 0.0).to(tl.float32))
                kc = tl.trans(tl.where(mc, kc, 0.0))
                in_r = (blk == r)[:, None]
                acc_kk += tl.dot(tl.where(in_r, ke_row, 0.0), kc, input_precision=DOT_PREC)
                acc_qk += tl.dot(tl.where(in_r, qe_row, 0.0), kc, input_precision=DOT_PREC)
        _store_decayed(kd_ws, qd_ws, kr_ws, ws, cols, m, kx, qx, rk, rq, scale, b, b_last)
        tl.store(gt_ws + (i_p * HV + i_hv) * K + cols, tl.exp2(b_last.to(tl.float32)), mask=col_ok)

    a_off = rows[:, None] * (HV * BT) + i_hv * BT + o_t[None, :]
    m_a = row_ok[:, None] & row_ok[None, :]
    if ROW_BATCHED:
        kk = tl.reshape(rb_kk, [BT, BT]) * (rk * b_beta)[:, None] * rk[None, :]
        qk = tl.reshape(rb_qk, [BT, BT]) * (rq * scale)[:, None] * rk[None, :]
        tl.store(akk_ws + a_off, tl.where(o_t[None, :] < o_t[:, None], kk, 0.0), mask=m_a)
        tl.store(aqk_ws + a_off, tl.where(o_t[None, :] <= o_t[:, None], qk, 0.0), mask=m_a)
    else:
        kk = acc_kk * (rk * b_beta)[:, None] * rk[None, :]
        qk = acc_qk * (rq * scale)[:, None] * rk[None, :]
        # acc_* hold the earlier blocks' columns only: write every column outside the diagonal blocks
        # from them (zeros to the right), then the diagonal blocks from dg_* (the two sets are disjoint)
        col_blk = o_t[None, :] // BC
        m_off = m_a & (col_blk != blk[:, None])
        tl.store(akk_ws + a_off, tl.where(col_blk < blk[:, None], kk, 0.0), mask=m_off)
        tl.store(aqk_ws + a_off, tl.where(col_blk < blk[:, None], qk, 0.0), mask=m_off)
        o_c = tl.arange(0, BC)
        loc_i = o_blk[:, None, None] * BC + o_c[None, :, None]  # [NB, BC, 1]: row inside the chunk
        loc_j = o_blk[:, None, None] * BC + o_c[None, None, :]  # [NB, 1, BC]: column inside the chunk
        m_dg = (loc_i < n_rows) & (loc_j < n_rows)
        rk3 = tl.reshape(rk, [NB, BC])
        kk3 = dg_kk * tl.reshape(rk * b_beta, [NB, BC])[:, :, None] * rk3[:, None, :]
        qk3 = dg_qk * tl.reshape(rq * scale, [NB, BC])[:, :, None] * rk3[:, None, :]
        d_off = (t0 + loc_i) * (HV * BT) + i_hv * BT + loc_j
        tl.store(akk_ws + d_off, tl.where(loc_j < loc_i, kk3, 0.0), mask=m_dg)
        tl.store(aqk_ws + d_off, tl.where(loc_j <= loc_i, qk3, 0.0), mask=m_dg)


@triton.jit
def _chunk_solve_kernel(
    v, beta, cu_seqlens, akk_ws, kd_ws, w_ws, u_ws,
    s_vt, s_vh, s_bt, s_bh,
    T, N, NT,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, DOT_PREC: tl.constexpr,
    INV_PREC: tl.constexpr = "ieee",
):
    """Split prepare, part 2: one program per (chunk, value head). X = (I + A_kk)^-1, written over A_kk:
    the NC diagonal BC x BC blocks by forward substitution, all blocks at once in an [NC, BC, BC] tile
    (X_i = e_i - sum_{j<i} L_ij X_j), then block row by block row X[r, :r] = -X_rr (L[r, :r] X[:r, :r])
    (block forward substitution; the rows above r are final by then). fp32 throughout ("ieee" dots).
    Then W = X diag(beta) Kd, U0 = X diag(beta) V."""
    i_p = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_n, _, t0, eos = locate_block(i_p, cu_seqlens, N, T, NT, IS_VARLEN, BT)
    if t0 >= eos:
        return
    n_rows = tl.minimum(eos - t0, BT)
    o_t = tl.arange(0, BT)
    row_ok = o_t < n_rows
    rows = t0 + o_t
    a_h = akk_ws + i_hv * BT
    b_beta = _load_beta(beta, rows, row_ok, s_bt, s_bh, i_hv, USE_BETA_SIGMOID)

    NC: tl.constexpr = BT // BC
    o_b = tl.arange(0, NC)[:, None, None]
    o_i = tl.arange(0, BC)[None, :, None]
    o_j = tl.arange(0, BC)[None, None, :]
    addr3 = (t0 + o_b * BC + o_i) * (HV * BT) + o_b * BC + o_j
    ok3 = ((o_b * BC + o_i) < n_rows) & ((o_b * BC + o_j) < n_rows)
    L3 = tl.load(a_h + addr3, mask=ok3 & (o_j < o_i), other=0.0)
    eye3 = tl.where(o_i == o_j, 1.0, 0.0) + tl.zeros([NC, BC, BC], dtype=tl.float32)
    X3 = eye3
    for i in tl.static_range(1, BC):
        l_i = tl.sum(tl.where(o_i == i, L3, 0.0), 1)  # [NC, BC]: row i of every block
        x_i = tl.sum(l_i[:, :, None] * X3, 1)
        X3 = tl.where(o_i == i, eye3 - x_i[:, None, :], X3)
    tl.debug_barrier()  # every thread has read its part of A_kk before the diagonal blocks are overwritten
    tl.store(a_h + addr3, X3, mask=ok3)
    tl.debug_barrier()
    # block rows r = 1..: X[r, :r] = -X_rr (L[r, :r] X[:r, :r]); rows above r are final, in place of A_kk
    o_c = tl.arange(0, BC)
    for r in tl.static_range(1, NC):
        if r * BC < n_rows:
            ok_r = (r * BC + o_c) < n_rows
            row_off = (t0 + r * BC + o_c)[:, None] * (HV * BT)
            left = o_t[None, :] < r * BC
            L_r = tl.load(a_h + row_off + o_t[None, :], mask=ok_r[:, None] & left, other=0.0)
            X_up = tl.load(a_h + rows[:, None] * (HV * BT) + o_t[None, :],
                           mask=(o_t[:, None] < r * BC) & (o_t[None, :] <= o_t[:, None]), other=0.0)
            X_rr = tl.load(a_h + row_off + r * BC + o_c[None, :],
                           mask=ok_r[:, None] & (o_c[None, :] <= o_c[:, None]), other=0.0)
            X_r = -tl.dot(X_rr, tl.dot(L_r, X_up, input_precision=INV_PREC), input_precision=INV_PREC)
            tl.debug_barrier()  # L_r read by every thread before it is overwritten
            tl.store(a_h + row_off + o_t[None, :], X_r, mask=ok_r[:, None] & left)
            tl.debug_barrier()
    X = tl.load(a_h + rows[:, None] * (HV * BT) + o_t[None, :],
                mask=row_ok[:, None] & (o_t[None, :] <= o_t[:, None]), other=0.0)

    Xb = X * b_beta[None, :]
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        m = row_ok[:, None] & (cols < K)[None, :]
        off = rows[:, None] * (HV * K) + i_hv * K + cols[None, :]
        kd = tl.load(kd_ws + off, mask=m, other=0.0).to(tl.float32)
        tl.store(w_ws + off, tl.dot(Xb, kd, input_precision=DOT_PREC), mask=m)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        m = row_ok[:, None] & (cols < V)[None, :]
        v_c = tl.load(v + rows[:, None] * s_vt + i_hv * s_vh + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(u_ws + rows[:, None] * (HV * V) + i_hv * V + cols[None, :],
                 tl.dot(Xb, v_c, input_precision=DOT_PREC), mask=m)


# The bounded intra kernel's K slice. Spill stores on sm_90 under Triton 3.6 (8 warps, fp16 workspaces, 255
# registers; scripts/kernel_regs.py): 732 B at 32, 80 B at 16; yet 16 was slower on the H200 (3.34 against
# 2.96 ms at 1x16384 H=32, benchmarks/results/2026-11-29-h200-session4.md).
_BOUNDED_BK = 32
# Development switch until timed on a GPU: KDA_DEV_INTRA_FORM=rowbatched runs the bounded intra kernel's
# ROW_BATCHED form (its docstring).
_ROW_BATCHED = os.environ.get("KDA_DEV_INTRA_FORM", "") == "rowbatched"
# Its launch: one program per SM (255 registers x 8 warps), so the K-slice loop's loads are exposed unless
# pipelined. H200 (scripts/profile_chunk.py, benchmarks/results/2026-11-29-h200-session4.md), num_stages
# 1 / 2 / 3: 2959 / 2910 / 2813 us at 1x16384 H=32, 4459 / 4348 / 4215 us at 1x8192 H=96.
_BOUNDED_LAUNCH = {"num_warps": 8, "num_stages": 3}
# The solve's launch (scripts/profile_chunk.py sweeps it; 0.91 ms at 1x16384 H=32 on the H200, 255 registers
# and 132 B spilled under Triton 3.6 at 4 warps; other launches untimed).
_SOLVE_LAUNCH = {"num_warps": 4, "num_stages": 1}
# A bounded gate's largest log2 decay over the 15 steps inside a 16-row block (see _chunk_intra_bounded_kernel)
BOUNDED_GATE_MAX_LOG2_SPAN = 112.0


def bounded_gate(call: KDACall) -> bool:
    """Whether `_chunk_intra_bounded_kernel` may run (it anchors the diagonal blocks too): the in-kernel
    lower-bound gate g = lb * sigmoid(.) costs at most |lb| log2(e) log2 units per token, so 15 steps stay
    within 2^112 when |lb| <= 5.17 (lb = -5, Kimi's value, gives 2^108.2); and q, k are L2-normalised in the
    kernel, so a dot of K such terms stays below 2^(112 + log2 K) < 2^128. Other gates (a raw log-decay may be
    -1000) keep `_chunk_intra_kernel` and its pairwise diagonal."""
    return (call.use_gate_in_kernel and call.lower_bound is not None
            and call.use_qk_l2norm_in_kernel
            and -call.lower_bound * LOG2E * (SUB - 1) <= BOUNDED_GATE_MAX_LOG2_SPAN)


def intra_dot_precision(prec: str) -> str:
    """Precision of `_chunk_intra_bounded_kernel`'s A_qk dots: tf32 becomes tf32x3 (about fp32), because
    those dots carry the diagonal blocks that the pairwise path computes in fp32."""
    return "tf32x3" if prec == "tf32" else prec


def workspace_dtype(call: KDACall) -> torch.dtype:
    """Storage of the K-wide workspaces Kd, Qd, Kr and W, the bulk of what the state walk reads per chunk.
    fp16 when the inputs are 16-bit and q, k are l2-normalised in the kernel: then |Qd| <= scale and
    |Kd|, |Kr| <= 1, W = (I + A_kk)^-1 diag(beta) Kd stays within fp16's range, and fp16's 11-bit
    significand is what the tf32 dots that consume these values keep anyway. Otherwise fp32 (raw q, k
    have no bound, and fp32 inputs ask for fp32 accuracy)."""
    if call.q.dtype != torch.float32 and call.use_qk_l2norm_in_kernel:
        return torch.float16
    return torch.float32


def _state_stages(ws_dtype: torch.dtype) -> int:
    """Pipeline depth of the state walk: prefetching the next chunk's Qd, Kr, W, A_qk, U0 needs a second
    set of shared-memory buffers. sm_90 (scripts/kernel_regs.py, K = V = 128): fp16 workspaces take
    80 KB at 2 stages (40 KB at 1); fp32 ones 256 KB at 2, over the 227 KB limit. Not yet timed."""
    return 2 if ws_dtype == torch.float16 else 1


def chunk_kda_fwd(call: KDACall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the chunk kernels for a validated call. Returns (o, final_state)."""
    B, T, H, HV, K, V, N = call.B, call.T, call.H, call.HV, call.K, call.V, call.N
    dev = call.q.device
    o = output_buffer(call)
    st = plan_state(call)
    if N == 0:
        return o, st.final_state
    BT, BC = CHUNK, SUB
    varlen = call.cu_seqlens is not None
    total = B * T
    NT = triton.cdiv(T, BT)
    n_programs = (T // BT + N) if varlen else B * NT
    cu = call.cu_seqlens if varlen else call.q  # dummy pointer when dense
    A_log, dt_bias, lower_bound = gate_params(call)
    prec = dot_precision(call.q.dtype)
    ws_dtype = workspace_dtype(call)

    akk_ws = torch.empty((total, HV, BT), dtype=torch.float32, device=dev)
    aqk_ws = torch.empty((total, HV, BT), dtype=torch.float32, device=dev)
    w_ws = torch.empty((total, HV, K), dtype=ws_dtype, device=dev)
    u_ws = torch.empty((total, HV, V), dtype=torch.float32, device=dev)
    qd_ws = torch.empty((total, HV, K), dtype=ws_dtype, device=dev)
    kr_ws = torch.empty((total, HV, K), dtype=ws_dtype, device=dev)
    gt_ws = torch.empty((max(n_programs, 1), HV, K), dtype=torch.float32, device=dev)

    q, k, v, g, beta = call.q, call.k, call.v, call.g, call.beta
    if total > 0:  # else only empty sequences: the state walk copies their states
        BVp = min(64, pow2_at_least(V))
        flags = dict(IS_VARLEN=varlen, USE_BETA_SIGMOID=call.use_beta_sigmoid_in_kernel, DOT_PREC=prec)
        kd_ws = w_ws.new_empty(w_ws.shape)
        strides = (token_stride(q, T), q.stride(2), token_stride(k, T), k.stride(2),
                   token_stride(g, T), g.stride(2), token_stride(beta, T), beta.stride(2))
        if bounded_gate(call):
            _chunk_intra_bounded_kernel[(n_programs, HV)](
                q, k, g, beta, A_log, dt_bias, cu, akk_ws, aqk_ws, kd_ws, qd_ws, kr_ws, gt_ws, *strides,
                T, N, NT, call.scale, lower_bound,
                H=H, HV=HV, K=K, BT=BT, BC=BC, BK=min(_BOUNDED_BK, pow2_at_least(K)),
                HAS_A_LOG=call.A_log is not None, HAS_DT_BIAS=call.dt_bias is not None,
                A_PREC=intra_dot_precision(prec), ROW_BATCHED=_ROW_BATCHED, **_BOUNDED_LAUNCH, **flags,
            )
        else:
            _chunk_intra_kernel[(n_programs, BT // BC, HV)](
                q, k, g, beta, A_log, dt_bias, cu, akk_ws, aqk_ws, kd_ws, qd_ws, kr_ws, gt_ws, *strides,
                T, N, NT, call.scale, lower_bound,
                H=H, HV=HV, K=K, BT=BT, BC=BC, BK=16,
                USE_GATE=call.use_gate_in_kernel, HAS_A_LOG=call.A_log is not None,
                HAS_DT_BIAS=call.dt_bias is not None, USE_LOWER_BOUND=call.lower_bound is not None,
                USE_L2NORM=call.use_qk_l2norm_in_kernel, num_warps=4, num_stages=1, **flags,
            )
        _chunk_solve_kernel[(n_programs, HV)](
            v, beta, cu, akk_ws, kd_ws, w_ws, u_ws,
            token_stride(v, T), v.stride(2), token_stride(beta, T), beta.stride(2),
            T, N, NT,
            HV=HV, K=K, V=V, BT=BT, BC=BC, BK=min(32, pow2_at_least(K)), BV=BVp, **_SOLVE_LAUNCH, **flags,
        )
    ws = dict(aqk=aqk_ws, w=w_ws, u=u_ws, qd=qd_ws, kr=kr_ws, gt=gt_ws)
    state_walk(call, st, o, ws, BT, NT, prec, _state_stages(ws_dtype))
    return o, st.final_state
