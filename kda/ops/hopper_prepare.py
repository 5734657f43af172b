"""The fused prepare of `chunk_kda` for Hopper (sm_90), in Gluon: the same stage as `chunk_prepare._chunk_prepare_kernel`
(its `tl` twin, which the CPU tests hold to the oracle and every other device runs), for the plans `kda.plan` gives it
(`ChunkPlan.prepare == "hopper"`: Kimi's bounded gate with 16-bit inputs, no gate pass, fp16 workspaces, K = 128,
16-byte aligned token strides for the asynchronous copies). Imported only when a plan picks it, so `import kda` never
needs Gluon.

How it differs from the twin (one program per (chunk, value head), one warpgroup of 4 warps):
- The chunk's k, q and v are copied into shared memory asynchronously as the program starts (`_issue_copies`), and
  while they come the program forms b2 itself from the raw gate (`_chunk_b2`: a thread a channel, the scan in its
  registers) into shared memory, with the walk's gt: no gate pass before it (the twin either reads b2 from
  `_chunk_gate_kernel` or scans it per K slice across its warps). The anchor rows are rows of that tile.
- Every K-loop operand is formed in the registers the tensor cores read it from (`_as_operand`: warpgroup_mma's
  register A operand), each B tile stored to shared memory once; the twin's `tl.dot` goes through shared memory.
- A_kk's (and A_qk's) diagonal quadrants in one tf32 product per K slice (every row at its half's middle row against
  all of the chunk; the off-diagonal quadrants overflow and are dropped), the lower-left quadrant at the middle
  row's anchor in fp16 into [BT, 32] accumulators (the twin's X_kk, X_qk).
- Asynchronous tensor-core products: A_kk's run while A_qk's operands are formed, A_qk's while Qd, Kd (and Kr) are
  stored.
- Kr kept in shared memory in fp16 (the dtype the twin parks it in, in M's rows of global memory) until M is formed,
  and the fold's two products in fp16 with Xb times a power of two (its tf32-rounded entries fit fp16's significand
  exactly; only entries 2^-29 below the largest lose bits).
The inverse of I + A_kk is the twin's (`_unit_lower_inverse_t`): the 4 x 4 diagonal blocks by their series, then four
block merges, every product in tf32 with operands rounded to nearest; a chunk of one token stores its rows exactly
(`_one_row_chunk`), as the twin's does. The norms pass, the K loop, the series and the merges run as loops, not
unrolled (b2 and its anchor rows held a K slice a leading index): 4.75 K instructions instead of 8.3 K.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .common import LOG2E, bad_bounds, chunk_program, locate_block, seq_bounds
from .launch import direct


@gluon.jit
def _tf32(x):
    """fp32 `x` rounded to nearest even at tf32's significand: sm_90's one conversion instruction (`common.tf32_round`
    rounds ties away from zero in two)."""
    return gl.inline_asm_elementwise("cvt.rn.tf32.f32 $0, $1;", "=r,f", [x], dtype=gl.int32, is_pure=True,
                                     pack=1).to(gl.float32, bitcast=True)


@gluon.jit
def _div(c, x):
    """c / x as c times 1 / x to an ulp (`rcp.approx.ftz`: the one MUFU instruction of `gl.fdiv`'s approximate
    division, without its scaling for |x| > 2^126, where the gate is 0 either way), the product rounded inside the
    asm: a multiply the compiler sees fuses into the gate scan's first addition where it knows row 0 valid (the varlen
    form, not the dense one), and a sequence's bits would follow the batch."""
    return gl.inline_asm_elementwise("{ .reg .f32 r; rcp.approx.ftz.f32 r, $2; mul.rn.f32 $0, $1, r; }", "=f,f,f",
                                     [c, x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _flat(x, L: gl.constexpr):
    """A [2, n, m] tile (the chunk's halves leading) as the [2 n, m] tile of layout L (no data moves)."""
    return gl.convert_layout(gl.reshape(x, [x.shape[0] * x.shape[1], x.shape[2]]), L)


@gluon.jit
def _on_halves(v, rows: gl.constexpr, L3: gl.constexpr, L: gl.constexpr):
    """A [2, n] vector (each half's) broadcast over its half's `rows` rows: the [2 rows, n] tile of layout L."""
    return _flat(gl.expand_dims(v, 1) + gl.zeros([2, rows, v.shape[1]], gl.float32, layout=L3), L)


@gluon.jit
def _max_u16x2(a, b):
    """The larger of each pair of 16-bit halves of `a` and `b` (unsigned): one VIMNMX.U16x2."""
    return gl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _pow2_of(m):
    """A power of two p with m p in [2^14, 2^15) (`common.pow2_of`)."""
    e = (m.to(gl.int32, bitcast=True) >> 23) & 0xFF
    return (gl.minimum(gl.maximum(268 - e, 1), 253) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _mma(a, b_smem, layout: gl.constexpr, acc_layout: gl.constexpr, M: gl.constexpr, N: gl.constexpr):
    """a @ b for a register tile `a` (converted to `layout`, the A operand of `acc_layout`) and a shared-memory
    operand, waited for."""
    acc = gl.zeros([M, N], gl.float32, layout=acc_layout)
    return warpgroup_mma(gl.convert_layout(a, layout), b_smem, acc, use_acc=False)



@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _kept_chunk(cu_seqlens, i, N, SHORT: gl.constexpr, BT: gl.constexpr):
    """`common.kept_item` for chunk programs: (sequence, or -1 past the last; chunk index in it) of item i among
    the BT-token chunks of the sequences longer than SHORT, by a scan of the bounds."""
    L1: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
    seen = i * 0
    i_n = i * 0 - 1
    i_t = i * 0
    for j0 in range(0, N, 1024):
        j = j0 + gl.arange(0, 1024, layout=L1)
        ok = j < N
        n = (gl.load(cu_seqlens + j + 1, mask=ok, other=0) - gl.load(cu_seqlens + j, mask=ok, other=0)).to(gl.int32)
        cnt = gl.where(ok & (n > SHORT), (n + BT - 1) // BT, 0)
        end = gl.associative_scan(cnt, 0, _add) + seen
        hit = (cnt > 0) & (end > i) & (end - cnt <= i)
        i_n = gl.maximum(i_n, gl.max(gl.where(hit, j, -1), 0))
        i_t = gl.maximum(i_t, gl.max(gl.where(hit, i - (end - cnt), 0), 0))
        seen += gl.sum(cnt, 0)
    return i_n, i_t


@gluon.jit
def _locate(i_p, cu_seqlens, N, T, NT, IS_VARLEN: gl.constexpr, BT: gl.constexpr, SHORT: gl.constexpr):
    """`chunk_prepare._locate_chunk` (the scalar helpers are the twin's own `tl` functions; the routed scan needs a
    layout): (sequence, the chunk's first token, the sequence's end, the chunk's program in the full grid) of chunk
    program i_p; t0 >= eos where there is no chunk."""
    if SHORT > 0:
        i_n, i_t = _kept_chunk(cu_seqlens, i_p, N, SHORT, BT)
        bos, eos = seq_bounds(cu_seqlens, gl.maximum(i_n, 0), T, True)
        t0 = gl.where((i_n < 0) | bad_bounds(eos), eos, bos + i_t * BT)
        p = chunk_program(i_n, bos, t0, NT, True, BT)
    else:
        i_n, _, t0, eos = locate_block(i_p, cu_seqlens, N, T, NT, IS_VARLEN, BT)
        p = i_p
    return i_n, t0, eos, p


@gluon.jit
def _one_row_chunk(q_h, k_h, anc_s, PA: gl.constexpr, PC: gl.constexpr, qd_ws, kd_ws, m_ws, n_ws, x_ws, sc,
                   ws_base, n_base, rk, rq, b_beta, o_t, o_c, K: gl.constexpr, BK: gl.constexpr, FOLD: gl.constexpr):
    """`chunk_prepare._one_row_chunk` (fp16 workspaces, b2 from row 4 of `anc_s`): a chunk of one token stores its rows
    without a product, exact in fp32 (A_kk = 0, X = I, Xb = beta)."""
    first = o_t == 0
    rk0 = gl.sum(gl.where(first, rk, 0.0), 0)
    rq0 = gl.sum(gl.where(first, rq, 0.0), 0)
    beta0 = gl.sum(gl.where(first, b_beta, 0.0), 0)
    pm = _pow2_of(gl.abs(beta0))
    m_row = beta0 * pm
    if not FOLD:
        m_row = 1.0  # M's rows hold Kr: k~
    aqk = 0.0
    for s in gl.static_range(K // BK):
        cols = s * BK + o_c
        kn = gl.load(k_h + cols).to(gl.float32) * rk0
        qn = gl.load(q_h + cols).to(gl.float32) * rq0
        d = gl.exp2(_anchor_row(anc_s.index(s), 4, PA, PC))
        gl.store(qd_ws + ws_base + cols, (qn * d).to(gl.float16))
        gl.store(kd_ws + ws_base + cols, (kn * d).to(gl.float16))
        gl.store(m_ws + ws_base + cols, (kn * m_row).to(gl.float16))
        aqk += gl.sum(qn * kn, 0)
    if FOLD:
        n00 = aqk * beta0
        pn = _pow2_of(gl.abs(n00))
        gl.store(n_ws + n_base + o_t, gl.where(first, n00 * pn, 0.0).to(gl.float16))
        gl.store(sc, 1.0 / pm)
        gl.store(sc + 1, 1.0 / pn)
    else:  # A_qk's row [scale q~.k~, 0, ...], Xb = [[beta]] times px = pm
        gl.store(n_ws + n_base + o_t, gl.where(first, aqk, 0.0).to(gl.float16))
        gl.store(x_ws + n_base + o_t, gl.where(first, beta0 * pm, 0.0).to(gl.float16))
        gl.store(sc, 1.0 / pm)
        gl.store(sc + 1, gl.abs(beta0))


@gluon.jit
def _count_chunk(ready, i_n, t0, T, NT, i_p, i_hv, N, HV: gl.constexpr, BT: gl.constexpr, W: gl.constexpr,
                 LAST_WAITS: gl.constexpr):
    """`chunk_prepare._count_chunk` and `_finish`: the chunk counted into its group's counter (release, after a
    barrier), and the grid's last program waiting for the grid it was launched after."""
    gl.thread_barrier()  # every thread's stores before the count
    cnt = ready + (i_n * gl.cdiv(NT, W) + ((t0 - i_n.to(gl.int64) * T) // BT) // W) * HV + i_hv
    gl.atomic_add(cnt, 1, sem="release", scope="gpu")
    if LAST_WAITS:
        if (i_p == N * NT - 1) & (i_hv == HV - 1):
            gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)


# Every K-loop operand formed in the registers of the tensor-core operand. A thread of the kernel's
# layout P holds 8 consecutive channels of 2 rows: the tf32 (and the fp16) A operand's registers with a K slice's
# channels in another order (`_as_operand`); a product sums over the channels, so A and B in one order give the same sums.
@gluon.jit
def _as_operand(x, A: gl.constexpr):
    """A [BT, 32] tile of layout P (channel 8 t + j at lane t, register j) as the same registers in layout A, the
    channels in the order 4 j + t (no data moves)."""
    n: gl.constexpr = x.shape[0]
    return gl.convert_layout(gl.reshape(gl.permute(gl.reshape(x, [n, 4, 8]), (0, 2, 1)), [n, 32]), A)


@gluon.jit
def _k_order(x, dim: gl.constexpr):
    """`x` ([BT, BT]) with its index along `dim` reordered within blocks of 8: index 8 a + 4 j + q takes x's
    8 a + 2 q + j. A tf32 wgmma accumulator holds columns 2 q + j of each 8 at lane q, register j, where the
    register A operand wants k = q + 4 j: reordered along k (the B operand's rows likewise), the accumulator's
    registers are the operand's, and the product is unchanged (no data moves)."""
    n: gl.constexpr = x.shape[0]
    if dim == 1:
        x = gl.reshape(gl.permute(gl.reshape(x, [n, n // 8, 4, 2]), (0, 1, 3, 2)), [n, n])
    else:
        x = gl.reshape(gl.permute(gl.reshape(x, [n // 8, 4, 2, n]), (0, 2, 1, 3)), [n, n])
    return x


@gluon.jit
def _as_operand16(x, A: gl.constexpr):
    """`_as_operand` for an fp16 A operand (k_width 2): channel 8 t + j in the order 16 j2 + 8 j1 + 4 t1 + 2 t0 + j0."""
    n: gl.constexpr = x.shape[0]
    x = gl.permute(gl.reshape(x, [n, 2, 2, 2, 2, 2]), (0, 3, 4, 1, 2, 5))
    return gl.convert_layout(gl.reshape(x, [n, 32]), A)


@gluon.jit
def _anchor_row(a_t, i: gl.constexpr, PA: gl.constexpr, PC: gl.constexpr):
    """Row i of the anchor tile `a_t` as a column vector of layout P (two 16-byte loads a thread)."""
    return gl.convert_layout(gl.reshape(a_t.slice(i, 1).load(PA), [a_t.shape[1]]), PC)


@gluon.jit
def _cat_acc(lo, hi, L: gl.constexpr):
    """The [BT, 2n] tile [lo, hi] of two [BT, n] accumulators, in the accumulator layout of width 2n (registers
    renamed, no data moves)."""
    n: gl.constexpr = lo.shape[0]
    m: gl.constexpr = lo.shape[1]
    return gl.convert_layout(gl.reshape(gl.permute(gl.join(lo, hi), (0, 2, 1)), [n, 2 * m]), L)


@gluon.jit
def _issue_copies(k_s, q_s, v_s, k_h, q_h, v_h, s_kt, s_qt, s_vt, n_rows, K: gl.constexpr, V: gl.constexpr,
                  BT: gl.constexpr, BK: gl.constexpr, CP: gl.constexpr):
    """The chunk's k, q and v copied into shared memory asynchronously, one group; rows past the sequence zero."""
    NKS: gl.constexpr = K // BK
    NV: gl.constexpr = (V + BK - 1) // BK
    o_t = gl.arange(0, BT, layout=gl.SliceLayout(1, CP))
    o_c = gl.arange(0, BK, layout=gl.SliceLayout(0, CP))
    m_rows = (o_t < n_rows)[:, None]
    for s in gl.static_range(NKS):
        cols = s * BK + o_c
        async_copy.async_copy_global_to_shared(k_s.index(s), k_h + o_t[:, None] * s_kt + cols[None, :], mask=m_rows)
        async_copy.async_copy_global_to_shared(q_s.index(s), q_h + o_t[:, None] * s_qt + cols[None, :], mask=m_rows)
    for s in gl.static_range(NV):
        cols = s * BK + o_c
        async_copy.async_copy_global_to_shared(v_s.index(s), v_h + o_t[:, None] * s_vt + cols[None, :],
                                               mask=m_rows & (cols < V)[None, :])
    async_copy.commit_group()


@gluon.jit
def _issue_gate_copy(g_s, g_h, s_gt, n_rows, bias_s, bias_h, K: gl.constexpr, BT: gl.constexpr, CG: gl.constexpr,
                     BIAS_COPY: gl.constexpr):
    """The chunk's raw gate copied into `g_s` asynchronously, a group of its own (committed before the inputs'
    group, so `_chunk_b2` waits for it alone); rows past the sequence zero. BIAS_COPY: the head's fp32 dt_bias into
    `bias_s` in the same group (a load after the wait put its latency on every program's chain: ptxas keeps a global
    load issued before `cp.async.wait_group` after it)."""
    o_t = gl.arange(0, BT, layout=gl.SliceLayout(1, CG))
    o_c = gl.arange(0, K, layout=gl.SliceLayout(0, CG))
    async_copy.async_copy_global_to_shared(g_s, g_h + o_t[:, None] * s_gt + o_c[None, :],
                                           mask=(o_t < n_rows)[:, None])
    if BIAS_COPY:
        CB: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])  # 4 bytes a thread, K threads
        async_copy.async_copy_global_to_shared(bias_s, bias_h + gl.arange(0, K, layout=CB))
    async_copy.commit_group()


@gluon.jit
def _chunk_b2(b2_s, anc_s, g_s, n_rows, a, bias_s, bias_h, lower_bound, gt_h, K: gl.constexpr, BT: gl.constexpr,
              HAS_DT_BIAS: gl.constexpr, BIAS_COPY: gl.constexpr, GT: gl.constexpr):
    """The chunk's b2 (the cumulative log2 decay from its start, Kimi's lower-bound gate as `common.kda_gate_log2`
    forms it with FAST) into `b2_s` ([K / 32, BT, 32] fp32: a K slice a leading index, so that the K loop runs as a
    loop), its rows BT/4, 3BT/4, BT/2, BT - 1 and 0 into `anc_s` ([K / 32, 8, 32], unswizzled: a row of a slice is
    read whole, `_anchor_row`), and gt = 2^b2 of its last row into `gt_h`: a thread a channel, its BT rows in
    registers, so the scan runs in the thread (the twin's gate pass, `_chunk_gate_kernel`, is a kernel of its own).
    Rows past the sequence add 0 (they repeat the last row's b2). The raw gate is read from `g_s`
    (`_issue_gate_copy`; an fp32 gate is staged in `b2_s`'s bytes, read whole before b2 overwrites them)."""
    o_t = gl.arange(0, BT, layout=gl.SliceLayout(1, GT))
    o_c = gl.arange(0, K, layout=gl.SliceLayout(0, GT))
    row_ok = (o_t < n_rows)[:, None]
    async_copy.wait_group(1)  # the gate's group; the inputs' may still be in flight
    gl.thread_barrier()  # every thread's part of the copy
    x = g_s.load(GT).to(gl.float32)
    c = a * -LOG2E
    # 2^(c (x + bias)) as 2^(c x + c bias): one fma an element (c bias once a thread: a channel a thread)
    if BIAS_COPY:
        e = gl.exp2(x * c + (bias_s.load(gl.SliceLayout(0, GT)) * c)[None, :])
    elif HAS_DT_BIAS:
        e = gl.exp2(x * c + (gl.load(bias_h + o_c).to(gl.float32) * c)[None, :])
    else:
        e = gl.exp2(x * c)
    b2 = gl.associative_scan(gl.where(row_ok, _div(lower_bound * LOG2E, 1.0 + e), 0.0), 0, _add)
    gl.thread_barrier()  # every thread's gate read (an fp32 gate shares b2_s's bytes in another order)
    NKS: gl.constexpr = b2_s.shape[0]
    # b2_s's bytes as one 3-d tile (its slices' 2-d layout stacked: the same bytes) for one store
    S3: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[2, 1, 0])
    b2_s._reinterpret(gl.float32, b2_s.shape, S3).store(gl.permute(gl.reshape(b2, [BT, NKS, K // NKS]), (1, 0, 2)))
    HALF: gl.constexpr = BT // 2
    _anchor_store(anc_s, 0, b2, o_t, HALF // 2)
    _anchor_store(anc_s, 1, b2, o_t, HALF + HALF // 2)
    _anchor_store(anc_s, 2, b2, o_t, HALF)
    _anchor_store(anc_s, 4, b2, o_t, 0)
    gl.store(gt_h + o_c, gl.exp2(_anchor_store(anc_s, 3, b2, o_t, BT - 1)))


@gluon.jit
def _anchor_store(anc_s, j: gl.constexpr, b2, o_t, r: gl.constexpr):
    """Row r of the register tile b2 (a channel a thread: the select stays in the thread) stored as row j of
    `anc_s`; returned. The other rows enter the sum as -0.0, which every addition drops exactly, so the compiler
    keeps one register instead of a chain of additions."""
    row = gl.sum(gl.where((o_t == r)[:, None], b2, -0.0), 0)
    A3: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
    a3 = anc_s._reinterpret(gl.float32, anc_s.shape, A3)  # row-major either way: the same bytes
    a3.slice(j, 1, 1).store(gl.reshape(row, [anc_s.shape[0], 1, anc_s.shape[2]]))
    return row


@direct
@gluon.jit
def _chunk_prepare_hopper_kernel(
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens, kd_ws, qd_ws, m_ws, n_ws, gt_ws, sc_ws, ready, x_ws,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh,
    T, N, NT, p0, n_p, scale, lower_bound,
    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
    BT: gl.constexpr, BC: gl.constexpr, BK: gl.constexpr, IS_VARLEN: gl.constexpr, SHORT: gl.constexpr,
    HAS_A_LOG: gl.constexpr, HAS_DT_BIAS: gl.constexpr, USE_BETA_SIGMOID: gl.constexpr, SIGNAL_CHUNKS: gl.constexpr,
    FOLD: gl.constexpr, LAST_WAITS: gl.constexpr,
):
    """What the twin `_chunk_prepare_kernel` stores (Qd, Kd, M, N, Xb, the scales; the chunk counted where the walk
    awaits it), one program per (chunk, value head), 4 warps. The K loop forms A_kk and A_qk with the twin's
    products: a slice's diagonal quadrants in one tf32 product (every row at its half's middle row against all of kc;
    the off-diagonal quadrants overflow and are dropped), the lower-left quadrant at the middle row's anchor in fp16
    into [BT, 32] accumulators (the twin's X_kk, X_qk). Every A operand is formed in the registers the tensor cores
    read (`_as_operand`), each B tile stored once."""
    gl.static_assert(BT == 64)
    gl.static_assert(BK == 32)
    gl.static_assert(gl.num_warps() == 4)
    gl.static_assert(K == 32 * 4)  # the gate's scan: a thread a channel
    HALF: gl.constexpr = BT // 2
    NKS: gl.constexpr = K // BK
    NV: gl.constexpr = (V + BK - 1) // BK
    NB: gl.constexpr = BT // BC
    # the elementwise tile: 8 consecutive channels (16-byte loads and fp16 stores) of rows r and r + 8 a thread, the
    # rows of the tf32 A operand's registers
    P: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
                                                 lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                                 warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BT, BK])
    # P with the chunk's halves as a leading index (row 32 h + i at [h, i]): a half lies in two warps, so a column
    # vector of each half ([2, BK], PH) is eight registers a thread, not a [BT, BK] tile's sixteen
    P3: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 8, 0]],
                                                  lane_bases=[[0, 0, 8], [0, 0, 16], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
                                                  warp_bases=[[0, 16, 0], [1, 0, 0]], block_bases=[],
                                                  shape=[2, BT // 2, BK])
    PH: gl.constexpr = gl.SliceLayout(1, P3)
    PW: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0])  # [BT, 16] words: 16-byte loads
    PROW: gl.constexpr = gl.SliceLayout(1, P)
    PCOL: gl.constexpr = gl.SliceLayout(0, P)
    PA: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 0]],
                                                  lane_bases=[[0, 8], [0, 16], [0, 0], [0, 0], [0, 0]],
                                                  warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[1, BK])
    # tf32 products into [BT, BT] (A's diagonal quadrants, the inverse), fp16 ones into [BT, 32] (A's lower-left
    # quadrant; MMA: the same registers as tf32's), [BT, BK] (M) and [BT, BT] (N)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 8])
    MMA16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 16])
    A16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA16, k_width=2)
    MMA64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 8])
    A64: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA64, k_width=1)
    MMA_M: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 16])
    A16_M: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_M, k_width=2)
    MMA_N: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    A16_N: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_N, k_width=2)
    S_SLICE: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    S_SQ: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    S_SQ16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    S_KR: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    S_SLICE16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    # staged inputs: 16-bit rows of 64 bytes read whole by 8 lanes (no conflict unswizzled); fp32 rows of 128
    # bytes swizzled in 16-byte pieces; the anchor rows unswizzled
    S_IN16: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=1, order=[1, 0])
    S_IN32: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
    S_ANC: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    CP: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    GT: gl.constexpr = gl.BlockedLayout([BT, 1], [1, 32], [1, 4], [0, 1])  # the gate: a channel a thread
    G32: gl.constexpr = g.dtype.element_ty == gl.float32
    CG: gl.constexpr = gl.BlockedLayout([1, 4 if G32 else 8], [1, 32], [4, 1], [1, 0])  # the raw gate's 16-byte copies
    S_G16: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    S_BIAS: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

    if SIGNAL_CHUNKS > 0:
        i_p = gl.program_id(1) + p0
        i_hv = gl.program_id(0)
    else:
        i_p = gl.program_id(0) + p0
        i_hv = gl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, t0, eos, i_p = _locate(i_p, cu_seqlens, N, T, NT, IS_VARLEN, BT, SHORT)
    if t0 < eos:  # always, but for a varlen program past its sequence's chunks
        k_s = gl.allocate_shared_memory(k.dtype.element_ty, [NKS, BT, BK], S_IN16)
        q_s = gl.allocate_shared_memory(q.dtype.element_ty, [NKS, BT, BK], S_IN16)
        v_s = gl.allocate_shared_memory(v.dtype.element_ty, [NV, BT, BK], S_IN16)
        b2_s = gl.allocate_shared_memory(gl.float32, [NKS, BT, BK], S_IN32)  # a K slice: b2_s.index(s)
        anc_s = gl.allocate_shared_memory(gl.float32, [NKS, 8, BK], S_ANC)  # b2's anchor rows (`_chunk_b2`)
        n_rows = gl.minimum(eos - t0, BT).to(gl.int32)
        q_h = q + t0 * s_qt + i_h * s_qh
        k_h = k + t0 * s_kt + i_h * s_kh
        ws_base = (t0 * HV + i_hv) * K
        n_base = (t0 * HV + i_hv) * BT
        if G32:
            g_s = b2_s._reinterpret(gl.float32, [BT, K], S_IN32)
        else:
            g_s = gl.allocate_shared_memory(g.dtype.element_ty, [BT, K], S_G16)
        BIAS_COPY: gl.constexpr = HAS_DT_BIAS and dt_bias.dtype.element_ty == gl.float32  # cp.async: 4 bytes or more
        bias_s = None
        if BIAS_COPY:
            bias_s = gl.allocate_shared_memory(gl.float32, [K], S_BIAS)
        # the head's A_log and the chunk's beta loaded before the copies are issued: behind them, their latency
        # waited on the gate scan and the inverse
        if HAS_A_LOG:
            a_log = gl.load(A_log + i_hv)
        o_t = gl.arange(0, BT, layout=PROW)
        row_ok = o_t < n_rows
        b_beta = gl.load(beta + t0 * s_bt + o_t * s_bt + i_hv * s_bh, mask=row_ok, other=0.0)
        _issue_gate_copy(g_s, g + t0 * s_gt + i_hv * s_gh, s_gt, n_rows, bias_s, dt_bias + i_hv * K, K, BT, CG,
                         BIAS_COPY)
        _issue_copies(k_s, q_s, v_s, k_h, q_h, v + t0 * s_vt + i_hv * s_vh, s_kt, s_qt, s_vt, n_rows, K, V, BT, BK,
                      CP)
        a = 1.0
        if HAS_A_LOG:
            a = gl.exp(a_log.to(gl.float32))
        # the gate and its scan while the copies run
        _chunk_b2(b2_s, anc_s, g_s, n_rows, a, bias_s, dt_bias + i_hv * K, lower_bound,
                  gt_ws + (i_p * HV + i_hv) * K, K, BT, HAS_DT_BIAS, BIAS_COPY, GT)

        o_c = gl.arange(0, BK, layout=PCOL)
        b_beta = b_beta.to(gl.float32)
        if USE_BETA_SIGMOID:
            b_beta = 1.0 / (1.0 + gl.exp(-b_beta))
        b_beta = gl.where(row_ok, b_beta, 0.0)
        # the norms pass (k, q, and max|V| for the walk's bound on D) from the staged tiles
        async_copy.wait_group(0)
        gl.thread_barrier()  # b2_s stored by every thread
        ssk = gl.zeros([BT], gl.float32, layout=PROW)
        ssq = gl.zeros([BT], gl.float32, layout=PROW)
        for i_s in range(NKS):
            x = k_s.index(i_s).load(P).to(gl.float32)
            ssk += gl.sum(x * x, 1)
            x = q_s.index(i_s).load(P).to(gl.float32)
            ssq += gl.sum(x * x, 1)
        # max|V| on the staged words: with the sign bits cleared, a 16-bit float's order is its integer order
        # (two elements a max.u16x2)
        vw_s = v_s._reinterpret(gl.int32, [NV, BT, BK // 2], S_IN16)
        v_w = gl.zeros([BT, BK // 2], gl.int32, layout=PW)
        for i_s in range(NV):
            v_w = _max_u16x2(v_w, vw_s.index(i_s).load(PW) & 0x7FFF7FFF)
        v_w = gl.max(gl.max(gl.maximum(v_w & 0xFFFF, v_w >> 16), 1), 0)
        v_max = v_w.to(gl.int16).to(v.dtype.element_ty, bitcast=True).to(gl.float32)
        rk = 1.0 / gl.sqrt(ssk + 1e-6)
        rq = (1.0 / gl.sqrt(ssq + 1e-6)) * scale
        sc = sc_ws + (i_p * HV + i_hv) * 4
        gl.store(sc + 2, v_max)  # now: no register holds it through the K loop

        if n_rows == 1:  # one token (a decode step in a varlen batch, a sequence's last token alone in its chunk)
            _one_row_chunk(q_h, k_h, anc_s, PA, PCOL, qd_ws, kd_ws, m_ws, n_ws, x_ws, sc, ws_base, n_base, rk, rq,
                           b_beta, o_t, o_c, K, BK, FOLD)
        else:
            # the K loop: A_kk and A_qk as the twin forms them (kernel docstring)
            kk = gl.zeros([BT, BT], gl.float32, layout=MMA64)
            qk = gl.zeros([BT, BT], gl.float32, layout=MMA64)
            kk_ll = gl.zeros([BT, HALF], gl.float32, layout=MMA16)
            qk_ll = gl.zeros([BT, HALF], gl.float32, layout=MMA16)
            m_rows = row_ok[:, None]
            b_s = gl.allocate_shared_memory(gl.float32, [BT, BK], S_SLICE)
            b16_s = gl.allocate_shared_memory(gl.float16, [BT, BK], S_SLICE16)
            kr_s = gl.allocate_shared_memory(gl.float16, [NKS, BT, BK], S_KR)
            for i_s in range(NKS):  # a loop, not unrolled: the code of one slice (the instruction cache)
                cols = i_s * BK + o_c
                b2 = gl.convert_layout(gl.reshape(b2_s.index(i_s).load(P), [2, HALF, BK]), P3)
                a_t = anc_s.index(i_s)
                b2_q1 = _anchor_row(a_t, 0, PA, PCOL)[None, :]
                b2_q3 = _anchor_row(a_t, 1, PA, PCOL)[None, :]
                b2_mid = _anchor_row(a_t, 2, PA, PCOL)[None, :]
                anc_h = a_t.slice(0, 2).load(PH)  # each half's anchor row: q1, q3
                anc = gl.expand_dims(anc_h, 1)
                kn = k_s.index(i_s).load(P).to(gl.float32) * rk[:, None]
                e_row = _flat(gl.exp2(b2 - anc), P)
                e_col = _flat(gl.exp2(anc - b2), P)
                # B: kc's rows at their half's anchor in tf32; the top rows at the middle row's in fp16 (2^(mid - b2)
                # = e_col 2^(mid - q1) <= 1; the bottom rows' may overflow fp16 and are never read)
                kc = kn * e_col
                b_s.store(_as_operand(_tf32(kc), A64))
                b16_s.store(_as_operand16((kc * gl.exp2(b2_mid - b2_q1)).to(gl.float16), A16))
                fence_async_shared()
                # A: every row at its half's anchor against all of kc (the off-diagonal quadrants overflow and are
                # dropped); the bottom rows at the middle row's in fp16 (2^(b2 - mid) = e_row 2^(q3 - mid) <= 1)
                # against kc's top rows (the top rows' products may overflow: only the bottom rows are read)
                x_row = gl.exp2(b2_q3 - b2_mid)  # times e_row: kn_e and qn_e below
                kn_e = kn * e_row
                kk = warpgroup_mma(_as_operand(_tf32(kn_e), A64), b_s.permute((1, 0)), kk, is_async=True)
                kk_ll = warpgroup_mma(_as_operand16((kn_e * x_row).to(gl.float16), A16), b16_s.slice(0, HALF).permute((1, 0)),
                                      kk_ll, is_async=True)
                qn = q_s.index(i_s).load(P).to(gl.float32) * rq[:, None]
                qn_e = qn * e_row
                qk = warpgroup_mma(_as_operand(_tf32(qn_e), A64), b_s.permute((1, 0)), qk, is_async=True)
                qk_ll = warpgroup_mma(_as_operand16((qn_e * x_row).to(gl.float16), A16), b16_s.slice(0, HALF).permute((1, 0)),
                                      qk_ll, is_async=True)
                # what the walk reads, while the products run
                # 2^b2 = e_row 2^anc and 2^(b2_last - b2) = e_col 2^(b2_last - anc): a half's vectors, not tiles
                d = _on_halves(gl.exp2(anc_h), HALF, P3, P)
                offs = ws_base + o_t[:, None] * (HV * K) + cols[None, :]
                gl.store(qd_ws + offs, (qn_e * d).to(gl.float16), mask=m_rows)
                gl.store(kd_ws + offs, (kn_e * d).to(gl.float16), mask=m_rows)
                kr = (kc * _on_halves(gl.exp2(a_t.slice(3, 1).load(PH) - anc_h), HALF, P3, P)).to(gl.float16)
                if FOLD:
                    kr_s.index(i_s).store(kr)
                else:
                    gl.store(m_ws + offs, kr, mask=m_rows)
                kk, kk_ll, qk, qk_ll = warpgroup_mma_wait(num_outstanding=0, deps=(kk, kk_ll, qk, qk_ll))
            r = gl.arange(0, BT, layout=gl.SliceLayout(1, MMA64))[:, None]
            c = gl.arange(0, BT, layout=gl.SliceLayout(0, MMA64))[None, :]
            # the lower-left quadrant from its own accumulators (`_chunk_prepare_kernel`'s X_kk, X_qk)
            lower_left = (r >= HALF) & (c < HALF)
            zeros = gl.zeros([BT, HALF], gl.float32, layout=MMA)
            acc_kk = gl.where(lower_left, _cat_acc(gl.convert_layout(kk_ll, MMA), zeros, MMA64), kk)
            acc_qk = gl.where(lower_left, _cat_acc(gl.convert_layout(qk_ll, MMA), zeros, MMA64), qk)
            # L = A_kk diag(beta) strictly below the diagonal; A_qk on and below it, held in fp16
            beta_m = gl.convert_layout(b_beta, gl.SliceLayout(1, MMA64))[:, None]
            valid = (r < n_rows) & (c < n_rows)
            L = gl.where(valid & (c < r), acc_kk * beta_m, 0.0)
            A_qk = gl.where(valid & (c <= r), acc_qk, 0.0).to(gl.float16)
            if not FOLD:  # A_qk into N's rows now: no register holds it through the inverse
                gl.store(n_ws + n_base + r * (HV * BT) + c, A_qk, mask=r < n_rows)

            # Y = X^T, X = (I + L)^-1 (`chunk_prepare._unit_lower_inverse_t`), as `_chunk_prepare_hopper_kernel`
            l_s = gl.allocate_shared_memory(gl.float32, [BT, BT], S_SQ, _tf32(L))
            # the B operand L^T with its rows in `_k_order`, so every A operand is an accumulator's registers
            lk_s = gl.allocate_shared_memory(gl.float32, [BT, BT], S_SQ, _k_order(_tf32(L), 1))
            y_s = gl.allocate_shared_memory(gl.float32, [BT, BT], S_SQ)
            fence_async_shared()
            LrT = lk_s.permute((1, 0))
            eye = gl.where(r == c, 1.0, 0.0)
            blk = (r // BC) == (c // BC)
            Y = eye - gl.where(blk, l_s.permute((1, 0)).load(MMA64), 0.0)
            for _ in range(2, BC):
                Y = eye - gl.where(blk, _mma(_k_order(_tf32(Y), 1), LrT, A64, MMA64, BT, BT), 0.0)
            gl.static_assert(BC * NB == BT and (BC & (BC - 1)) == 0)
            LOG2_BC: gl.constexpr = (BC >= 2) + (BC >= 4) + (BC >= 8) + (BC >= 16) + (BC >= 32)
            NLVL: gl.constexpr = (NB >= 2) + (NB >= 4) + (NB >= 8) + (NB >= 16)  # merges of widths BC, 2 BC, ..
            # the bit at which r and c first differ, where c > r (-127 elsewhere): (r, c) lies in the upper-right
            # quadrant of a block of 2w rows at the merge of blocks of w = 2^hb (one compare a trip)
            hb = (gl.where(c > r, r ^ c, 0).to(gl.float32).to(gl.int32, bitcast=True) >> 23) - 127
            for lvl in range(NLVL):  # a loop: the merges' code once (blocks of w = BC 2^lvl rows)
                sh = lvl + LOG2_BC
                Yr = _tf32(Y)
                # the upper-right quadrant of each block of 2w: r and c alike above bit sh, r's bit sh 0, c's 1; a
                # row of Y L^T needs only that row of Y, so the bottom rows' products are dropped, not zeroed first
                Hm = gl.where(hb == sh, _mma(_k_order(Yr, 1), LrT, A64, MMA64, BT, BT), 0.0)
                y_s.store(gl.permute(_k_order(Yr, 0), (1, 0)))
                fence_async_shared()
                Y = Y - _mma(_k_order(_tf32(Hm), 1), y_s.permute((1, 0)), A64, MMA64, BT, BT)
            XbT = _tf32(Y * beta_m)

            if FOLD:
                # N = A_qk Xb and M = Xb^T Kr in fp16, Xb times px (exact: XbT is rounded to 11 bits)
                px = _pow2_of(gl.max(gl.max(gl.abs(XbT), 1), 0))
                pm = _pow2_of(gl.max(gl.sum(gl.abs(XbT), 1), 0))
                xb16 = (XbT * px).to(gl.float16)
                x_s = gl.allocate_shared_memory(gl.float16, [BT, BT], S_SQ16, xb16)
                fence_async_shared()
                Nm = _mma(A_qk, x_s.permute((1, 0)), A16_N, MMA_N, BT, BT) * (1.0 / px)
                pn = _pow2_of(gl.max(gl.max(gl.abs(Nm), 1), 0))
                rn = gl.arange(0, BT, layout=gl.SliceLayout(1, MMA_N))[:, None]
                cn = gl.arange(0, BT, layout=gl.SliceLayout(0, MMA_N))[None, :]
                gl.store(n_ws + n_base + rn * (HV * BT) + cn, (Nm * pn).to(gl.float16), mask=rn < n_rows)
                rm = gl.arange(0, BT, layout=gl.SliceLayout(1, MMA_M))[:, None]
                cm = gl.arange(0, BK, layout=gl.SliceLayout(0, MMA_M))[None, :]
                f = pm / px
                for s in gl.static_range(NKS):
                    Mm = _mma(xb16, kr_s.index(s), A16_M, MMA_M, BT, BK)
                    gl.store(m_ws + ws_base + rm * (HV * K) + s * BK + cm, (Mm * f).to(gl.float16), mask=rm < n_rows)
                gl.store(sc, 1.0 / pm)
                gl.store(sc + 1, 1.0 / pn)
            else:
                # Xb px into x_ws's rows (XbT's element (r, c) at row c, column r), Kr left in M's rows
                px = _pow2_of(gl.max(gl.max(gl.abs(XbT), 1), 0))
                # stored as rows of 8 (four 16-byte stores a thread, where XbT's accumulator layout stored 32 scattered
                # 2-byte elements); not the copies' layout CP, whose offsets the compiler would keep live from the copies
                ST: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0])
                xb = gl.convert_layout(gl.permute((XbT * px).to(gl.float16), (1, 0)), ST)
                o_xr = gl.arange(0, BT, layout=gl.SliceLayout(1, ST))[:, None]
                o_xc = gl.arange(0, BT, layout=gl.SliceLayout(0, ST))[None, :]
                gl.store(x_ws + n_base + o_xr * (HV * BT) + o_xc, xb, mask=o_xr < n_rows)
                gl.store(sc, 1.0 / px)
                gl.store(sc + 1, gl.max(gl.sum(gl.abs(XbT), 0), 0))
        if SIGNAL_CHUNKS > 0:
            _count_chunk(ready, i_n, t0, T, NT, i_p, i_hv, N, HV, BT, SIGNAL_CHUNKS, LAST_WAITS)
