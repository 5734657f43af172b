"""`fused_recurrent_kda`: the token-by-token kernel (decode and short sequences), one launch per call.
It must equal `kda_reference.recurrent_kda`.

Per value head, with the state S [K, V] (K-first view) and each token t of a sequence:

    S   <- Diag(2^g_t) S                  g_t: the log-decay in log2 units (`kda_gate_log2`)
    u_t  = beta_t (v_t - S^T k_t)
    S   <- S + k_t u_t^T
    o_t  = S^T (scale q_t)

with, when asked, q, k <- x / sqrt(sum x^2 + 1e-6), beta <- sigmoid(beta) and the in-kernel gate.

Tiling. Grid (cdiv(V, BV), N, HV): one program per (V block, sequence, value head). It keeps a
[BK, BV] fp32 slice of the state on chip (BK = next_pow2(K): the whole K range, because S^T k and
S^T q reduce over K) and walks the tokens of its sequence; q, k, g of a token are loaded once per
program, as full K vectors. Decode (one token per sequence) is bound by the state traffic (read once,
written once), so the program count must be large and every state access a wide contiguous one; the
register file bounds the programs an SM holds, so a program keeps about 64 state elements per thread
(`kda.plan.decode_plan`): V-first BV = 16 with one warp at K = 128 (8 KiB of fp32 state per program, 8
programs per head and sequence), BV = 8 for a 2-byte pool, K-first BV = 64 with 4 warps. Per token the two reductions over K
(S'^T k and S'^T q, with S' = Diag(2^g) S) are independent: o = S'^T q~ + (k . q~) u, which equals
S^T q~ after the update. When the tile covers the plane exactly (K = BK, BV | V) the state accesses
carry no mask. One-token calls (dense q [N, 1], or varlen whose host bounds `cu_seqlens_cpu` are
0, 1, ..., N) take `_fused_recurrent_one_token_kernel` instead: V-first pools the same arithmetic, NSUB state blocks
per program, all loaded before any is used; K-first pools one V block read once and held, the decay on the K-vectors
of the reductions (2-byte pools as 32-bit words of two columns, 16384 elements a program on NVIDIA: the
bytes a program keeps in flight, not the slot's round trip, bound it) (`kda.plan.decode_plan`).

Layout. The tile is kept in the orientation of the caller's plane, so that the contiguous dimension of
memory is the last (fastest) dimension of the tile and loads and stores vectorise:
- K-first planes [K, V] (`state_v_first=False`): tile [BK, BV], V contiguous;
- V-first planes [V, K] (`state_v_first=True`, the serving default): tile [BV, BK], K contiguous.
Only the reduction axis (`K_AXIS`) and the broadcasts of the K- and V-vectors change; the math is the
same. The state is addressed as a pool of dense planes (`kda.ops.common.StatePlan`): slot
`slot_of_seq[n]` (paged) or `n` (dense), slot stride `src_stride`/`dst_stride` (may exceed the plane:
a padded pool). Paged: slot < 0 is a padding sequence (no state read or write; its output rows are
written as zeros); `has_initial_state[n]` false starts from zeros without touching the slot (which may
hold NaN). Loads upcast to fp32; the store rounds to the storage dtype (round to nearest even), or
stochastically on request.

Stochastic rounding (`stochastic_rounding=True`, fp16/bf16 storage): the fp32 value x is rounded to one
of its two neighbours in the storage format, the one away from zero with probability equal to the
distance from the one toward zero in units of the storage ulp (unbiased in expectation, to 2^-13 of an
ulp for fp16). Each element takes 16 random bits (fp16 13): the top bits of its own fp32 bits times an odd key
hashed (`_mix32`) from `seed` and the plane (slot * HV + head) once a tile (`_sr_key`), so one seed and one input
always give the same bits. Over the key the bits are uniform whatever the value (a value whose dropped bits are not
all zero, times a random odd number, has uniform top bits), so each element is rounded without bias. Two operations
an element, a multiply and an add of its top bits: an offset hashed an element took more instructions and registers,
Philox (`tl.randint`) several times the whole step (docs/performance.md).
- bf16: add the 16 random bits below the kept mantissa and keep the top 16 bits (a carry into the exponent yields
  the next binade, or inf past the bf16 maximum);
- fp16: the same on x 2^-112 with 13 random bits (its top 19 bits are fp16's: the scaling maps fp16's
  subnormals onto fp32's, where the bits are the value's, so one integer form covers both ranges), then times
  2^112 (exact) and converted to nearest, which is exact; past the fp16 maximum the carry gives inf.
inf and NaN stay inf and NaN.

Bits. Round to nearest even into bf16 (state and output): the GPU's cast; under the interpreter, whose
cast truncates, explicit integer operations (`common.round_to`). Two calls give the same bits when they
compile to the same kernel variant with the same memory alignment: e.g. a paged pool and a dense state
(paged == dense bit for bit), or an fp32 and a narrow pool (the SR property test). A pool whose slot
stride is not a multiple of 16 elements gets scalar state accesses (Triton cannot prove 16-byte
alignment), its state tile another register layout, and the K sums another order: paged and dense then
agree to rounding, not bit for bit (measured on the H200 with stride plane + 7; tests/test_gpu.py
bounds it, docs/contract.md states the contract).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..contract import KDACall
from ..plan import DecodePlan, cdiv
from .buffers import StatePlan, gate_args, output_buffer, state_plan
from .common import (
    ERROR_ACCEPTED,
    ERROR_KEPT_SLOT,
    decay_rate,
    dt_bias_slice,
    flag_errors,
    guard_slot,
    kda_gate_log2,
    round_to,
    seq_bounds,
    slot_of,
    token_head_strides,
    zero_trailing_rows,
)
from .launch import direct
from .overlap import last_program_waits

# store modes of the state (constexpr SR, `kda.plan.SR_MODES`): 0 plain cast (round to nearest even),
# 1 stochastic bf16, 2 stochastic fp16
_F16_DOWN = tl.constexpr(2.0**-112)  # fp16's smallest normal (2^-14) onto fp32's (2^-126)
_F16_UP = tl.constexpr(2.0**112)


@triton.jit
def _on_k(x, V_FIRST: tl.constexpr):
    """Broadcast a [BK] vector along the K axis of the state tile ([BV, BK] if V_FIRST, else [BK, BV])."""
    if V_FIRST:
        y = x[None, :]
    else:
        y = x[:, None]
    return y


@triton.jit
def _on_v(x, V_FIRST: tl.constexpr):
    """Broadcast a [BV] vector along the V axis of the state tile."""
    if V_FIRST:
        y = x[:, None]
    else:
        y = x[None, :]
    return y


@triton.jit
def _mix32(x):
    """A bijection of uint32 whose every output bit depends on every input bit (two xor-shift-multiply
    rounds, the constants of C. Wellons' hash-prospector search)."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def _sr_key(seed, plane):
    """A 32-bit key hashed from seed and the state plane `plane` (slot * HV + head): scalar work once a tile."""
    s = seed.to(tl.int64)
    p = plane.to(tl.int64)
    key = _mix32((s & 0xFFFFFFFF).to(tl.uint32) ^ _mix32((p & 0xFFFFFFFF).to(tl.uint32)))
    key = _mix32(key ^ ((s >> 32) & 0xFFFFFFFF).to(tl.uint32) ^ _mix32(((p >> 32) & 0xFFFFFFFF).to(tl.uint32)))
    return key | 1


@triton.jit
def _sr_add(x, key, SHIFT: tl.constexpr):
    """The bits of fp32 `x` plus 32 - SHIFT random bits, the top ones of x's bits times the odd `key` (see the
    module docstring), added below the top SHIFT bits, which a truncation then keeps; NaN: the canonical NaN (whose
    sum would carry into the sign)."""
    b = x.to(tl.uint32, bitcast=True)
    return tl.where(x == x, b + ((b * key) >> SHIFT), 0x7FFFFFFF)


@triton.jit
def _round_f16(x, key):
    """fp32 tile -> fp32 values exactly representable in fp16, rounded stochastically: the bf16 form on x 2^-112
    (its top 19 bits are fp16's, subnormals included), kept, then times 2^112 (exact); inf past fp16's largest."""
    return (_sr_add(x * _F16_DOWN, key, 19) & 0xFFFFE000).to(tl.float32, bitcast=True) * _F16_UP


@triton.jit
def _tile(i_vb, BV: tl.constexpr, BK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, V_FIRST: tl.constexpr):
    """Offsets of V block `i_vb` (rows i_vb * BV ...) of a state plane, in the caller's orientation (the
    contiguous dimension of memory is the last dimension of the tile): (o_v, v_ok, tile_off, tile_ok)."""
    o_k = tl.arange(0, BK)
    o_v = i_vb * BV + tl.arange(0, BV)
    k_ok = o_k < K
    v_ok = o_v < V
    if V_FIRST:
        tile_off = o_v[:, None] * K + o_k[None, :]
        tile_ok = v_ok[:, None] & k_ok[None, :]
    else:
        tile_off = o_k[:, None] * V + o_v[None, :]
        tile_ok = k_ok[:, None] & v_ok[None, :]
    return o_v, v_ok, tile_off, tile_ok


@triton.jit
def _load_state(plane, tile_off, tile_ok, FULL_TILE: tl.constexpr):
    """The state tile in its storage dtype (upcast where it is used)."""
    if FULL_TILE:
        x = tl.load(plane + tile_off)
    else:
        x = tl.load(plane + tile_off, mask=tile_ok, other=0.0)
    return x


@triton.jit
def _store_state(S, plane, tile_off, tile_ok, plane_id, seed, SR: tl.constexpr, FULL_TILE: tl.constexpr,
                 EVICT_FIRST: tl.constexpr = False):
    """Round the fp32 tile to the storage dtype (nearest even, or stochastically when SR with the key
    `_sr_key(seed, plane_id)`) and store it (EVICT_FIRST: its lines marked first to leave L2)."""
    mask = None if FULL_TILE else tile_ok
    policy: tl.constexpr = "evict_first" if EVICT_FIRST else ""
    if SR == 1:  # the kept top halves are the bf16 bits
        y = (_sr_add(S, _sr_key(seed, plane_id), 16) >> 16).to(tl.uint16)
        tl.store(plane.to(tl.pointer_type(tl.uint16), bitcast=True) + tile_off, y, mask=mask, eviction_policy=policy)
    else:
        if SR == 2:  # then exact in fp16: the cast below rounds nothing
            S = _round_f16(S, _sr_key(seed, plane_id))
        tl.store(plane + tile_off, round_to(S, plane.dtype.element_ty), mask=mask, eviction_policy=policy)


@triton.jit
def _token_beta(b_t_ptr, USE_BETA_SIGMOID: tl.constexpr):
    """One token's beta (fp32)."""
    beta_t = tl.load(b_t_ptr).to(tl.float32)
    if USE_BETA_SIGMOID:
        beta_t = tl.sigmoid(beta_t)
    return beta_t


@triton.jit
def _token_gate(g_t, a, bias, lower_bound, BK: tl.constexpr, USE_GATE: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
                ROW: tl.constexpr = False):
    """One token's log2 decay over K from its raw g (`_k_vector`), computed on the vector as loaded, a K channel a
    lane, not on a tile's K slice, which repeats each channel on the lanes sharing its rows (docs/performance.md);
    ROW: on a [1, BK] row (the V-first loop: its slice repeats a channel on 2 lanes only, less than the conversion)."""
    if ROW:
        return tl.reshape(kda_gate_log2(g_t[None, :], a, bias, lower_bound, USE_GATE, USE_LOWER_BOUND), [BK])
    return kda_gate_log2(g_t, a, bias, lower_bound, USE_GATE, USE_LOWER_BOUND)


@triton.jit
def _k_vector(ptr, K: tl.constexpr, BK: tl.constexpr):
    """One token's [BK] vector over K in fp32 (zeros past K)."""
    o_k = tl.arange(0, BK)
    return tl.load(ptr + o_k, mask=o_k < K, other=0.0).to(tl.float32)


@triton.jit
def _token_qk(q_t, k_t, scale, USE_L2NORM: tl.constexpr):
    """(scale q~, k~) of one token's q and k, l2-normalised when asked."""
    if USE_L2NORM:
        q_t = q_t / tl.sqrt(tl.sum(q_t * q_t, 0) + 1e-6)
        k_t = k_t / tl.sqrt(tl.sum(k_t * k_t, 0) + 1e-6)
    return q_t * scale, k_t


@triton.jit
def _token_inputs(q_t_ptr, k_t_ptr, g_t_ptr, b_t_ptr, a, bias, scale, lower_bound,
                  K: tl.constexpr, BK: tl.constexpr, USE_GATE: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
                  USE_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr):
    """One token's inputs: (scale q~, k~, log2 decay g, beta), loaded from its pointers (`_token_values`); the held
    K-first forms take the gate first (`_held_inputs`)."""
    q_t = _k_vector(q_t_ptr, K, BK)
    k_t = _k_vector(k_t_ptr, K, BK)
    g_t = _k_vector(g_t_ptr, K, BK)
    beta_t = tl.load(b_t_ptr).to(tl.float32)
    return _token_values(q_t, k_t, g_t, beta_t, a, bias, scale, lower_bound, BK, USE_GATE, USE_LOWER_BOUND,
                         USE_L2NORM, USE_BETA_SIGMOID)


@triton.jit
def _raw_token(q_t_ptr, k_t_ptr, g_t_ptr, b_t_ptr, v_t_ptr, o_v, ok, K: tl.constexpr, V: tl.constexpr,
               BK: tl.constexpr):
    """One token's q, k, g over K, beta and v over the V block `o_v`, as stored, loaded where `ok` (else zeros).
    The masks compare against bounds zeroed where not `ok` (the interpreter's `&` of a scalar with a vector of
    booleans gives integers)."""
    o_k = tl.arange(0, BK)
    k_ok = o_k < tl.where(ok, K, 0)
    q_r = tl.load(q_t_ptr + o_k, mask=k_ok, other=0.0)
    k_r = tl.load(k_t_ptr + o_k, mask=k_ok, other=0.0)
    g_r = tl.load(g_t_ptr + o_k, mask=k_ok, other=0.0)
    b_r = tl.load(b_t_ptr, mask=ok, other=0.0)
    v_r = tl.load(v_t_ptr + o_v, mask=o_v < tl.where(ok, V, 0), other=0.0)
    return q_r, k_r, g_r, b_r, v_r


@triton.jit
def _token_values(q_t, k_t, g_t, beta_t, a, bias, scale, lower_bound, BK: tl.constexpr, USE_GATE: tl.constexpr,
                  USE_LOWER_BOUND: tl.constexpr, USE_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
                  GATE_ROW: tl.constexpr = False):
    """(scale q~, k~, log2 decay g, beta) from one token's loaded q, k, g and beta (any dtype)."""
    q_t, k_t = _token_qk(q_t.to(tl.float32), k_t.to(tl.float32), scale, USE_L2NORM)
    g_t = g_t.to(tl.float32)
    beta_t = beta_t.to(tl.float32)
    if USE_BETA_SIGMOID:  # after the norms, not in `_token_beta` before them: the loop kernel 167 registers, not 187
        beta_t = tl.sigmoid(beta_t)
    return q_t, k_t, _token_gate(g_t, a, bias, lower_bound, BK, USE_GATE, USE_LOWER_BOUND, GATE_ROW), beta_t


@triton.jit
def _step(S, q_t, k_t, g_t, v_t, beta_t, V_FIRST: tl.constexpr):
    """One token on an fp32 state tile: S' = Diag(2^g) S;  u = beta (v - S'^T k);  S <- S' + k u^T;
    o = S^T q~ = S'^T q~ + (k . q~) u (q~ already scaled). The two reductions over K read the same S' and
    are independent (a shorter dependent chain). Returns (S, o)."""
    if V_FIRST:
        K_AXIS: tl.constexpr = 1
    else:
        K_AXIS: tl.constexpr = 0
    k_b = _on_k(k_t, V_FIRST)
    S = S * _on_k(tl.exp2(g_t), V_FIRST)
    kS = tl.sum(S * k_b, K_AXIS)
    qS = tl.sum(S * _on_k(q_t, V_FIRST), K_AXIS)
    u_t = beta_t * (v_t - kS)
    o_t = qS + tl.sum(k_t * q_t, 0) * u_t
    S = S + k_b * _on_v(u_t, V_FIRST)
    return S, o_t


@triton.jit
def _first_state(src_plane, has_initial_state, i_n, i_vb, BV: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, HAS_SRC: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, V_FIRST: tl.constexpr,
                 FULL_TILE: tl.constexpr):
    """The initial state of V block i_vb in its storage dtype (zeros when there is none to read)."""
    _o_v, _v_ok, tile_off, tile_ok = _tile(i_vb, BV, BK, K, V, V_FIRST)
    S = tl.zeros_like(tile_off).to(src_plane.dtype.element_ty)
    if HAS_SRC:
        read = True
        if HAS_INIT_FLAGS:
            read = tl.load(has_initial_state + i_n) != 0
        if read:
            S = _load_state(src_plane, tile_off, tile_ok, FULL_TILE)
    return S


@direct
@triton.jit(do_not_specialize=["seed", "n_slots"])
def _fused_recurrent_kda_kernel(
    q, k, v, g, beta, o, A_log, dt_bias, cu_seqlens,
    state_src, state_dst, slot_of_seq, has_initial_state,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh, s_ot, s_oh,
    src_stride, dst_stride, n_slots, s_idx, idx_cols, num_accepted, errors,
    T, scale, lower_bound, seed,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, USE_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    HAS_SRC: tl.constexpr, HAS_DST: tl.constexpr, PAGED: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
    V_FIRST: tl.constexpr, SR: tl.constexpr, FULL_TILE: tl.constexpr,
    VERIFY: tl.constexpr = False, HAS_ACCEPTED: tl.constexpr = False, HAS_ERRORS: tl.constexpr = False,
    SHORT: tl.constexpr = 0, LAST_WAITS: tl.constexpr = False,
):
    """Any number of tokens per sequence (varlen, empty sequences): one program per (V block of BV rows,
    sequence, value head) walks its sequence's tokens.

    VERIFY (speculative verify; `state_indices` [N, T_max] as `slot_of_seq`, row stride `s_idx`): the
    state is read from the slot in column `num_accepted[n] - 1` (HAS_ACCEPTED) or 0 of row n (< 0: a
    padding sequence); after each token j it is rounded to the pool's dtype (as a one-token call's store
    rounds it, so the call equals its tokens decoded one call at a time) and stored to slot
    `slot_of_seq[n, j]` when that is >= 0. There is no final store then: the last token's slot is it.

    IS_VARLEN without SHORT (the kernel runs the whole call): the programs of sequence 0 (dispatched first) also
    zero the rows past the last bound, [cu_seqlens[N], T) (`zero_trailing_rows`); inside `chunk_kda` the walk
    does.

    LAST_WAITS (inside `chunk_kda`, launched after the walk): the grid's last program waits for the grid launched
    before it (`overlap.last_program_waits`), so that where a recorded call launches this kernel as the walk's
    programmatic dependent (`kda.replay`) it still ends after the walk."""
    i_v = tl.program_id(0)
    i_n = tl.program_id(1)
    i_hv = tl.program_id(2)
    i_h = i_hv // (HV // H)  # GVA: the q/k head of this value head
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    if IS_VARLEN and SHORT == 0:
        if i_n == 0:  # the rows past the last bound (padding for a CUDA graph): zeros
            o_tail = i_v * BV + tl.arange(0, BV)
            zero_trailing_rows(o + i_hv * s_oh, s_ot, cu_seqlens, tl.num_programs(1), T, o_tail, o_tail < V, 16, BV)
    if SHORT > 0:  # inside `chunk_kda`: only its sequences of 1..SHORT tokens (`kda.plan.Route`)
        if (eos - bos < 1) | (eos - bos > SHORT):
            last_program_waits(LAST_WAITS)
            return
    o_v, v_ok, tile_off, tile_ok = _tile(i_v, BV, BK, K, V, V_FIRST)

    if VERIFY:
        row = slot_of_seq + i_n.to(tl.int64) * s_idx  # this sequence's slots, one per token
        col = i_n.to(tl.int64) * 0
        if HAS_ACCEPTED:
            col = tl.load(num_accepted + i_n).to(tl.int64) - 1
        col_ok = (col >= 0) & (col < idx_cols)  # a count outside 1..T_max reads nothing: a no-op sequence
        slot = tl.where(col_ok, tl.load(row + tl.where(col_ok, col, 0)).to(tl.int64), -1)
        code = tl.where(col_ok, 0, ERROR_ACCEPTED)
    else:
        slot = slot_of(slot_of_seq, i_n, PAGED)
        code = 0
    # a slot past the pool, or bounds out of range (`seq_bounds`): a no-op sequence, never an access
    slot, guard_code = guard_slot(slot, n_slots, eos)
    code = code | guard_code
    first = (i_v == 0) & (i_hv == 0)  # one program of the sequence reports
    o_h = o + i_hv * s_oh
    if slot < 0:
        flag_errors(errors, i_n, tl.where(first, code, 0), HAS_ERRORS)
        # padding sequence: no read, no write of state; its output rows are zeros
        for t in range(bos, eos):
            tl.store(o_h + t * s_ot + o_v, tl.zeros([BV], dtype=o.dtype.element_ty), mask=v_ok)
        last_program_waits(LAST_WAITS)
        return

    S = _first_state(state_src + slot * src_stride + i_hv * (K * V), has_initial_state, i_n, i_v, BV, BK, K, V,
                     HAS_SRC, HAS_INIT_FLAGS, V_FIRST, FULL_TILE).to(tl.float32)
    a = decay_rate(A_log, i_hv, HAS_A_LOG)
    bias = dt_bias_slice(dt_bias, i_hv, tl.arange(0, BK), K, HAS_DT_BIAS)

    q_h = q + i_h * s_qh
    k_h = k + i_h * s_kh
    v_h = v + i_hv * s_vh
    g_h = g + i_hv * s_gh
    b_h = beta + i_hv * s_bh
    q_r, k_r, g_r, b_r, v_r = _raw_token(q_h + bos * s_qt, k_h + bos * s_kt, g_h + bos * s_gt, b_h + bos * s_bt,
                                         v_h + bos * s_vt, o_v, bos < eos, K, V, BK)
    for t in range(bos, eos):
        # the next token's inputs are in flight while this one's step runs (their load no longer waits a step)
        n = t + 1
        q_n, k_n, g_n, b_n, v_n = _raw_token(q_h + n * s_qt, k_h + n * s_kt, g_h + n * s_gt, b_h + n * s_bt,
                                             v_h + n * s_vt, o_v, n < eos, K, V, BK)
        q_t, k_t, g_t, beta_t = _token_values(q_r, k_r, g_r, b_r, a, bias, scale, lower_bound, BK, USE_GATE,
                                              USE_LOWER_BOUND, USE_L2NORM, USE_BETA_SIGMOID, V_FIRST)
        S, o_t = _step(S, q_t, k_t, g_t, v_r.to(tl.float32), beta_t, V_FIRST)
        q_r, k_r, g_r, b_r, v_r = q_n, k_n, g_n, b_n, v_n
        tl.store(o_h + t * s_ot + o_v, round_to(o_t, o.dtype.element_ty), mask=v_ok)
        if VERIFY:
            S = round_to(S, state_dst.dtype.element_ty).to(tl.float32)  # the state a decode call would store
            # tokens past the row (T_max shorter than the sequence) and slots past the pool keep nothing
            keep = tl.load(row + (t - bos), mask=(t - bos) < idx_cols, other=-1).to(tl.int64)
            code = code | tl.where(keep >= n_slots, ERROR_KEPT_SLOT, 0)
            if (keep >= 0) & (keep < n_slots):
                _store_state(S, state_dst + keep * dst_stride + i_hv * (K * V), tile_off, tile_ok,
                             keep * HV + i_hv, seed, SR, FULL_TILE)

    if HAS_DST:
        if not VERIFY:
            _store_state(S, state_dst + slot * dst_stride + i_hv * (K * V), tile_off, tile_ok,
                         slot * HV + i_hv, seed, SR, FULL_TILE)
    flag_errors(errors, i_n, tl.where(first, code, 0), HAS_ERRORS)
    last_program_waits(LAST_WAITS)


@triton.jit
def _one_token_rows(S_raw, i_vb, t, v_h, o_h, dst_plane, q_t, k_t, g_t, beta_t, slot, i_hv, seed, s_vt, s_ot,
                    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    HAS_DST: tl.constexpr, V_FIRST: tl.constexpr, SR: tl.constexpr, FULL_TILE: tl.constexpr):
    """`_fused_recurrent_one_token_kernel`'s work on V block i_vb, whose state `S_raw` was loaded (in its
    storage dtype) before any block was worked on."""
    o_v, v_ok, tile_off, tile_ok = _tile(i_vb, BV, BK, K, V, V_FIRST)
    v_t = tl.load(v_h + t * s_vt + o_v, mask=v_ok, other=0.0).to(tl.float32)
    S, o_t = _step(S_raw.to(tl.float32), q_t, k_t, g_t, v_t, beta_t, V_FIRST)
    tl.store(o_h + t * s_ot + o_v, round_to(o_t, o_h.dtype.element_ty), mask=v_ok)
    if HAS_DST:
        _store_state(S, dst_plane, tile_off, tile_ok, slot * HV + i_hv, seed, SR, FULL_TILE)


@triton.jit
def _one_token_k_rows(src_plane, read, q_h, k_h, g_h, dt_bias, i_hv, a, qn, kn, lower_bound, o_k0, o_v, v_ok,
                      K: tl.constexpr, V: tl.constexpr, KC: tl.constexpr, BV: tl.constexpr,
                      USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
                      HAS_SRC: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, FULL_TILE: tl.constexpr):
    """Rows o_k0 .. o_k0 + KC of a K-first state plane's V block: (S' = Diag(2^g) S on them in fp32, the
    token's scaled q~ and k~ on them, 2^g); S read unless there is none (zeros)."""
    o_k = o_k0 + tl.arange(0, KC)
    k_ok = o_k < K
    q_c = tl.load(q_h + o_k, mask=k_ok, other=0.0).to(tl.float32) * qn
    k_c = tl.load(k_h + o_k, mask=k_ok, other=0.0).to(tl.float32) * kn
    g_raw = tl.load(g_h + o_k, mask=k_ok, other=0.0)
    bias = dt_bias_slice(dt_bias, i_hv, o_k, K, HAS_DT_BIAS)
    d_c = tl.exp2(tl.reshape(kda_gate_log2(g_raw[None, :], a, bias, lower_bound, USE_GATE, USE_LOWER_BOUND), [KC]))
    tile_off = o_k[:, None] * V + o_v[None, :]
    S = tl.zeros([KC, BV], dtype=tl.float32)
    if HAS_SRC:
        if HAS_INIT_FLAGS:  # a mask, not a branch: a load under a branch is not pipelined
            ok = ((tile_off * 0 + read) != 0) & k_ok[:, None] & v_ok[None, :]
            S = tl.load(src_plane + tile_off, mask=ok, other=0.0).to(tl.float32)
        elif FULL_TILE:
            S = tl.load(src_plane + tile_off).to(tl.float32)
        else:
            S = tl.load(src_plane + tile_off, mask=k_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
    return S * d_c[:, None], q_c, k_c, tile_off, k_ok


@triton.jit
def _one_token_k_split(src_plane, read, dst_plane, q_h, k_h, g_h, dt_bias, a, scale, lower_bound, beta_t, v_t,
                       o_v, v_ok, slot, i_hv, seed, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, KC: tl.constexpr, BV: tl.constexpr,
                       USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
                       USE_L2NORM: tl.constexpr, HAS_SRC: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
                       HAS_DST: tl.constexpr, SR: tl.constexpr, FULL_TILE: tl.constexpr):
    """The one-token step on a K-first V block read in row chunks of KC, twice: the reductions over K
    (S'^T k, S'^T q) chunk by chunk, then the update and store chunk by chunk from a second read (from the
    caches). No chunk is held across the reductions, so a program keeps about KC / BK of the registers the
    whole tile takes. Returns o (the V block's output row)."""
    o_k = tl.arange(0, BK)
    k_ok = o_k < K
    qn = scale
    kn = 1.0
    q_t = tl.load(q_h + o_k, mask=k_ok, other=0.0).to(tl.float32)
    k_t = tl.load(k_h + o_k, mask=k_ok, other=0.0).to(tl.float32)
    if USE_L2NORM:
        qn = scale / tl.sqrt(tl.sum(q_t * q_t, 0) + 1e-6)
        kn = 1.0 / tl.sqrt(tl.sum(k_t * k_t, 0) + 1e-6)
    kq = tl.sum((k_t * kn) * (q_t * qn), 0)
    kS = tl.zeros([BV], dtype=tl.float32)
    qS = tl.zeros([BV], dtype=tl.float32)
    for o_k0 in tl.range(0, BK, KC, num_stages=3):
        S, q_c, k_c, _off, _ok = _one_token_k_rows(src_plane, read, q_h, k_h, g_h, dt_bias, i_hv, a, qn, kn,
                                                   lower_bound, o_k0, o_v, v_ok, K, V, KC, BV, USE_GATE,
                                                   HAS_DT_BIAS, USE_LOWER_BOUND, HAS_SRC, HAS_INIT_FLAGS, FULL_TILE)
        kS += tl.sum(S * k_c[:, None], 0)
        qS += tl.sum(S * q_c[:, None], 0)
    u_t = beta_t * (v_t - kS)
    if HAS_DST:
        for o_k0 in tl.range(0, BK, KC, num_stages=3):
            S, _q, k_c, tile_off, k_ok_c = _one_token_k_rows(src_plane, read, q_h, k_h, g_h, dt_bias, i_hv, a,
                                                             qn, kn, lower_bound, o_k0, o_v, v_ok, K, V, KC, BV,
                                                             USE_GATE, HAS_DT_BIAS, USE_LOWER_BOUND, HAS_SRC,
                                                             HAS_INIT_FLAGS, FULL_TILE)
            S = S + k_c[:, None] * u_t[None, :]
            # written lines leave L2 first, so that the chunks still awaiting their second read stay there
            _store_state(S, dst_plane, tile_off, k_ok_c[:, None] & v_ok[None, :],
                         slot * HV + i_hv, seed, SR, FULL_TILE, True)
    return qS + kq * u_t


@triton.jit
def _unpack_pairs(x, dtype: tl.constexpr):
    """A tile of 32-bit words, each two adjacent `dtype` values of a row (little-endian: the even column in the
    low half) -> (even columns, odd columns) in fp32. A bf16 is the high half of the fp32 it widens to; an fp16
    widens by one conversion a half."""
    if dtype == tl.bfloat16:
        lo = (x << 16).to(tl.float32, bitcast=True)
        hi = (x & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _pack_pairs(lo, hi, plane_id, seed, dtype: tl.constexpr, SR: tl.constexpr, PTX: tl.constexpr):
    """(even, odd) fp32 columns rounded to `dtype` (nearest even, or stochastically with the key
    `_sr_key(seed, plane_id)`) and packed into 32-bit words, the inverse of `_unpack_pairs`. PTX
    (`DecodePlan.ptx`): one conversion of both halves; else (HIP, the interpreter) the rounding of `round_to`."""
    if SR != 0:
        key = _sr_key(seed, plane_id)
    if SR == 2:  # then exact in fp16
        lo = _round_f16(lo, key)
        hi = _round_f16(hi, key)
    if SR == 1:  # the kept top halves are the bf16 bits: the words from them, no conversion
        y = (_sr_add(lo, key, 16) >> 16) | (_sr_add(hi, key, 16) & 0xFFFF0000)
    elif not PTX:
        y = (round_to(lo, dtype).to(tl.uint16, bitcast=True).to(tl.uint32)
             | (round_to(hi, dtype).to(tl.uint16, bitcast=True).to(tl.uint32) << 16))
    elif dtype == tl.bfloat16:  # one conversion of both halves (two single ones and a permute otherwise)
        y = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=tl.uint32,
                                      is_pure=True, pack=1)
    else:
        y = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=tl.uint32,
                                      is_pure=True, pack=1)
    return y


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _held_inputs(plane, read, tile_off, row_ok, col_ok, q_h, k_h, g_h, b_h, dt_bias, a, scale, lower_bound, i_hv,
                 dtype: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, USE_GATE: tl.constexpr,
                 HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, USE_L2NORM: tl.constexpr,
                 USE_BETA_SIGMOID: tl.constexpr, HAS_SRC: tl.constexpr, FULL_TILE: tl.constexpr,
                 EVICT_FIRST: tl.constexpr):
    """The token's beta, a K-first V block read once as `dtype` elements (zeros where there is no state to read;
    EVICT_FIRST: its lines marked first to leave L2), then the token's K-vectors, the gate first: (tile, 2^g, k~,
    2^g k~, 2^g scale q~, k~ . scale q~, beta), the decay riding on the reductions' vectors (S'^T k = S^T (2^g k)).
    In this order the fp32 form spills 16 bytes (24 in `_token_inputs`' order: 2.5% slower)."""
    beta_t = _token_beta(b_h, USE_BETA_SIGMOID)
    x = tl.zeros(tile_off.shape, dtype=dtype)
    if HAS_SRC:
        ok = (tile_off * 0 + read) != 0
        if not FULL_TILE:
            ok = ok & row_ok[:, None] & col_ok[None, :]
        x = tl.load(plane.to(tl.pointer_type(dtype), bitcast=True) + tile_off, mask=ok, other=0,
                    eviction_policy="evict_first" if EVICT_FIRST else "")
    bias = dt_bias_slice(dt_bias, i_hv, tl.arange(0, BK), K, HAS_DT_BIAS)
    q_t = _k_vector(q_h, K, BK)
    k_t = _k_vector(k_h, K, BK)
    d = tl.exp2(_token_gate(_k_vector(g_h, K, BK), a, bias, lower_bound, BK, USE_GATE, USE_LOWER_BOUND))
    q_t, k_t = _token_qk(q_t, k_t, scale, USE_L2NORM)
    return x, d, k_t, d * k_t, d * q_t, tl.sum(k_t * q_t, 0), beta_t


@triton.jit
def _one_token_k_held(src_plane, read, dst_plane, q_h, k_h, g_h, b_h, v_h, dt_bias, a, scale, lower_bound, i_vb,
                      i_hv, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
                      USE_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, HAS_SRC: tl.constexpr,
                      HAS_DST: tl.constexpr, FULL_TILE: tl.constexpr):
    """The one-token step on an fp32 K-first V block read once and held across the reductions over K. The decay
    rides on the K-vectors of the reductions (S'^T k = S^T (2^g k)), so no scaled copy of the held tile is formed;
    both sums in one reduction. Returns (o, o_v, v_ok)."""
    o_k = tl.arange(0, BK)
    k_ok = o_k < K
    o_v = i_vb * BV + tl.arange(0, BV)
    v_ok = o_v < V
    tile_off = o_k[:, None] * V + o_v[None, :]
    x, d, k_t, dk, dq, kq, beta_t = _held_inputs(src_plane, read, tile_off, k_ok, v_ok, q_h, k_h, g_h, b_h, dt_bias,
                                                 a, scale, lower_bound, i_hv, tl.float32, K, BK, USE_GATE,
                                                 HAS_DT_BIAS, USE_LOWER_BOUND, USE_L2NORM, USE_BETA_SIGMOID, HAS_SRC,
                                                 FULL_TILE, False)
    kS, qS = tl.reduce((x * dk[:, None], x * dq[:, None]), 0, _add2)
    u = beta_t * (tl.load(v_h + o_v, mask=v_ok, other=0.0).to(tl.float32) - kS)
    if HAS_DST:
        tl.store(dst_plane + tile_off, x * d[:, None] + k_t[:, None] * u[None, :],
                 mask=None if FULL_TILE else k_ok[:, None] & v_ok[None, :])
    return qS + kq * u, o_v, v_ok


@triton.jit
def _one_token_k_packed(src_plane, read, dst_plane, q_h, k_h, g_h, b_h, v_h, dt_bias, a, scale, lower_bound, i_vb,
                        slot, i_hv, seed, zero, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                        USE_LOWER_BOUND: tl.constexpr, USE_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
                        HAS_SRC: tl.constexpr, HAS_DST: tl.constexpr, SR: tl.constexpr, FULL_TILE: tl.constexpr,
                        PTX: tl.constexpr):
    """`_one_token_k_held` on a 2-byte K-first V block held as 32-bit words (two columns each): kept packed (half
    a register an element) across the reductions over K, unpacked again for the update. `zero` is a run-time 0:
    the second unpacking reads x ^ zero, so the compiler cannot reuse the first's fp32 values and keeps the
    packed tile instead (128 registers a thread instead of 96). The block's lines, read and written, are marked
    first to leave L2 (3.5% faster; the fp32 form is not: docs/performance.md). Returns (o even, o odd, word columns,
    their mask)."""
    BP: tl.constexpr = BV // 2
    VP: tl.constexpr = V // 2
    o_k = tl.arange(0, BK)
    k_ok = o_k < K
    o_p = i_vb * BP + tl.arange(0, BP)  # word columns: value columns 2 o_p and 2 o_p + 1
    p_ok = o_p < VP
    tile_off = o_k[:, None] * VP + o_p[None, :]
    x, d, k_t, dk, dq, kq, beta_t = _held_inputs(src_plane, read, tile_off, k_ok, p_ok, q_h, k_h, g_h, b_h, dt_bias,
                                                 a, scale, lower_bound, i_hv, tl.uint32, K, BK, USE_GATE,
                                                 HAS_DT_BIAS, USE_LOWER_BOUND, USE_L2NORM, USE_BETA_SIGMOID, HAS_SRC,
                                                 FULL_TILE, True)
    lo, hi = _unpack_pairs(x, src_plane.dtype.element_ty)
    # the four sums over K in one reduction (one exchange between warps instead of four)
    kS_lo, kS_hi, qS_lo, qS_hi = tl.reduce((lo * dk[:, None], hi * dk[:, None], lo * dq[:, None], hi * dq[:, None]),
                                           0, _add4)
    u_lo = beta_t * (tl.load(v_h + 2 * o_p, mask=p_ok, other=0.0).to(tl.float32) - kS_lo)
    u_hi = beta_t * (tl.load(v_h + 2 * o_p + 1, mask=p_ok, other=0.0).to(tl.float32) - kS_hi)
    if HAS_DST:
        lo, hi = _unpack_pairs(x ^ zero, src_plane.dtype.element_ty)
        lo = lo * d[:, None] + k_t[:, None] * u_lo[None, :]
        hi = hi * d[:, None] + k_t[:, None] * u_hi[None, :]
        y = _pack_pairs(lo, hi, slot * HV + i_hv, seed, dst_plane.dtype.element_ty, SR, PTX)
        dst = dst_plane.to(tl.pointer_type(tl.uint32), bitcast=True)
        tl.store(dst + tile_off, y, mask=None if FULL_TILE else k_ok[:, None] & p_ok[None, :],
                 eviction_policy="evict_first")
    return qS_lo + kq * u_lo, qS_hi + kq * u_hi, o_p, p_ok


@direct
@triton.jit(do_not_specialize=["seed", "paged", "n_slots", "zero"])
def _fused_recurrent_one_token_kernel(
    q, k, v, g, beta, o, A_log, dt_bias,
    state_src, state_dst, slot_of_seq, has_initial_state,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh, s_ot, s_oh,
    src_stride, dst_stride, n_slots, errors,
    scale, lower_bound, seed, paged, zero,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NSUB: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, USE_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    HAS_SRC: tl.constexpr, HAS_DST: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
    V_FIRST: tl.constexpr, SR: tl.constexpr, FULL_TILE: tl.constexpr, HAS_ERRORS: tl.constexpr = False,
    KC: tl.constexpr = 0, HEADS_FASTEST: tl.constexpr = False, PACKED: tl.constexpr = False,
    PTX: tl.constexpr = False,
):
    """Exactly one token per sequence, token n for sequence n (`KDACall.one_token_per_seq`: dense q of shape
    [N, 1, H, K], or varlen [1, N, H, K] with host bounds 0, 1, ..., N; the flattened token axis is the
    same, so both run the same binary when their strides agree). One program per (group of
    NSUB V blocks of BV rows, sequence, value head): the NSUB state blocks are all loaded first, in their
    storage dtype, then worked on one after the other, so that a program keeps NSUB blocks of state
    reads in flight while only one block is held in fp32 (a 2-byte pool's loads take half the registers
    of the fp32 tile they become); the token's K-vectors (norms, gate) are computed once per program
    instead of once per block. NSUB is 1, 2 or 4.
    `paged` is a run-time argument (not specialised), so that a paged call and the dense call on the same
    planes run one compiled binary: with PAGED as a constexpr the two compilations ordered the arithmetic
    differently, and the compiler's mul+add contractions with it (the H200 showed their final states
    differing in the last bits)."""
    i_v = tl.program_id(0)
    if HEADS_FASTEST:  # the programs in flight read a slot's planes one after another (K-first pools: faster)
        i_hv = tl.program_id(1)
        i_n = tl.program_id(2)
    else:
        i_n = tl.program_id(1)
        i_hv = tl.program_id(2)
    i_h = i_hv // (HV // H)
    t = i_n  # dense, T = 1: token n is sequence n's only token
    i_vb = i_v * NSUB

    slot = slot_of(slot_of_seq, i_n, paged)  # a run-time flag: both contracts run the same binary
    # a slot past the pool: a no-op sequence, never an access (reported by one program of the sequence);
    # the bounds are the host's (token n is sequence n), so only the slot can be out of range
    slot, code = guard_slot(slot, n_slots, t + 1)
    flag_errors(errors, i_n, tl.where((i_v == 0) & (i_hv == 0), code, 0), HAS_ERRORS)
    o_h = o + i_hv * s_oh
    if slot < 0:
        o_v = i_vb * BV + tl.arange(0, NSUB * BV)
        tl.store(o_h + t * s_ot + o_v, tl.zeros([NSUB * BV], dtype=o.dtype.element_ty), mask=o_v < V)
        return

    src_plane = state_src + slot * src_stride + i_hv * (K * V)
    if PACKED or KC > 0:  # K-first, NSUB 1: has_initial_state's flag is a load mask there, not a branch
        read = 1
        if HAS_INIT_FLAGS:
            read = (tl.load(has_initial_state + i_n) != 0).to(tl.int32)
    if PACKED:  # the V block read once and held (`_one_token_k_held`; 2-byte as words, `_one_token_k_packed`)
        dst_plane = state_dst + slot * dst_stride + i_hv * (K * V)
        q_t = q + i_h * s_qh + t * s_qt
        k_t = k + i_h * s_kh + t * s_kt
        g_t = g + i_hv * s_gh + t * s_gt
        b_t = beta + i_hv * s_bh + t * s_bt
        v_t = v + i_hv * s_vh + t * s_vt
        a = decay_rate(A_log, i_hv, HAS_A_LOG)
        if state_src.dtype.element_ty != tl.float32:
            o_lo, o_hi, o_p, p_ok = _one_token_k_packed(
                src_plane, read, dst_plane, q_t, k_t, g_t, b_t, v_t, dt_bias, a, scale, lower_bound, i_vb, slot,
                i_hv, seed, zero, HV, K, V, BK, BV, USE_GATE, HAS_DT_BIAS, USE_LOWER_BOUND, USE_L2NORM,
                USE_BETA_SIGMOID, HAS_SRC, HAS_DST, SR, FULL_TILE, PTX)
            tl.store(o_h + t * s_ot + 2 * o_p, round_to(o_lo, o_h.dtype.element_ty), mask=p_ok)
            tl.store(o_h + t * s_ot + 2 * o_p + 1, round_to(o_hi, o_h.dtype.element_ty), mask=p_ok)
        else:
            o_row, o_v, v_ok = _one_token_k_held(
                src_plane, read, dst_plane, q_t, k_t, g_t, b_t, v_t, dt_bias, a, scale, lower_bound, i_vb, i_hv,
                K, V, BK, BV, USE_GATE, HAS_DT_BIAS, USE_LOWER_BOUND, USE_L2NORM, USE_BETA_SIGMOID, HAS_SRC,
                HAS_DST, FULL_TILE)
            tl.store(o_h + t * s_ot + o_v, round_to(o_row, o_h.dtype.element_ty), mask=v_ok)
        return
    if KC > 0:  # the V block in row chunks (`_one_token_k_split`)
        o_v = i_vb * BV + tl.arange(0, BV)
        v_ok = o_v < V
        v_t = tl.load(v + i_hv * s_vh + t * s_vt + o_v, mask=v_ok, other=0.0).to(tl.float32)
        beta_t = tl.load(beta + i_hv * s_bh + t * s_bt).to(tl.float32)
        if USE_BETA_SIGMOID:
            beta_t = tl.sigmoid(beta_t)
        o_t = _one_token_k_split(src_plane, read, state_dst + slot * dst_stride + i_hv * (K * V),
                                 q + i_h * s_qh + t * s_qt, k + i_h * s_kh + t * s_kt, g + i_hv * s_gh + t * s_gt,
                                 dt_bias, decay_rate(A_log, i_hv, HAS_A_LOG), scale, lower_bound,
                                 beta_t, v_t, o_v, v_ok, slot, i_hv, seed, HV, K, V, BK, KC, BV, USE_GATE,
                                 HAS_DT_BIAS, USE_LOWER_BOUND, USE_L2NORM, HAS_SRC, HAS_INIT_FLAGS, HAS_DST, SR,
                                 FULL_TILE)
        tl.store(o_h + t * s_ot + o_v, round_to(o_t, o_h.dtype.element_ty), mask=v_ok)
        return
    S0 = _first_state(src_plane, has_initial_state, i_n, i_vb, BV, BK, K, V, HAS_SRC, HAS_INIT_FLAGS, V_FIRST,
                      FULL_TILE)
    if NSUB >= 2:
        S1 = _first_state(src_plane, has_initial_state, i_n, i_vb + 1, BV, BK, K, V, HAS_SRC, HAS_INIT_FLAGS,
                          V_FIRST, FULL_TILE)
    if NSUB >= 4:
        S2 = _first_state(src_plane, has_initial_state, i_n, i_vb + 2, BV, BK, K, V, HAS_SRC, HAS_INIT_FLAGS,
                          V_FIRST, FULL_TILE)
        S3 = _first_state(src_plane, has_initial_state, i_n, i_vb + 3, BV, BK, K, V, HAS_SRC, HAS_INIT_FLAGS,
                          V_FIRST, FULL_TILE)

    a = decay_rate(A_log, i_hv, HAS_A_LOG)
    bias = dt_bias_slice(dt_bias, i_hv, tl.arange(0, BK), K, HAS_DT_BIAS)
    q_t, k_t, g_t, beta_t = _token_inputs(q + i_h * s_qh + t * s_qt, k + i_h * s_kh + t * s_kt,
                                          g + i_hv * s_gh + t * s_gt, beta + i_hv * s_bh + t * s_bt,
                                          a, bias, scale, lower_bound, K, BK, USE_GATE, USE_LOWER_BOUND,
                                          USE_L2NORM, USE_BETA_SIGMOID)
    v_h = v + i_hv * s_vh
    dst_plane = state_dst + slot * dst_stride + i_hv * (K * V)
    _one_token_rows(S0, i_vb, t, v_h, o_h, dst_plane, q_t, k_t, g_t, beta_t, slot, i_hv, seed, s_vt, s_ot,
                    HV, K, V, BK, BV, HAS_DST, V_FIRST, SR, FULL_TILE)
    if NSUB >= 2:
        _one_token_rows(S1, i_vb + 1, t, v_h, o_h, dst_plane, q_t, k_t, g_t, beta_t, slot, i_hv, seed, s_vt,
                        s_ot, HV, K, V, BK, BV, HAS_DST, V_FIRST, SR, FULL_TILE)
    if NSUB >= 4:
        _one_token_rows(S2, i_vb + 2, t, v_h, o_h, dst_plane, q_t, k_t, g_t, beta_t, slot, i_hv, seed, s_vt,
                        s_ot, HV, K, V, BK, BV, HAS_DST, V_FIRST, SR, FULL_TILE)
        _one_token_rows(S3, i_vb + 3, t, v_h, o_h, dst_plane, q_t, k_t, g_t, beta_t, slot, i_hv, seed, s_vt,
                        s_ot, HV, K, V, BK, BV, HAS_DST, V_FIRST, SR, FULL_TILE)


@direct
@triton.jit
def _zero_trailing_kernel(o, cu_seqlens, s_ot, s_oh, T, V: tl.constexpr, BV: tl.constexpr):
    """A varlen call without sequences (N == 0, T > 0): every row from cu_seqlens[0] on lies past the last
    bound and is zero. Grid (V blocks, heads)."""
    o_v = tl.program_id(0) * BV + tl.arange(0, BV)
    zero_trailing_rows(o + tl.program_id(1) * s_oh, s_ot, cu_seqlens, 0, T, o_v, o_v < V, 16, BV)


def fused_recurrent_kda_fwd(
    call: KDACall, plan: DecodePlan, *, seed: int = 0,
    short: int = 0, o: torch.Tensor | None = None, st: StatePlan | None = None, last_waits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run a validated call (`kda.contract.check_call`) as planned (`kda.plan.decode_plan`). Returns
    (o, final_state); final_state is None for the paged contract (the pool is written in place) and when no
    final state was asked for. `short` > 0 (from `chunk_kda_fwd`, with its `o` and state plan `st`): the
    loop kernel takes only the sequences of 1..short tokens, the chunk kernels the others (never with the
    one-token plan: a call whose sequences all hold one token comes here whole); `last_waits`: launched after
    the walk, the loop kernel's LAST_WAITS."""
    o = output_buffer(call) if o is None else o
    st = state_plan(call) if st is None else st
    N = call.N
    if N == 0:
        if call.cu_seqlens is not None and call.T > 0:  # no program to zero the rows past the last bound
            BV = min(64, max(16, triton.next_power_of_2(call.V)))
            _zero_trailing_kernel[(cdiv(call.V, BV), call.HV)](o, call.cu_seqlens, *token_head_strides(o, call.T),
                                                               call.T, V=call.V, BV=BV)
        return o, st.final_state
    T, H, HV, K, V = call.T, call.H, call.HV, call.K, call.V
    varlen = call.cu_seqlens is not None
    q, k, v, g, beta = call.q, call.k, call.v, call.g, call.beta
    A_log, dt_bias, lower_bound = gate_args(call)
    BK, BV = plan.BK, plan.BV
    errors = call.errors if call.errors is not None else q  # q: a stand-in never written (HAS_ERRORS off)
    strides = (*token_head_strides(q, T), *token_head_strides(k, T), *token_head_strides(v, T),
               *token_head_strides(g, T), *token_head_strides(beta, T), *token_head_strides(o, T),
               st.src_stride, st.dst_stride)
    if call.verify:  # speculative verify: state_indices [N, T_max] and its row stride
        accepted = call.num_accepted_tokens
        idx = call.state_indices
        verify_args = (idx.stride(0), idx.shape[1], q if accepted is None else accepted)
        verify_flags = dict(VERIFY=True, HAS_ACCEPTED=accepted is not None)
    else:
        verify_args, verify_flags = (0, 0, q), {}
    flags = dict(
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        USE_GATE=call.use_gate_in_kernel, HAS_A_LOG=call.A_log is not None,
        HAS_DT_BIAS=call.dt_bias is not None, USE_LOWER_BOUND=call.lower_bound is not None,
        USE_L2NORM=call.use_qk_l2norm_in_kernel, USE_BETA_SIGMOID=call.use_beta_sigmoid_in_kernel,
        HAS_SRC=st.src is not None, HAS_DST=st.dst is not None,
        HAS_INIT_FLAGS=st.has_initial_state is not None, V_FIRST=call.state_v_first, SR=plan.sr,
        HAS_ERRORS=call.errors is not None, num_warps=plan.num_warps,
    )
    cap = {"maxnreg": plan.maxnreg} if plan.maxnreg else {}  # NVIDIA only: the plan refuses it elsewhere
    if plan.nsub > 0:  # one token per sequence at token n (dense [N, 1], or varlen with host bounds 0..N)
        rows = BV * plan.nsub
        # 2-byte words need V even (rows and head planes start on words) and 4-byte aligned pools, else the row
        # chunks
        packed = plan.packed and (call.state_dtype == torch.float32 or (
            V % 2 == 0 and all(
                s is None or (s.stride(0) % 2 == 0 and s.data_ptr() % 4 == 0) for s in (st.src, st.dst))))
        grid = (cdiv(V, rows), HV, N) if plan.heads_fastest else (cdiv(V, rows), N, HV)
        _fused_recurrent_one_token_kernel[grid](
            q, k, v, g, beta, o, A_log, dt_bias, *st.pointers(q), *strides, st.slot_count, errors, call.scale,
            lower_bound, seed,
            int(st.paged), 0, NSUB=plan.nsub, FULL_TILE=(K == BK and V % rows == 0), KC=plan.kc,
            HEADS_FASTEST=plan.heads_fastest, PACKED=packed, PTX=plan.ptx,
            **(dict(flags, **cap) if packed == plan.packed else dict(flags, num_warps=1)),  # the row chunks: 1 warp
        )
    else:
        _fused_recurrent_kda_kernel[(cdiv(V, BV), N, HV)](
            q, k, v, g, beta, o, A_log, dt_bias, call.cu_seqlens if varlen else q, *st.pointers(q), *strides,
            st.slot_count, *verify_args, errors, T, call.scale, lower_bound, seed,
            IS_VARLEN=varlen, PAGED=st.paged, FULL_TILE=(K == BK and V % BV == 0), **flags, **verify_flags,
            SHORT=short, LAST_WAITS=last_waits, **cap,
        )
    return o, st.final_state
