"""The prepare stage of `chunk_kda`: every chunk of BT tokens and value head in parallel, before the serial
state walk (`kda.ops.chunk_walk`). Equals the per-chunk quantities of `kda_reference.chunk.chunk_kda`.

Per chunk, with b2 = log2(e) b the cumulative decay inside the chunk in log2 units (the oracle's `b` is the
same cumsum in natural log; b2 <= 0, non-increasing per channel) and q~, k~ the (l2-normalised) rows:

    A_kk[i, j] = beta_i sum_c k~_ic k~_jc 2^(b2_ic - b2_jc)   j < i     (the oracle's `A_kk`)
    A_qk[i, j] = scale  sum_c q~_ic k~_jc 2^(b2_ic - b2_jc)   j <= i    (the oracle's `A_qk`)
    X  = (I + A_kk)^-1,     Xb = X diag(beta)                           (the oracle's `INV`)
    Kd = 2^b2 k~,           Qd = scale 2^b2 q~,        gt = 2^b2_last
    Kr = 2^(b2_last - b2) k~,   M = Xb^T Kr,   N = A_qk Xb                 (what the walk reads: Kd, Qd, M, N, gt)

The inverse is folded into M and N, so the walk takes D = V - Kd S straight from the input V: neither U0 = Xb V
nor W = Xb Kd is computed or stored, the walk's U = Xb D entering only through N D and M^T D. With fp16
workspaces the prepare also stores, per chunk, the powers of two M and N were scaled by and max|V|
(`_store_folded`).

Two forms write the same workspaces (token-major `[B*T, HV, *]`; gt per chunk):
- `_chunk_prepare_kernel`, for a bounded gate (`kda.plan.bounded_gate`: Kimi's lower-bound gate with
  q, k l2-normalised in the kernel): one program per (chunk, value head) does everything, every product a
  tensor-core dot. The exponents it evaluates stay inside fp32's range because a bounded gate costs at
  most |lb| log2(e) log2 units per token: each 32-row half of A is anchored at its middle row (at most 16
  tokens away: 2^115 at lb = -5; both halves in one dot whose off-diagonal quadrants are dropped), the
  block of second-half rows against first-half columns at the first row of the second half (both factors
  <= 1, so fp16 operands where the dots run in tf32). The inverse: the finite series I - L + L^2 - ... inside
  the `ChunkPlan.BC` x BC diagonal blocks (4 x 4), then one block merge as dots per doubling, all on the
  transpose X^T (`_unit_lower_inverse_t`: tf32 dots stage fewer operands transposed). Kr is parked
  in M's rows, and A_qk held in fp16 registers (parked in N's rows with fp32 workspaces), until Xb is known
  (`_store_folded`). A chunk of one token (a decode step in a varlen batch whose lengths the host does not
  know, a sequence's last token alone in its chunk) has A_kk = 0, X = I: it stores its rows without a dot
  (`_one_row_chunk`) instead of running the masked 64-row program.
- `_chunk_intra_kernel` + `_chunk_solve_kernel`, for any gate (a raw log-decay may be -1000 per token):
  the diagonal 16 x 16 blocks take 2^(b_i - b_j) pairwise (every exponent <= 0), the cumsum in fp64.

The cumulative decay b2 is summed in float64 for fp32 inputs: kernels use differences b2_i - b2_j of tokens
up to a chunk apart, and b2 reaches -460 within a chunk at lb = -5, where fp32 keeps 3e-5 absolute. With
16-bit inputs it is an fp32 sum, which `_chunk_gate_kernel` takes before the fused prepare
(`ChunkPlan.gate_pass`): the prepare then loads b2 and its anchor rows instead of scanning and reducing
across its warps in every K slice.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    bad_bounds,
    chunk_program,
    decay_rate,
    dt_bias_slice,
    kda_gate_log2,
    kept_item,
    locate_block,
    pow2_of,
    pow2_scale,
    seq_bounds,
    tf32_round,
    tile_mask,
)
from .launch import direct
from .overlap import count_chunk, finish, ready_counter


@triton.jit
def _locate_chunk(i_p, cu_seqlens, N, T, NT, IS_VARLEN: tl.constexpr, BT: tl.constexpr, SHORT: tl.constexpr):
    """`locate_block` for the chunk programs (sequence, the chunk's first token, the sequence's end), plus the
    chunk's index in the full grid, where its gt row lives (the walk reads it there). With SHORT > 0 (varlen,
    `kda.plan.Route`) the grid holds only the chunks of the sequences not routed to the recurrent
    loop (`kept_item`)."""
    if SHORT > 0:
        i_n, i_t = kept_item(cu_seqlens, i_p, N, SHORT, BT)
        bos, eos = seq_bounds(cu_seqlens, tl.maximum(i_n, 0), T, True)
        t0 = tl.where((i_n < 0) | bad_bounds(eos), eos, bos + i_t * BT)  # no chunk: the caller returns
        p = chunk_program(i_n, bos, t0, NT, True, BT)
    else:
        i_n, _, t0, eos = locate_block(i_p, cu_seqlens, N, T, NT, IS_VARLEN, BT)
        p = i_p
    return i_n, t0, eos, p


@triton.jit
def _chunk_and_head(HEAD_FASTEST: tl.constexpr):
    """(chunk program, value head) of a (chunk, head) grid, or with HEAD_FASTEST of a (head, chunk) one."""
    if HEAD_FASTEST:
        i_p = tl.program_id(1)
        i_hv = tl.program_id(0)
    else:
        i_p = tl.program_id(0)
        i_hv = tl.program_id(1)
    return i_p, i_hv


@triton.jit
def _row_ssq(x_ptr, rows, row_mask, stride_t, k0, K: tl.constexpr, BK: tl.constexpr):
    """sum of x^2 per row over the K slice [k0, k0 + BK) (0 past K and outside `row_mask`)."""
    cols = k0 + tl.arange(0, BK)
    m = tile_mask(row_mask, cols < K, K % BK == 0)
    x = tl.load(x_ptr + rows[:, None] * stride_t + cols[None, :], mask=m, other=0.0).to(tl.float32)
    return tl.sum(x * x, 1)


@triton.jit
def _qk_inv_norm(x_ptr, rows, row_mask, stride_t, K: tl.constexpr, BK: tl.constexpr, USE_L2NORM: tl.constexpr):
    """1 / sqrt(sum x^2 + 1e-6) per row (l2norm), or ones."""
    if USE_L2NORM:
        ssq = tl.zeros([rows.shape[0]], dtype=tl.float32)
        for k0 in range(0, K, BK):
            ssq += _row_ssq(x_ptr, rows, row_mask, stride_t, k0, K, BK)
        return 1.0 / tl.sqrt(ssq + 1e-6)
    else:
        return tl.full([rows.shape[0]], 1.0, dtype=tl.float32)


@triton.jit
def _qk_inv_norms(k_ptr, q_ptr, v_ptr, rows, row_mask, s_kt, s_qt, s_vt, K: tl.constexpr, V: tl.constexpr,
                  BK: tl.constexpr, VMAX: tl.constexpr):
    """`_qk_inv_norm` of k and of q in one pass over K (their tiles' loads issued together; the same sums in
    the same order, so the same bits), and with VMAX max|v| over the rows (0 without), its tiles loaded in the
    same pass so that their latency is waited for once."""
    ssk = tl.zeros([rows.shape[0]], dtype=tl.float32)
    ssq = tl.zeros([rows.shape[0]], dtype=tl.float32)
    v_abs = tl.zeros([rows.shape[0], BK], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):  # unrolled: every slice's loads in flight at once
        ssk += _row_ssq(k_ptr, rows, row_mask, s_kt, k0, K, BK)
        ssq += _row_ssq(q_ptr, rows, row_mask, s_qt, k0, K, BK)
        if VMAX:  # columns past V masked (V narrower than K)
            v_abs = tl.maximum(v_abs, _abs_tile(v_ptr, rows, row_mask, s_vt, k0, V, BK, V % BK == 0 and V >= K))
    v_max = 0.0
    if VMAX:
        v_max = _abs_max(v_abs, v_ptr, rows, row_mask, s_vt, K, V, BK)  # columns of V wider than K
    return 1.0 / tl.sqrt(ssk + 1e-6), 1.0 / tl.sqrt(ssq + 1e-6), v_max


@triton.jit
def _abs_tile(x_ptr, rows, row_mask, stride_t, c0, C: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr):
    """|x| of `rows` and the columns [c0, c0 + BK) in fp32 (0 past C and outside `row_mask`; EVEN: every
    column is below C, no column mask)."""
    cols = c0 + tl.arange(0, BK)
    m = tile_mask(row_mask, cols < C, EVEN)
    return tl.abs(tl.load(x_ptr + rows[:, None] * stride_t + cols[None, :], mask=m, other=0.0).to(tl.float32))


@triton.jit
def _abs_max(x_abs, x_ptr, rows, row_mask, stride_t, c_lo, C: tl.constexpr, BK: tl.constexpr):
    """max|x| of `rows` over the tile x_abs (|x| of columns already read) and the columns [c_lo, C)."""
    for c0 in range(c_lo, C, BK):
        x_abs = tl.maximum(x_abs, _abs_tile(x_ptr, rows, row_mask, stride_t, c0, C, BK, C % BK == 0))
    return tl.max(x_abs)


@triton.jit
def _top_rows(x):
    """x[:n/2] of an [n, m] tile."""
    n: tl.constexpr = x.shape[0]
    m: tl.constexpr = x.shape[1]
    a, _ = tl.split(tl.permute(tl.reshape(x, [2, n // 2, m]), (1, 2, 0)))
    return a


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
               USE_LOWER_BOUND: tl.constexpr, EVICT_FIRST: tl.constexpr = False):
    """The log2 decay of the [rows, cols] tile in fp64 (the cumsums are taken in fp64), 0 outside `m`
    (EVICT_FIRST: g read once, its lines marked first to leave the caches)."""
    gl = kda_gate_log2(tl.load(g_h + rows[:, None] * s_gt + cols[None, :], mask=m, other=0.0,
                               eviction_policy="evict_first" if EVICT_FIRST else ""),
                       a, bias, lower_bound, USE_GATE, USE_LOWER_BOUND, FAST=True)
    return tl.where(m, gl, 0.0).to(tl.float64)


@triton.jit
def _gate_row(g_row, cols, col_ok, a, bias, lower_bound):
    """The log2 decay (fp32) of one token's channels `cols` with Kimi's lower-bound gate: a one-token chunk's
    b2, which is its gate (no cumsum over the 63 masked rows)."""
    x = tl.load(g_row + cols, mask=col_ok, other=0.0)
    return tl.reshape(kda_gate_log2(x[None, :], a, bias, lower_bound, True, True, FAST=True), [cols.shape[0]])


@triton.jit
def _store_decayed(kd_ws, qd_ws, kr_ws, ws, cols, m, kx, qx, rk, rq, scale, b2, b2_last):
    """What the solve and the state walk read, for the rows of `b2` (log2 decay from the chunk start):
    Kd = 2^b2 k~, Qd = scale 2^b2 q~, Kr = 2^(b2_last - b2) k~, with k~ = rk k and q~ = rq q (l2norm), at row
    offsets `ws` and channels `cols`."""
    d = tl.exp2(b2.to(tl.float32))
    kn = kx * rk[:, None]
    tl.store(kd_ws + ws + cols[None, :], kn * d, mask=m)
    tl.store(qd_ws + ws + cols[None, :], qx * (rq * scale)[:, None] * d, mask=m)
    tl.store(kr_ws + ws + cols[None, :], kn * tl.exp2((b2_last[None, :] - b2).to(tl.float32)), mask=m)



@triton.jit
def _row_of(x, o_t, r):
    """Row r of the tile x ([BT, C], rows o_t) as a [C] vector."""
    return tl.sum(tl.where(o_t[:, None] == r, x, 0.0), 0)


@triton.jit
def _unit_dots(kr, qr, kc, Akk, Aqk, PREC: tl.constexpr):
    """Akk += kr kc^T, Aqk += qr kc^T for operands whose entries are at most 1 in magnitude: with tf32 dots
    they go to fp16 instead (the 11-bit significand of a rounded tf32 operand at twice its rate; values
    below 2^-24 flush, an absolute error under 2^-25 against entries of order 1)."""
    if PREC == "tf32":
        c = tl.trans(kc.to(tl.float16))
        Akk = tl.dot(kr.to(tl.float16), c, Akk)
        Aqk = tl.dot(qr.to(tl.float16), c, Aqk)
    else:
        c = tl.trans(kc)
        Akk = tl.dot(kr, c, Akk, input_precision=PREC)
        Aqk = tl.dot(qr, c, Aqk, input_precision=PREC)
    return Akk, Aqk


@triton.jit
def _cat_cols(a, b):
    """The tile [a, b] of two [n, m] tiles."""
    n: tl.constexpr = a.shape[0]
    m: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), [n, 2 * m])


@triton.jit
def _block_forward_substitution(L3, BC: tl.constexpr):
    """(I + L_b)^-1 of every strictly lower BC x BC block L_b of the [NB, BC, BC] tile L3, by forward
    substitution in fp32, all blocks at once: X_i = e_i - sum_{j<i} L_ij X_j."""
    NB: tl.constexpr = L3.shape[0]
    o_i = tl.arange(0, BC)[None, :, None]
    o_j = tl.arange(0, BC)[None, None, :]
    eye3 = tl.where(o_i == o_j, 1.0, 0.0) + tl.zeros([NB, BC, BC], dtype=tl.float32)
    X3 = eye3
    for i in tl.static_range(1, BC):
        l_i = tl.sum(tl.where(o_i == i, L3, 0.0), 1)  # [NB, BC]: row i of every block
        x_i = tl.sum(l_i[:, :, None] * X3, 1)
        X3 = tl.where(o_i == i, eye3 - x_i[:, None, :], X3)
    return X3


@triton.jit
def _store_folded(A_qk, XbT, n_ws, m_ws, sc_ws, n_base, m_base, i_p, i_hv, o_t, row_ok, v_max,
                  HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  EVEN_K: tl.constexpr, PREC: tl.constexpr):
    """N = A_qk Xb into N's rows (from row offset n_base), and M = Xb^T Kr over the Kr that the caller parked
    in M's rows (from m_base), each slice read by every thread before it is overwritten, from XbT = Xb^T (the
    row operand of M's dots, and N's column operand as the transpose of a register tile, which a tf32 dot
    stages without transposing it: `_unit_lower_inverse_t`). Xb is zero past the
    sequence (beta is), so N's columns and M's rows are too; N is lower triangular, stored with whole rows.
    fp16 workspaces: Xb's entries are not bounded by 1 (an ill-conditioned I + A_kk), so N and M are stored
    times a power of two per chunk, N's from its largest entry, M's from the largest column sum of |Xb|
    (|Kr| <= 1 bounds |M_ij| by column i's sum: no reduction over the K slices), and row (i_p, i_hv) of
    `sc_ws` keeps the inverse powers (exact) that the walk multiplies its fp32 products by, and `v_max`, max|V|
    of the chunk's rows (the caller's), the term of D's bound that the walk would otherwise reduce from its
    V tile on every step."""
    F16: tl.constexpr = m_ws.dtype.element_ty == tl.float16
    Xb = tl.trans(XbT)
    if A_qk.dtype == tl.float16:  # exact in tf32: no rounding
        N = tl.dot(A_qk.to(tl.float32), Xb, input_precision=PREC)
    else:
        N = tl.dot(tf32_round(A_qk, PREC), Xb, input_precision=PREC)
    if F16:
        pn = pow2_scale(N)
        pm = pow2_of(tl.max(tl.sum(tl.abs(XbT), 1)))
        N = N * pn
    tl.store(n_ws + n_base + o_t[:, None] * (HV * BT) + o_t[None, :], N, mask=row_ok[:, None])
    tl.debug_barrier()  # Kr parked by every thread before it is read back
    ws = m_base + o_t[:, None] * (HV * K)
    for k0 in tl.static_range(0, K, BK):  # unrolled: later slices' loads issued early
        cols = k0 + tl.arange(0, BK)
        m = tile_mask(row_ok, cols < K, EVEN_K)
        kr = tl.load(m_ws + ws + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if not F16:  # an fp16 Kr is exact in tf32
            kr = tf32_round(kr, PREC)
        tl.debug_barrier()  # read by every thread before it is overwritten
        M = tl.dot(XbT, kr, input_precision=PREC)
        if F16:
            M = M * pm
        tl.store(m_ws + ws + cols[None, :], M, mask=m)
    if F16:
        _store_scales(sc_ws, i_p, i_hv, 1.0 / pm, 1.0 / pn, v_max, HV)


@triton.jit
def _store_scales(sc_ws, i_p, i_hv, s0, s1, v_max, HV: tl.constexpr):
    """Row (i_p, i_hv) of `sc_ws` with fp16 workspaces, what the walk reads a chunk ahead: s0, s1 (folded: the
    inverse powers of two M and N were stored times, exact; unfolded: Xb's inverse power and its largest row
    sum) and max|V| of the chunk's rows."""
    sc = sc_ws + (i_p * HV + i_hv) * 4
    tl.store(sc, s0)
    tl.store(sc + 1, s1)
    tl.store(sc + 2, v_max)


@triton.jit
def _store_unfolded(A_qk, XbT, n_ws, x_ws, sc_ws, n_off, i_p, i_hv, row_ok, v_max, HV: tl.constexpr):
    """`ChunkPlan.fold` off (fp16 workspaces): A_qk (fp16; |entries| <= scale) into N's rows and Xb = XbT^T times a
    power of two px into x_ws's rows, both with whole rows (zeros above the diagonal, past the sequence), and in
    row (i_p, i_hv) of `sc_ws`: 1 / px, R = the largest row sum of |Xb| (the walk's bound on U = Xb D, |U_i| <= R
    max|D|), max|V|. Kr stays in M's rows, where the K loop parked it. `n_off`: the chunk's [BT, BT] offsets."""
    tl.store(n_ws + n_off, A_qk.to(n_ws.dtype.element_ty), mask=row_ok[:, None])
    px = pow2_scale(XbT)
    tl.store(x_ws + n_off, tl.trans(XbT * px).to(x_ws.dtype.element_ty), mask=row_ok[:, None])
    # Xb's row sums: XbT's column sums
    _store_scales(sc_ws, i_p, i_hv, 1.0 / px, tl.max(tl.sum(tl.abs(XbT), 0)), v_max, HV)


@triton.jit
def _one_row_chunk(q_h, k_h, g_h, b2_ws, qd_ws, kd_ws, m_ws, n_ws, gt_ws, sc_ws, ws_base, n_base, i_p, i_hv, o_t,
                   rk, rq, b_beta, v_max, a, dt_bias, lower_bound, HV: tl.constexpr, K: tl.constexpr,
                   BK: tl.constexpr, HAS_DT_BIAS: tl.constexpr, B2_FROM_WS: tl.constexpr, x_ws=None,
                   FOLD: tl.constexpr = True):
    """What `_chunk_prepare_kernel` stores for a chunk of one token, without its dots: A_kk = 0, so X = I and
    Xb = beta; b2 = b2_last, so Kr = k~; M's row is beta k~ and N's is [scale beta q~.k~, 0, ...]. Exact in
    fp32 where the general path rounds its dot operands (a one-token chunk program costs as long as a full
    one there: the same dots, masked). `rk`, `rq` (times scale), `b_beta`: the norms pass's vectors, row 0
    the token's."""
    F16: tl.constexpr = m_ws.dtype.element_ty == tl.float16
    first = o_t == 0
    rk0 = tl.sum(tl.where(first, rk, 0.0))
    rq0 = tl.sum(tl.where(first, rq, 0.0))
    beta0 = tl.sum(tl.where(first, b_beta, 0.0))
    pm = 1.0
    if F16:
        pm = pow2_of(tl.abs(beta0))  # the largest column sum of |Xb|, as `_store_folded` scales M
    m_row = beta0 * pm
    if not FOLD:
        m_row = 1.0  # M's rows hold Kr: k~
    aqk = 0.0
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        col_ok = cols < K
        kn = tl.load(k_h + cols, mask=col_ok, other=0.0).to(tl.float32) * rk0
        qn = tl.load(q_h + cols, mask=col_ok, other=0.0).to(tl.float32) * rq0
        if B2_FROM_WS:  # b2 (and gt) written by `_chunk_gate_kernel`
            b2 = tl.load(b2_ws + ws_base + cols, mask=col_ok, other=0.0)
        else:
            b2 = _gate_row(g_h, cols, col_ok, a, dt_bias_slice(dt_bias, i_hv, cols, K, HAS_DT_BIAS), lower_bound)
            tl.store(gt_ws + (i_p * HV + i_hv) * K + cols, tl.exp2(b2), mask=col_ok)
        d = tl.exp2(b2)
        tl.store(qd_ws + ws_base + cols, qn * d, mask=col_ok)
        tl.store(kd_ws + ws_base + cols, kn * d, mask=col_ok)
        tl.store(m_ws + ws_base + cols, kn * m_row, mask=col_ok)
        aqk += tl.sum(qn * kn)
    if FOLD:
        n00 = aqk * beta0
        pn = 1.0
        if F16:
            pn = pow2_of(tl.abs(n00))
        tl.store(n_ws + n_base + o_t, tl.where(first, n00 * pn, 0.0))
        if F16:
            _store_scales(sc_ws, i_p, i_hv, 1.0 / pm, 1.0 / pn, v_max, HV)
    else:  # A_qk's row [scale q~.k~, 0, ...], Xb = [[beta]] times px = pm
        tl.store(n_ws + n_base + o_t, tl.where(first, aqk, 0.0))
        tl.store(x_ws + n_base + o_t, tl.where(first, beta0 * pm, 0.0))
        _store_scales(sc_ws, i_p, i_hv, 1.0 / pm, tl.abs(beta0), v_max, HV)


@triton.jit
def _unit_lower_inverse_t(L, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """Y = X^T for X = (I + L)^-1 and a strictly lower [BT, BT] tile L (the oracle's `INV`), computed transposed: a
    tf32 dot takes its column operand K-major, so a tile from a dot's accumulator is staged in shared memory element
    by element, transposed, where L^T (staged once, as L is held: 8-byte pieces of its rows) and the other operands
    of the transposed products need no transpose (11 transposed stagings a chunk down to 4, the merges' second
    dots). Inside the BC x BC diagonal blocks by their finite series with tf32 dots (below; forward substitution
    with fp32 ones, which run on the FMA units and spill more as two more dots), then one merge per doubling of the
    block width: for M = [[A, 0], [C, B]] and D = diag(A^-1, B^-1), M^-1 = D - D E D with E = [[0, 0], [C, 0]]
    (block forward substitution written as two dots), here Y <- Y - (Y E^T) Y. Every dot takes operands rounded to
    nearest at PREC (taken as the tensor cores truncate them, the final-state error of the ill-conditioned
    `correlated_keys` inputs rose from 1.87e-3 to 1.98e-3 for 1.3% of the calls' time: docs/performance.md). The
    series' terms stay small (entries of L are at most |beta| in magnitude, and a 4 x 4 block's square and cube have
    at most two and one terms per entry), so little is lost to cancellation (forward substitution in fp32 on [NB,
    BC, BC] tiles gave the same accuracy, also with correlated keys and beta up to 1.9, and took 2.4% longer at
    1x16384 H=32: docs/performance.md)."""
    NB: tl.constexpr = BT // BC
    o_t = tl.arange(0, BT)
    r = o_t[:, None]
    c = o_t[None, :]
    # every dot below but the merges' second takes L^T as its column operand
    LrT = tl.trans(tf32_round(L, PREC))
    if PREC == "tf32":
        # the diagonal blocks' inverse as the series I - Ld + Ld^2 - ... (Ld^BC = 0: Ld is strictly lower
        # inside BC x BC blocks), by Y <- I - Y Ld^T from Y = I - Ld^T: BC - 2 tensor-core dots, no 3-D tiles.
        # Y is block diagonal, so Y Ld^T is Y L^T on the diagonal blocks (L^T's other blocks meet zeros)
        eye = tl.where(r == c, 1.0, 0.0)
        blk = r // BC == c // BC
        Y = eye - tl.where(blk, tl.trans(L), 0.0)
        for _ in tl.static_range(2, BC):
            Y = eye - tl.where(blk, tl.dot(tf32_round(Y, PREC), LrT, input_precision=PREC), 0.0)
    else:  # fp32 dots run on the FMA units: forward substitution, all blocks at once in [NB, BC, BC] tiles
        o_b = tl.arange(0, NB)
        same_blk = o_b[:, None, None, None] == o_b[None, None, :, None]  # [NB, 1, NB, 1]
        L3 = tl.sum(tl.where(same_blk, tl.reshape(L, [NB, BC, NB, BC]), 0.0), 2)  # the diagonal blocks
        X3 = _block_forward_substitution(L3, BC)
        Y = tl.trans(tl.reshape(tl.where(same_blk, tl.reshape(X3, [NB, BC, 1, BC]), 0.0), [BT, BT]))
    for lvl in tl.static_range(0, 4):
        if (1 << lvl) < NB:
            # Y block diagonal in blocks of w rows; E^T holds L^T's blocks just above the diagonal of every pair,
            # so Y E^T is Y's rows of the pairs' upper blocks times L^T, kept in the pairs' upper-right blocks
            w = BC << lvl
            Yr = tf32_round(Y, PREC)
            Yu = tl.where((r // w) % 2 == 0, Yr, 0.0)
            upper_right = (r // (2 * w) == c // (2 * w)) & ((r // w) % 2 == 0) & ((c // w) % 2 == 1)
            H = tl.where(upper_right, tl.dot(Yu, LrT, input_precision=PREC), 0.0)
            Y = Y - tl.dot(tf32_round(H, PREC), Yr, input_precision=PREC)
    return Y


@direct
@triton.jit
def _chunk_gate_kernel(
    g, A_log, dt_bias, cu_seqlens, b2_ws, gt_ws, ready,
    s_gt, s_gh, T, N, NT, lower_bound,
    HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    SHORT: tl.constexpr, SIGNAL_CHUNKS: tl.constexpr = 0,
):
    """The gate pass of the fused prepare (16-bit inputs): one program per (chunk, value head, K slice)
    writes b2, the fp32 cumulative log2 decay from the chunk start (the cumsum `_chunk_prepare_kernel`
    would take in its own loop), token-major like the workspaces, and gt = 2^b2_last. The prepare then
    reads b2 and its anchor rows instead of scanning and reducing across its warps.
    SIGNAL_CHUNKS > 0 (dense): the first K slice of each group's first chunk zeroes the group's counter in
    `ready`, which the prepare then counts up (`_chunk_prepare_kernel`)."""
    # a flat grid, chunks slowest and the last first, so that the first chunks' b2 is the freshest in L2 when
    # the prepare (head-fastest from chunk 0) reads it (with g read evict-first: 0.995x the calls' time)
    NKS: tl.constexpr = (K + BK - 1) // BK
    pid = tl.program_id(0)
    i_k = pid % NKS
    i_hv = (pid // NKS) % HV
    i_p = tl.num_programs(0) // (NKS * HV) - 1 - pid // (NKS * HV)
    i_n, t0, eos, i_p = _locate_chunk(i_p, cu_seqlens, N, T, NT, IS_VARLEN, BT, SHORT)
    if t0 >= eos:
        return
    if SIGNAL_CHUNKS > 0:
        if (i_k == 0) & (((t0 - i_n * T) // BT) % SIGNAL_CHUNKS == 0):
            tl.store(ready_counter(ready, i_n, t0, T, NT, i_hv, HV, BT, SIGNAL_CHUNKS), 0)
    o_t = tl.arange(0, BT)
    row_ok = o_t < eos - t0
    cols = i_k * BK + tl.arange(0, BK)
    col_ok = cols < K
    m = tile_mask(row_ok, col_ok, K % BK == 0)
    a = decay_rate(A_log, i_hv, HAS_A_LOG)
    bias = dt_bias_slice(dt_bias, i_hv, cols, K, HAS_DT_BIAS)
    if IS_VARLEN:  # not compiled for dense calls: there the branch cost 1.2% (a last chunk alone takes it)
        if eos - t0 == 1:  # a chunk of one token: b2 is its gate (`_gate_row`)
            b1 = _gate_row(g + t0 * s_gt + i_hv * s_gh, cols, col_ok, a, bias, lower_bound)
            tl.store(b2_ws + (t0 * HV + i_hv) * K + cols, b1, mask=col_ok)
            tl.store(gt_ws + (i_p * HV + i_hv) * K + cols, tl.exp2(b1), mask=col_ok)
            return
    gl = _gate_tile(g + t0 * s_gt + i_hv * s_gh, o_t, cols, m, s_gt, a, bias, lower_bound, True, True, True)
    b2 = tl.cumsum(gl.to(tl.float32), axis=0)
    tl.store(b2_ws + (t0 * HV + i_hv) * K + o_t[:, None] * (HV * K) + cols[None, :], b2, mask=m)
    tl.store(gt_ws + (i_p * HV + i_hv) * K + cols, tl.exp2(tl.sum(gl.to(tl.float32), 0)), mask=col_ok)


@triton.jit
def _b2_row(b2_ws, ws_base, r, n_rows, cols, HV: tl.constexpr, K: tl.constexpr):
    """b2 of chunk row r (the last row of the sequence where r is past it: rows past it add 0)."""
    return tl.load(b2_ws + ws_base + tl.minimum(r, n_rows - 1) * (HV * K) + cols, mask=cols < K, other=0.0)


# the diagonal quadrants' one dot also forms the off-diagonal ones, up to 2^230 (inf, and inf - inf, in fp32), and
# their factors' exp2 the other half's anchors: lanes a select then drops
@direct(drops_overflow=True)
@triton.jit
def _chunk_prepare_kernel(
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens,
    kd_ws, qd_ws, m_ws, n_ws, gt_ws, b2_ws, sc_ws, ready, x_ws,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh,
    T, N, NT, p0, scale, lower_bound,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    SHORT: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr, DOT_PREC: tl.constexpr, CUMSUM_DTYPE: tl.constexpr,
    B2_FROM_WS: tl.constexpr, SIGNAL_CHUNKS: tl.constexpr = 0, FOLD: tl.constexpr = True,
    LAST_WAITS: tl.constexpr = False,
):
    """The whole prepare stage for a bounded gate (module docstring), one program per (chunk, value head).
    Pass 1 over K slices: gate, fp64 cumsum, A_kk and A_qk accumulated (the diagonal halves as one batched
    dot, the lower-left quadrant as another), Qd, Kd, gt stored, and Kr parked in M's rows until X is known.
    With fp16 workspaces A_qk is held through the inverse in fp16 registers (compiled for sm_90 it fits
    without spills; parking it in N's rows costs a write, a read and a barrier); with fp32 ones it is parked
    in N's rows. Then Xb = X diag(beta),
    N = A_qk Xb, and M = Xb^T Kr over M's own rows (`_store_folded`). V is read only for its maximum (fp16
    workspaces: the walk's bound on D).
    DOT_PREC is the precision of this kernel's dots (ieee or tf32); CUMSUM_DTYPE that of b2 (fp64 with fp32
    inputs; fp32 with 16-bit ones, where its 1e-4 relative error in the decay factors is far below the
    inputs' rounding and fp64 tiles doubled the registers and spills).
    SIGNAL_CHUNKS > 0 (dense): the walk runs beside this kernel (`_chunk_state_kernel`'s WAIT_CHUNKS); the grid
    is (value head, chunk), so that chunks finish in order, and each program adds 1 to its group's counter in
    `ready` once its stores are done.
    FOLD off (`ChunkPlan.fold`, fp16 workspaces): no M or N; A_qk into N's rows, Xb into `x_ws`, Kr left in M's
    rows (`_store_unfolded`), for a walk that forms U = Xb D itself."""
    i_p, i_hv = _chunk_and_head(SIGNAL_CHUNKS > 0)
    i_p += p0  # the grid's first chunk program (a prepare in two launches, `ChunkPlan.late_chunks`)
    i_h = i_hv // (HV // H)
    i_n, t0, eos, i_p = _locate_chunk(i_p, cu_seqlens, N, T, NT, IS_VARLEN, BT, SHORT)
    if t0 >= eos:
        return
    n_rows = tl.minimum(eos - t0, BT)
    o_t = tl.arange(0, BT)
    row_ok = o_t < n_rows
    # int64 bases at the chunk's first token, int32 offsets inside it (64-bit per-element addresses cost
    # registers); no column mask where K slices cover K exactly (`tile_mask`)
    EVEN_K: tl.constexpr = K % BK == 0
    q_h = q + t0 * s_qt + i_h * s_qh
    k_h = k + t0 * s_kt + i_h * s_kh
    g_h = g + t0 * s_gt + i_hv * s_gh
    ws_base = (t0 * HV + i_hv) * K
    n_base = (t0 * HV + i_hv) * BT  # N's rows
    HALF: tl.constexpr = BT // 2
    # max|V| (fp16 workspaces) beside the norms: one wait for both loads (at the end it had its own)
    F16: tl.constexpr = m_ws.dtype.element_ty == tl.float16
    rk, rq, v_max = _qk_inv_norms(k_h, q_h, v + t0 * s_vt + i_hv * s_vh, o_t, row_ok, s_kt, s_qt, s_vt, K, V, BK,
                                  F16)
    rq = rq * scale
    b_beta = _load_beta(beta + t0 * s_bt, o_t, row_ok, s_bt, s_bh, i_hv, USE_BETA_SIGMOID)
    a = decay_rate(A_log, i_hv, HAS_A_LOG)
    if n_rows == 1:  # one token (a decode step inside a varlen batch, a sequence's last token alone in its chunk)
        _one_row_chunk(q_h, k_h, g_h, b2_ws, qd_ws, kd_ws, m_ws, n_ws, gt_ws, sc_ws, ws_base, n_base, i_p, i_hv, o_t,
                       rk, rq, b_beta, v_max, a, dt_bias, lower_bound, HV, K, BK, HAS_DT_BIAS, B2_FROM_WS, x_ws, FOLD)
        if SIGNAL_CHUNKS > 0:
            count_chunk(ready, i_n, t0, T, NT, i_hv, HV, BT, SIGNAL_CHUNKS)
            if LAST_WAITS:
                finish(i_p, i_hv, N, NT, HV)
        return
    first_half = (o_t < HALF)[:, None]

    # the lower-left quadrant (bottom rows against top columns) has its own [BT, HALF] accumulators
    A_kk = tl.zeros([BT, BT], dtype=tl.float32)
    A_qk = tl.zeros([BT, BT], dtype=tl.float32)
    X_kk = tl.zeros([BT, HALF], dtype=tl.float32)
    X_qk = tl.zeros([BT, HALF], dtype=tl.float32)
    ws = o_t[:, None] * (HV * K)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        col_ok = cols < K
        m = tile_mask(row_ok, col_ok, EVEN_K)
        if B2_FROM_WS:  # written by `_chunk_gate_kernel`; rows past the sequence take its last row's
            b2_last = _b2_row(b2_ws, ws_base, BT - 1, n_rows, cols, HV, K)
            b2 = tl.load(b2_ws + ws_base + ws + cols[None, :], mask=m, other=0.0)
            b2 = tl.where(row_ok[:, None], b2, b2_last[None, :])
            b2_q1 = _b2_row(b2_ws, ws_base, HALF // 2, n_rows, cols, HV, K)
            b2_q3 = _b2_row(b2_ws, ws_base, HALF + HALF // 2, n_rows, cols, HV, K)
            b2_mid = _b2_row(b2_ws, ws_base, HALF, n_rows, cols, HV, K)
        else:
            bias = dt_bias_slice(dt_bias, i_hv, cols, K, HAS_DT_BIAS)
            gl = _gate_tile(g_h, o_t, cols, m, s_gt, a, bias, lower_bound, True, True)
            b2 = tl.cumsum(gl.to(CUMSUM_DTYPE), axis=0)
            b2_last = _row_of(b2, o_t, BT - 1)  # rows past the sequence add 0
            b2_q1 = _row_of(b2, o_t, HALF // 2)
            b2_q3 = _row_of(b2, o_t, HALF + HALF // 2)
            b2_mid = _row_of(b2, o_t, HALF)
        kn = tl.load(k_h + o_t[:, None] * s_kt + cols[None, :], mask=m, other=0.0).to(tl.float32) * rk[:, None]
        qn = tl.load(q_h + o_t[:, None] * s_qt + cols[None, :], mask=m, other=0.0).to(tl.float32) * rq[:, None]
        # the first half's rows from the tiles in registers, not loaded (or gated and summed) again
        b2_t = _top_rows(b2)
        kt = _top_rows(kn)
        # 2^(b_i - b_j) = 2^(b_i - a) 2^(a - b_j). The diagonal quadrants in one dot, each half anchored at
        # its middle row (each factor <= 2^115; the product's off-diagonal quadrants are dropped)
        anc = tl.where(first_half, b2_q1[None, :], b2_q3[None, :])
        kc = tl.trans(tf32_round(kn * tl.exp2((anc - b2).to(tl.float32)), DOT_PREC))
        e_row = tl.exp2((b2 - anc).to(tl.float32))
        A_kk = tl.dot(tf32_round(kn * e_row, DOT_PREC), kc, A_kk, input_precision=DOT_PREC)
        A_qk = tl.dot(tf32_round(qn * e_row, DOT_PREC), kc, A_qk, input_precision=DOT_PREC)
        # bottom rows against top columns at the bottom's first row: both factors <= 1
        x_row = tl.where(first_half, 0.0, tl.exp2((b2 - b2_mid[None, :]).to(tl.float32)))
        kc = kt * tl.exp2((b2_mid[None, :] - b2_t).to(tl.float32))
        X_kk, X_qk = _unit_dots(kn * x_row, qn * x_row, kc, X_kk, X_qk, DOT_PREC)
        # what the walk reads, and Kr parked in M's rows until X is known
        d = tl.exp2(b2.to(tl.float32))
        tl.store(qd_ws + ws_base + ws + cols[None, :], qn * d, mask=m)
        tl.store(m_ws + ws_base + ws + cols[None, :], kn * tl.exp2((b2_last[None, :] - b2).to(tl.float32)), mask=m)
        tl.store(kd_ws + ws_base + ws + cols[None, :], kn * d, mask=m)
        if not B2_FROM_WS:
            tl.store(gt_ws + (i_p * HV + i_hv) * K + cols, tl.exp2(b2_last.to(tl.float32)), mask=col_ok)

    lower_left = (o_t[:, None] >= HALF) & (o_t[None, :] < HALF)
    zeros = tl.zeros([BT, HALF], dtype=tl.float32)
    A_kk = tl.where(lower_left, _cat_cols(X_kk, zeros), A_kk)
    A_qk = tl.where(lower_left, _cat_cols(X_qk, zeros), A_qk)
    valid = row_ok[:, None] & row_ok[None, :]
    L = tl.where(valid & (o_t[None, :] < o_t[:, None]), A_kk * b_beta[:, None], 0.0)
    A_qk = tl.where(valid & (o_t[None, :] <= o_t[:, None]), A_qk, 0.0)
    # A_qk through the inverse: held in fp16 registers with fp16 workspaces (the 11 bits its tf32 dot would
    # keep); parked in N's rows with fp32 ones, whose FMA-dot inverse spills already (more with it held)
    PARK: tl.constexpr = n_ws.dtype.element_ty == tl.float32
    n_off = n_base + o_t[:, None] * (HV * BT) + o_t[None, :]
    if PARK:
        tl.store(n_ws + n_off, A_qk, mask=row_ok[:, None])
    else:
        A_qk = A_qk.to(tl.float16)

    XbT = tf32_round(_unit_lower_inverse_t(L, BT, BC, DOT_PREC) * b_beta[:, None], DOT_PREC)
    if PARK:
        tl.debug_barrier()  # parked by every thread before it is read back
        A_qk = tl.load(n_ws + n_off, mask=row_ok[:, None], other=0.0)
        tl.debug_barrier()  # read by every thread before N overwrites it
    if FOLD:
        _store_folded(A_qk, XbT, n_ws, m_ws, sc_ws, n_base, ws_base, i_p, i_hv, o_t, row_ok, v_max, HV, K, BT, BK,
                      EVEN_K, DOT_PREC)
    else:
        _store_unfolded(A_qk, XbT, n_ws, x_ws, sc_ws, n_off, i_p, i_hv, row_ok, v_max, HV)
    if SIGNAL_CHUNKS > 0:
        count_chunk(ready, i_n, t0, T, NT, i_hv, HV, BT, SIGNAL_CHUNKS)
        if LAST_WAITS:
            finish(i_p, i_hv, N, NT, HV)


@direct
@triton.jit
def _chunk_intra_kernel(
    q, k, g, beta, A_log, dt_bias, cu_seqlens,
    akk_ws, aqk_ws, kd_ws, qd_ws, kr_ws, gt_ws,
    s_qt, s_qh, s_kt, s_kh, s_gt, s_gh, s_bt, s_bh,
    T, N, NT, scale, lower_bound,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    SHORT: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, USE_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Split prepare, part 1: one program per (chunk, row block r of BC rows, value head). Walks K in
    BK-wide slices; per slice it recomputes the gate of the whole chunk and its fp64 cumsum in registers
    (no scratch), then adds to row block r's strip of A_kk / A_qk: columns of earlier blocks through one
    dot anchored on the first row of block r, the diagonal block pairwise. Also writes block r's rows of
    Kd = 2^b k, Qd = scale 2^b q, Kr = 2^(b_last - b) k (l2-normalised) and, for r = 0, gt = 2^b_last.
    The caller passes N's and M's workspaces as aqk_ws and kr_ws: A_qk and Kr are parked there until
    `_chunk_solve_kernel` folds the inverse into them.
    This is the path of any gate; a bounded one takes `_chunk_prepare_kernel`."""
    i_p = tl.program_id(0)
    i_r = tl.program_id(1)
    i_hv = tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n, t0, eos, i_p = _locate_chunk(i_p, cu_seqlens, N, T, NT, IS_VARLEN, BT, SHORT)
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
    # A_qk's rows whole (zeros right of the diagonal block): the walk loads them unmasked along the row
    tl.store(aqk_ws + a_off + o_t[None, :], tl.where(before[None, :], qk, 0.0),
             mask=ok_r[:, None] & ((o_t < r0) | (o_t >= r0 + BC))[None, :])
    kk = tl.where(o_c[:, None] > o_c[None, :], acc_dg_kk, 0.0) * (rk_r * beta_r)[:, None] * rk_r[None, :]
    qk = tl.where(o_c[:, None] >= o_c[None, :], acc_dg_qk, 0.0) * (rq_r * scale)[:, None] * rk_r[None, :]
    m_dg = ok_r[:, None] & ok_r[None, :]
    tl.store(akk_ws + a_off + r0 + o_c[None, :], kk, mask=m_dg)
    tl.store(aqk_ws + a_off + r0 + o_c[None, :], qk, mask=ok_r[:, None])  # zeros past the sequence



@direct
@triton.jit
def _chunk_solve_kernel(
    v, beta, cu_seqlens, akk_ws, m_ws, n_ws, sc_ws, ready,
    s_vt, s_vh, s_bt, s_bh,
    T, N, NT,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, DOT_PREC: tl.constexpr,
    SHORT: tl.constexpr,
    INV_PREC: tl.constexpr, SIGNAL_CHUNKS: tl.constexpr = 0,
):
    """Split prepare, part 2: one program per (chunk, value head). X = (I + A_kk)^-1, written over A_kk:
    the NC diagonal BC x BC blocks by forward substitution, all blocks at once in an [NC, BC, BC] tile
    (X_i = e_i - sum_{j<i} L_ij X_j), then block row by block row X[r, :r] = -X_rr (L[r, :r] X[:r, :r])
    (block forward substitution; the rows above r are final by then). fp32 throughout ("ieee" dots).
    Then N = A_qk Xb and M = Xb^T Kr over the A_qk and Kr parked by `_chunk_intra_kernel` (`_store_folded`).
    SIGNAL_CHUNKS > 0: as `_chunk_prepare_kernel`'s (grid (value head, chunk), each chunk counted once stored)."""
    i_p, i_hv = _chunk_and_head(SIGNAL_CHUNKS > 0)
    i_n, t0, eos, i_p = _locate_chunk(i_p, cu_seqlens, N, T, NT, IS_VARLEN, BT, SHORT)
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
    # A_qk parked by `_chunk_intra_kernel` in N's rows, read before the barriers below (N overwrites it)
    n_base = t0 * (HV * BT) + i_hv * BT
    A_qk = tl.load(n_ws + n_base + o_t[:, None] * (HV * BT) + o_t[None, :], mask=row_ok[:, None], other=0.0)
    X3 = _block_forward_substitution(L3, BC)
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

    XbT = tl.trans(tf32_round(X * b_beta[None, :], DOT_PREC))
    v_max = 0.0
    if m_ws.dtype.element_ty == tl.float16:
        v_max = _abs_max(tl.zeros([BT, BK], dtype=tl.float32), v + t0 * s_vt + i_hv * s_vh, o_t, row_ok, s_vt, 0,
                         V, BK)
    _store_folded(A_qk, XbT, n_ws, m_ws, sc_ws, n_base, t0 * (HV * K) + i_hv * K, i_p, i_hv, o_t, row_ok, v_max,
                  HV, K, BT, BK, K % BK == 0, DOT_PREC)
    if SIGNAL_CHUNKS > 0:
        count_chunk(ready, i_n, t0, T, NT, i_hv, HV, BT, SIGNAL_CHUNKS)
