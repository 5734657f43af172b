"""Device functions shared by the chunked and the recurrent kernels: the in-kernel gate, rounding, sequence
bounds and pool slots.

State is always addressed as a pool of dense planes (`KDACall` explains why): the dense contract is a pool
whose slot `n` is sequence `n`; the paged contract is the caller's pool with `state_indices`. A kernel
reads the plane of `slot_of_seq[n]` from `state_src` and writes it to the same slot of `state_dst`
(the same tensor for the paged contract: in place).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import ERROR_ACCEPTED as _ACCEPTED
from .. import ERROR_BOUNDS as _BOUNDS
from .. import ERROR_KEPT_SLOT as _KEPT_SLOT
from .. import ERROR_SLOT as _SLOT
from ..contract import interpreting


@triton.jit
def softplus(x):
    """softplus(x) = log(1 + exp(x)), stable: max(x, 0) + log(1 + exp(-|x|)), and x itself above 20."""
    y = tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))
    return tl.where(x > 20.0, x, y)


LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): the kernels' decays are powers of two


@triton.jit
def kda_gate_log2(g_raw, a, dt_bias_row, lower_bound, USE_GATE: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
                  FAST: tl.constexpr = False):
    """The per-token log-decay in log2 units. With USE_GATE (`kda_reference.kda_gate`):
    lower bound lb: g = lb * sigmoid(a * (x + dt_bias)); else g = -a * softplus(x + dt_bias); a = exp(A_log).
    FAST (the chunk kernels): the lower-bound gate as lb log2(e) / (1 + 2^(-a x log2(e))) with the approximate
    exp2 and division (a few ulp; fewer instructions than tl.sigmoid's IEEE division). The decode kernels keep
    tl.sigmoid, which measured faster there (docs/performance.md)."""
    g = g_raw.to(tl.float32)
    if USE_GATE:
        x = g + dt_bias_row  # a vector over K, or a tile's rows (broadcast as a leading axis)
        if USE_LOWER_BOUND:
            if FAST:
                e = tl.exp2(x * (a * -LOG2E))
                return tl.fdiv(lower_bound * LOG2E, 1.0 + e, ieee_rounding=False)
            g = lower_bound * tl.sigmoid(a * x)
        else:
            g = -a * softplus(x)
    return g * LOG2E


# The interpreter's fp32 -> bf16 cast truncates; a GPU's cast (cvt.rn.bf16.f32) rounds to nearest even.
_BF16_CAST_TRUNCATES = tl.constexpr(interpreting())


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 `x` rounded to nearest even in `dtype`. Under the interpreter bf16 goes through explicit bits
    (add half an ulp plus the tie bit, clear the low half; NaN kept), because its plain cast truncates;
    the result is then exactly representable, so the cast adds no second rounding. On a GPU the plain
    cast already rounds to nearest even (the decode kernel's bf16 pool spent ALU on the bit path)."""
    if dtype == tl.bfloat16 and _BF16_CAST_TRUNCATES:
        b = x.to(tl.int32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        y = tl.where(x != x, x, r.to(tl.float32, bitcast=True))
        return y.to(tl.bfloat16)
    else:
        return x.to(dtype)


@triton.jit
def tf32_round(x, PREC: tl.constexpr):
    """fp32 `x` rounded to nearest at tf32's 10-bit significand when the dots run in tf32 (the tensor cores
    drop an fp32 operand's 13 low bits: truncation, a bias that a long dot accumulates); else `x`."""
    if PREC == "tf32":
        b = x.to(tl.int32, bitcast=True)
        return ((b + 0x1000) & -8192).to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def pow2_scale(x):
    """A power of two p with max|x| p in [2^14, 2^15): x p fits fp16 (largest finite 65504) with its largest
    entries at fp16's full 11-bit significand, as a tf32 operand would keep them; entries below 2^-28 of the
    largest turn subnormal (absolute error under 2^-38 of the largest). p in [2^-126, 2^126]: exact, and so
    is 1 / p; inf and NaN pass through x p."""
    return pow2_of(tl.max(tl.abs(x)))


@triton.jit
def pow2_of(m):
    """`pow2_scale` of any x with max|x| <= m (m >= 0): m p in [2^14, 2^15). A bound looser than the maximum
    by 2^b leaves x p's largest entries b bits lower in fp16's range, their significand as whole (rounding
    is the same at every power of two); only entries 2^(b-28) below the largest turn subnormal."""
    e = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of m
    return (tl.minimum(tl.maximum(268 - e, 1), 253) << 23).to(tl.float32, bitcast=True)


@triton.jit
def tile_mask(row_ok, col_ok, FULL: tl.constexpr):
    """The mask of a [rows, cols] tile: `row_ok` alone where every column is in range (FULL), so that it is
    constant along a row and the accesses stay 16-byte vectors the pipeliner can copy asynchronously (a
    mask that varies along a row keeps them scalar)."""
    if FULL:
        return row_ok[:, None]
    else:
        return row_ok[:, None] & col_ok[None, :]


@triton.jit
def seq_bounds(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    """Flat token range [bos, eos) of sequence i_n (varlen: from cu_seqlens on the device). Varlen bounds
    outside 0 <= bos <= eos <= T (values the host does not read without KDA_DEBUG) give bos = eos = -1:
    the kernels then treat the sequence as padding (`bad_bounds`), never touching a token or a slot."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        bad = (bos < 0) | (eos < bos) | (eos > T)
        bos = tl.where(bad, -1, bos)
        eos = tl.where(bad, -1, eos)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


@triton.jit
def zero_rows(o_h, s_ot, t_begin, t_end, o_v, v_ok, BT: tl.constexpr, BV: tl.constexpr):
    """Output rows [t_begin, t_end) of one head's V columns `o_v` (`v_ok` in range): zeros, BT rows a store."""
    for t0 in range(t_begin, t_end, BT):
        rows = t0 + tl.arange(0, BT)
        m = (rows < t_end)[:, None] & v_ok[None, :]
        tl.store(o_h + rows[:, None] * s_ot + o_v[None, :], tl.zeros([BT, BV], dtype=o_h.dtype.element_ty), mask=m)


@triton.jit
def zero_trailing_rows(o_h, s_ot, cu_seqlens, N, T, o_v, v_ok, BT: tl.constexpr, BV: tl.constexpr):
    """The rows of a varlen call past its last bound, [cu_seqlens[N], T) (a token count padded for a CUDA
    graph), set to zero for one head's V columns `o_v`. Only where the bounds are in order,
    0 <= cu_seqlens[0] <= ... <= cu_seqlens[N] <= T (a scan of the N + 1 bounds, 1024 a step): out-of-order
    bounds (values the host does not read) make their sequences no-ops whose rows are not written
    (`seq_bounds`), and which rows trail is then unknown, so none is written. The caller is the one program of
    each (V block, head) that owns these rows: no other program writes them."""
    last = tl.load(cu_seqlens + N).to(tl.int64)
    in_order = (tl.load(cu_seqlens).to(tl.int64) >= 0) & (last <= T)
    for j0 in range(0, N, 1024):
        j = j0 + tl.arange(0, 1024)
        lo = tl.load(cu_seqlens + j, mask=j < N, other=0)
        hi = tl.load(cu_seqlens + j + 1, mask=j < N, other=0)
        in_order = in_order & (tl.sum((hi < lo).to(tl.int32), 0) == 0)
    if in_order:
        zero_rows(o_h, s_ot, last, T, o_v, v_ok, BT, BV)


@triton.jit
def decay_rate(A_log, i_hv, HAS_A_LOG: tl.constexpr):
    """a = exp(A_log) of value head i_hv for the in-kernel gate, or 1."""
    a = 1.0
    if HAS_A_LOG:
        a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    return a


@triton.jit
def dt_bias_slice(dt_bias, i_hv, cols, K: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """dt_bias of value head i_hv at channels `cols` (0 past K, or without dt_bias)."""
    if HAS_DT_BIAS:
        return tl.load(dt_bias + i_hv * K + cols, mask=cols < K, other=0.0).to(tl.float32)
    else:
        return tl.zeros([cols.shape[0]], dtype=tl.float32)


@triton.jit
def slot_of(slot_of_seq, i_n, paged):
    """Sequence i_n's pool slot (int64; < 0: a padding sequence): slot_of_seq[i_n] when `paged` (a constexpr,
    or a run-time flag where one binary must serve both contracts), else i_n (the dense contract)."""
    slot = i_n.to(tl.int64)
    if paged != 0:
        slot = tl.load(slot_of_seq + i_n).to(tl.int64)
    return slot


# the error word's bits (`kda.ERROR_*`), as the kernels' constants
ERROR_SLOT = tl.constexpr(_SLOT)
ERROR_BOUNDS = tl.constexpr(_BOUNDS)
ERROR_ACCEPTED = tl.constexpr(_ACCEPTED)
ERROR_KEPT_SLOT = tl.constexpr(_KEPT_SLOT)


@triton.jit
def flag_errors(errors, i_n, code, HAS_ERRORS: tl.constexpr):
    """OR `code` (ERROR_* bits, 0: nothing) into the caller's error word of sequence i_n."""
    if HAS_ERRORS:
        if code != 0:
            tl.atomic_or(errors + i_n, code)


@triton.jit
def bad_bounds(eos):
    """Whether `seq_bounds` found the sequence's bounds out of range (it then gives eos = -1)."""
    return eos < 0


@triton.jit
def guard_slot(slot, n_slots, eos):
    """(slot, code) for a sequence whose pool slot is `slot` and whose `seq_bounds` end is `eos`: the slot a
    program may touch, -1 (padding: no access) where it is at or past the pool's n_slots or the bounds are
    out of range, and the ERROR_* bits of why (0 when it stands)."""
    code = tl.where(slot >= n_slots, ERROR_SLOT, 0) | tl.where(bad_bounds(eos), ERROR_BOUNDS, 0)
    return tl.where(code == 0, slot, -1), code


@triton.jit
def kept_item(cu_seqlens, i, N, SHORT: tl.constexpr, BT: tl.constexpr):
    """Item i (from 0) among the sequences whose length is not in 1..SHORT (those `kda.plan.Route`
    does not send to the recurrent loop), in order: with BT == 0 one item per such sequence (empty ones
    included: the walk's programs), else one per BT-token block of the longer ones (the chunk programs).
    Returns (its sequence, or -1 past the last item; the item's index within the sequence), by a scan of
    the bounds on the device, so that a grid needs only the host's count of the items."""
    seen = i * 0  # items in the windows before this one
    i_n = i * 0 - 1
    i_t = i * 0
    for j0 in range(0, N, 1024):
        j = j0 + tl.arange(0, 1024)
        ok = j < N
        # int32 lengths whatever cu_seqlens' dtype: the loop-carried count keeps one type
        n = (tl.load(cu_seqlens + j + 1, mask=ok, other=0) - tl.load(cu_seqlens + j, mask=ok, other=0)).to(tl.int32)
        if BT == 0:
            cnt = (ok & ((n < 1) | (n > SHORT))).to(tl.int32)
        else:
            cnt = tl.where(ok & (n > SHORT), (n + BT - 1) // BT, 0)
        end = tl.cumsum(cnt, 0) + seen
        hit = (cnt > 0) & (end > i) & (end - cnt <= i)
        i_n = tl.maximum(i_n, tl.max(tl.where(hit, j, -1), 0))
        i_t = tl.maximum(i_t, tl.max(tl.where(hit, i - (end - cnt), 0), 0))
        seen += tl.sum(cnt, 0)
    return i_n, i_t


@triton.jit
def chunk_program(i_n, bos, t, NT, IS_VARLEN: tl.constexpr, BT: tl.constexpr):
    """The chunk program (`locate_block`'s numbering of the full grid, where the chunk's gt row lives) of the
    chunk of sequence i_n that starts at token t."""
    if IS_VARLEN:
        p = bos // BT + i_n
    else:
        p = i_n.to(tl.int64) * NT
    return p + (t - bos) // BT


@triton.jit
def locate_block(i_p, cu_seqlens, N, T, NT, IS_VARLEN: tl.constexpr, BT: tl.constexpr):
    """Program i_p of a grid over blocks of BT tokens (chunks, or segments of chunks) -> (sequence,
    sequence start, first token of its block, sequence end). Dense: NT blocks per sequence. Varlen: program p belongs to the
    sequence n with f(n) <= p < f(n+1), f(n) = cu_seqlens[n] // BT + n, strictly increasing even across
    empty sequences, found by binary search; f(N) = T // BT + N bounds the grid, so no host copy of the
    bounds is needed. A program past its sequence's blocks gets t0 >= eos and does nothing."""
    if IS_VARLEN:
        lo = 0
        hi = N  # invariant: f(lo) <= i_p, answer in [lo, hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            f_mid = tl.load(cu_seqlens + mid).to(tl.int64) // BT + mid
            ok = f_mid <= i_p
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        i_n = lo
        bos, eos = seq_bounds(cu_seqlens, i_n, T, True)
        i_t = i_p - (bos // BT + i_n)
    else:
        i_n = i_p // NT
        i_t = i_p % NT
        bos, eos = seq_bounds(cu_seqlens, i_n, T, False)
    t0 = bos + i_t * BT
    t0 = tl.where(bad_bounds(eos) | (i_t < 0), eos, t0)  # no block: the caller's `t0 >= eos` returns
    return i_n, bos, t0, eos


def token_head_strides(x, T: int) -> tuple[int, int]:
    """(token stride, head stride) of a `[B, T, heads, ...]` tensor from one `stride()` call. The token
    stride is the one stride of the flattened [B*T] token axis: stride(1), or stride(0) when T == 1 (the
    contract then leaves stride(1) free, e.g. a [B, 1, ...] slice of a longer buffer)."""
    st = x.stride()
    return (st[1] if T > 1 else st[0]), st[2]
