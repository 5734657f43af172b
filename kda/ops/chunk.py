"""`chunk_kda`'s launches: the prepare stage (`kda.ops.chunk_prepare`: every chunk in parallel, after the
gate pass where the plan has one), then the serial state walk (`kda.ops.chunk_walk`), as
`kda.plan.ChunkPlan` says. Together they equal `kda_reference.chunk.chunk_kda` (and so
`kda_reference.recurrent_kda`).

Workspaces, token-major `[B*T, HV, *]` (gt per chunk): Qd, Kd, M = Xb^T Kr and N = A_qk Xb in the plan's
workspace dtype (the walk's dot operands; the walk reads V from the input), A_kk in fp32 (split prepare), b2
in fp32 (the gate pass), and with fp16 workspaces per chunk M's and N's fp32 inverse scales and max|V|
(`chunk_prepare._store_folded`).
Chunks map to sequences on the device (`kda.ops.common.locate_block`): no host copy of the bounds.
Prefix-cache checkpoints are stored by the walk as it passes them: no extra pass.

The walk beside the prepare (`ChunkPlan.wait_chunks`: a dense call with few walk programs) runs on a side
stream beside the prepare, forked after the gate pass (or after the prepare's first launch, `ChunkPlan.late_chunks`)
and joined back, then launched once more on the caller's stream for the programs whose bounded wait gave up:
`kda.ops.overlap` holds the protocol and why it always finishes. The prepare is launched before the walk, always:
a kernel's first launch loads its module lazily, a load that waits on the device.

The sequences routed to the recurrent loop (`Route.short`: their own rows of o, their own slots) are launched
after the walk. On a GPU with programmatic dependent launch a recorded call (`kda.replay`) launches them as the
walk's dependent: every walk program lets them start at once (its DEPENDENTS), so the loop's state traffic runs in
the SMs the walk's programs leave, and the loop's last program waits for the walk (its LAST_WAITS), so the stream's
next work still follows both. Neither waits for the other's data.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl
from triton.tools.ragged_tma import create_ragged_descriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from ..contract import KDACall
from ..plan import SUB, ChunkPlan, Route, cdiv, next_power_of_2
from .buffers import StatePlan, gate_args, output_buffer, state_plan
from .chunk_prepare import (
    _chunk_gate_kernel,
    _chunk_intra_kernel,
    _chunk_prepare_kernel,
    _chunk_solve_kernel,
)
from .chunk_walk import _chunk_state_kernel
from .common import token_head_strides
from .fused_recurrent import fused_recurrent_kda_fwd
from .launch import dependent, wait_stream
from .overlap import _zero_counters_kernel, ready_words, side_stream


def chunk_kda_fwd(call: KDACall, plan: ChunkPlan, route: Route) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run a validated call (`kda.contract.check_call`) as planned (`kda.plan.prefill_plan`). Returns
    (o, final_state)."""
    short, kept, kept_chunks, varlen = route.short, route.kept, route.kept_chunks, route.varlen
    B, T, HV, K, N = call.B, call.T, call.HV, call.K, call.N
    if kept == 0:  # every sequence is short: the recurrent loop alone (never the one-token kernel: same bits)
        return fused_recurrent_kda_fwd(call, route.loop)
    o = output_buffer(call)
    st = state_plan(call)
    if N == 0:
        return o, st.final_state
    BT, dev = plan.BT, call.q.device
    total = B * T
    NT = cdiv(T, BT)
    BK = max(16, next_power_of_2(K))  # the K tile that covers K (walk) or its slices (split prepare)
    n_chunks = (T // BT + N) if varlen else B * NT  # chunk programs (`locate_block`), gt's rows
    grid_chunks = n_chunks if kept_chunks is None else kept_chunks  # routed sequences' chunks have no program
    cu = call.cu_seqlens if varlen else call.q  # stand-in when dense
    ws_dtype = plan.ws_dtype
    kd_ws = torch.empty((total, HV, K), dtype=ws_dtype, device=dev)
    qd_ws = torch.empty((total, HV, K), dtype=ws_dtype, device=dev)
    m_ws = torch.empty((total, HV, K), dtype=ws_dtype, device=dev)
    n_ws = torch.empty((total, HV, BT), dtype=ws_dtype, device=dev)
    gt_ws = torch.empty((max(n_chunks, 1), HV, K), dtype=torch.float32, device=dev)
    # M's and N's scales and max|V| for the fp16 walk, a fourth slot for 16-byte rows (gt_ws: a stand-in the
    # tf32 walk of fp32 workspaces never touches)
    sc_ws = (torch.empty((max(n_chunks, 1), HV, 4), dtype=torch.float32, device=dev) if ws_dtype == torch.float16
             else gt_ws)

    # Xb per chunk where the walk applies the inverse itself (`ChunkPlan.fold` off: fused prepare, fp16, plain walk)
    x_ws = n_ws if plan.fold else torch.empty((total, HV, BT), dtype=ws_dtype, device=dev)

    q, k, v, g, beta = call.q, call.k, call.v, call.g, call.beta
    # the walk beside the prepare (`ChunkPlan.wait_chunks`, dense): the counters it awaits, and its side stream
    ready = (torch.empty((ready_words(B, NT, plan.wait_chunks, HV, cdiv(call.V, plan.walk_BV) * HV * kept),),
                         dtype=torch.int32, device=dev) if plan.wait_chunks else None)
    main = torch.cuda.current_stream(dev) if ready is not None and q.is_cuda else None
    side = side_stream(dev, main) if main is not None else None

    def fork():  # the walk reads gt and the zeroed counters, and what the caller queued before this call
        if side is not None:
            wait_stream(side, main)

    if grid_chunks > 0:  # else only empty (and routed) sequences: the walk copies the states
        # without host lengths the gate and prepare take every chunk (the routed ones too, unread): a scan of
        # the bounds in each of their programs would cost more than the short sequences' few chunks
        _prepare(call, plan, (q, k, v, g, beta), (kd_ws, qd_ws, m_ws, n_ws, gt_ws, sc_ws, x_ws), T, grid_chunks,
                 short if kept_chunks is not None else 0, varlen, ready, fork)
    # the walk reads v (the input) itself
    walk_ws = (n_ws, kd_ws, v, qd_ws, m_ws, gt_ws, sc_ws)
    ckpt = call.checkpoint_indices
    has_ckpt = ckpt is not None
    # checkpoint row, row stride, columns, spacing (a stand-in and zeros without checkpoints), pool slots
    ck_args = ((ckpt, ckpt.stride(0), ckpt.shape[1], call.checkpoint_every, st.slot_count) if has_ckpt
               else (gt_ws, 0, 0, BT, st.slot_count))
    tiles = _walk_tiles(plan, walk_ws, BK)  # with short sequences routed, only the kept ones have programs
    x_tiles = _ragged(x_ws, BT, BT) if plan.walk_tma and not plan.fold else x_ws  # folded: a stand-in
    # the routed short sequences' loop after the walk (other rows of o, other slots): on a GPU with PDL
    # (`ChunkPlan.spin`) a recorded call launches it as the walk's programmatic dependent, into the SMs the walk
    # leaves (module docstring); after a walk on the side stream it follows the resume launch, which lets nothing start
    dependents = bool(short) and plan.spin and side is None
    if side is None:
        _plain_walk(call, plan, o, st, tiles, cu, kept, N, varlen, short, ck_args, has_ckpt, ready, x_tiles,
                    dependents=dependents)
    else:  # launched after the prepare, always (module docstring)
        with torch.cuda.stream(side):
            _plain_walk(call, plan, o, st, tiles, cu, kept, N, varlen, short, ck_args, has_ckpt, ready, x_tiles)
        wait_stream(main, side)  # the caller's stream owns o, the state and every workspace again
    if ready is not None:  # the programs whose wait gave up walk again, after the prepare (module docstring)
        _plain_walk(call, plan, o, st, tiles, cu, kept, N, varlen, short, ck_args, has_ckpt, ready, x_tiles, True)
    if short:
        if dependents:
            dependent()
        fused_recurrent_kda_fwd(call, route.loop, short=short, o=o, st=st, last_waits=dependents)
    return o, st.final_state


@functools.lru_cache(maxsize=256)
def _ragged_layout(shape: tuple, dtype: torch.dtype, rows: int, cols: int, strides: tuple | None = None) -> tuple:
    """(shape, strides, block) of Triton's ragged descriptor of a `[tokens, HV, C]` tensor (contiguous, or of
    `strides`) with tiles of [rows tokens, 1 head, cols], from `create_ragged_descriptor` itself (on a meta
    tensor)."""
    if strides is None:
        meta = torch.empty(shape, dtype=dtype, device="meta")
    else:
        meta = torch.empty_strided(shape, strides, dtype=dtype, device="meta")
    desc = create_ragged_descriptor(meta, [rows, 1, cols])
    return list(desc.shape), list(desc.strides), list(desc.block_shape)


def _walk_tiles(plan: ChunkPlan, walk_ws: tuple, BK: int) -> tuple:
    """The plain walk's workspaces (N, Kd, the input v, Qd, M, gt, M's and N's scales) as its kernel takes them:
    with TMA, ragged descriptors (two leading dimensions whose strides wrap around 2^64: a load given a start
    token and a row count reads zeros past those rows, so a chunk stops at its sequence's end without a mask);
    v too where the copy engine can address it (`_v_tiles`), else the walk reads it by pointers."""
    if not plan.walk_tma:
        return walk_ws
    n_ws, kd_ws, v, qd_ws, m_ws, gt_ws, sc_ws = walk_ws
    BT = plan.BT
    return (_ragged(n_ws, BT, BT), _ragged(kd_ws, BT, BK), _v_tiles(v, BT, plan.walk_BV), _ragged(qd_ws, BT, BK),
            _ragged(m_ws, BT, BK), gt_ws, sc_ws)


def _v_tiles(v: torch.Tensor, rows: int, cols: int):
    """The input v as the TMA walk reads it: a ragged descriptor of its `[tokens, HV, V]` view where the copy
    engine can address it (16-byte aligned base and strides, unit stride along V), else v itself (pointer
    loads)."""
    B, T, HV, V = v.shape
    s_b, _, _, s_v = v.stride()
    s_t, s_h = token_head_strides(v, T)  # the one stride of the flattened token axis (stride(0) when T == 1)
    size = v.element_size()
    if s_v != 1 or (B > 1 and s_b != T * s_t) or v.data_ptr() % 16 or (s_t * size) % 16 or (s_h * size) % 16:
        return v
    # over v itself, not a view: a recorded call finds its role (`kda.replay`) by the object
    return _ragged(v, rows, cols, (B * T, HV, V), (s_t, s_h, 1))


def _plain_walk(call: KDACall, plan: ChunkPlan, o: torch.Tensor, st: StatePlan, walk_ws: tuple, cu, seqs: int,
                N: int, varlen: bool, short: int, ck_args: tuple, has_ckpt: bool,
                ready: torch.Tensor | None, x_ws, resume: bool = False, dependents: bool = False) -> None:
    """`_chunk_state_kernel` over `seqs` sequences. `ready`: the walk beside the prepare
    (module docstring), each group of chunks awaited; `resume`: the launch after the prepare that walks again the
    programs whose wait gave up. `x_ws`: Xb's workspace (or its descriptor) where the walk applies the inverse
    (`ChunkPlan.fold` off). `dependents`: the loop kernel follows as its programmatic dependent (DEPENDENTS)."""
    T, HV, K, V, BT, BV = call.T, call.HV, call.K, call.V, plan.BT, plan.walk_BV
    s_ot, s_oh = token_head_strides(o, T)
    has_errors = call.errors is not None
    errors = call.errors if has_errors else walk_ws[5]  # gt_ws: a stand-in never written (HAS_ERRORS off)
    _chunk_state_kernel[(cdiv(V, BV), HV, seqs)](
        o, cu, *walk_ws, *st.pointers(walk_ws[5]), s_ot, s_oh, *token_head_strides(call.v, T), st.src_stride,
        st.dst_stride, *ck_args, errors, walk_ws[5] if ready is None else ready,
        x_ws, T, N, cdiv(T, BT), int(resume),
        HV=HV, K=K, V=V, BT=BT, BK=max(16, next_power_of_2(K)), BV=BV, IS_VARLEN=varlen, DOT_PREC=plan.dot_prec,
        **st.flags(call.state_v_first), HAS_CHECKPOINTS=has_ckpt,
        HAS_ERRORS=has_errors, SHORT=short, TMA=plan.walk_tma, V_TMA=isinstance(walk_ws[2], TensorDescriptor),
        WAIT_CHUNKS=0 if ready is None else plan.wait_chunks, WAIT_IN_LOOP=plan.wait_in_loop,
        SPIN=ready is not None and plan.spin, FOLD=plan.fold, DEPENDENTS=dependents,
        WARPS=plan.walk_warps, num_warps=plan.walk_warps, num_stages=plan.walk_stages,
    )


def _ragged(base: torch.Tensor, rows: int, cols: int, shape: tuple | None = None,
            strides: tuple | None = None) -> TensorDescriptor:
    """The ragged descriptor of `base` seen as `[tokens, HV, C]` (`shape`, `strides`; default: a fresh
    contiguous workspace as it is), its layout cached: building one with `create_ragged_descriptor` costs
    host time every call, and its checks (alignment, strides) hold for every workspace this module
    allocates and for the v that `_v_tiles` passes."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.padding = base, "zero"
    desc.shape, desc.strides, desc.block_shape = _ragged_layout(shape or tuple(base.shape), base.dtype, rows, cols,
                                                                strides)
    return desc


def _prepare(call: KDACall, plan: ChunkPlan, inputs: tuple, ws: tuple, T: int, grid_chunks: int, short: int,
             varlen: bool, ready: torch.Tensor | None = None, after_gate=None) -> None:
    """The gate pass (where planned) and the prepare of `grid_chunks` chunks.
    `ready`: the counters the walk beside the prepare awaits (module docstring), zeroed by the gate pass
    (by `_zero_counters_kernel` where there is none) and counted up by the prepare; `after_gate` is called once
    they are zeroed, before the prepare's launches."""
    q, k, v, g, beta = inputs
    kd_ws, qd_ws, m_ws, n_ws, gt_ws, sc_ws, x_ws = ws
    H, HV, K, V, N = call.H, call.HV, call.K, call.V, call.N
    BT, dev = plan.BT, q.device
    NT = cdiv(T, BT)
    total = call.B * T
    cu = call.cu_seqlens if varlen else q  # stand-in when dense
    prec = plan.dot_prec
    fused = plan.prepare in ("fused", "hopper")
    BK = max(16, next_power_of_2(K))
    A_log, dt_bias, lower_bound = gate_args(call)
    strides = (*token_head_strides(q, T), *token_head_strides(k, T))
    v_strides = token_head_strides(v, T)
    g_beta = (*token_head_strides(g, T), *token_head_strides(beta, T))
    common = dict(IS_VARLEN=varlen, SHORT=short, USE_BETA_SIGMOID=call.use_beta_sigmoid_in_kernel,
                  DOT_PREC=prec)
    signal = plan.wait_chunks if ready is not None else 0
    if signal and not (fused and plan.gate_pass):  # no gate pass to zero the counters
        _zero_counters_kernel[(cdiv(ready.numel(), 1024),)](ready, ready.numel(), BLOCK=1024, num_warps=4)
        if not fused:
            after_gate()
    ready = gt_ws if ready is None else ready  # a stand-in never touched (SIGNAL_CHUNKS 0)
    if fused:
        gate = dict(HAS_A_LOG=call.A_log is not None, HAS_DT_BIAS=call.dt_bias is not None)
        b2_ws = gt_ws
        if plan.gate_pass:
            b2_ws = torch.empty((total, HV, K), dtype=torch.float32, device=dev)
            _chunk_gate_kernel[(grid_chunks * HV * cdiv(K, plan.gate_BK),)](
                g, A_log, dt_bias, cu, b2_ws, gt_ws, ready, *g_beta[:2], T, N, NT, lower_bound,
                HV=HV, K=K, BT=BT, BK=plan.gate_BK, IS_VARLEN=varlen, SHORT=short, **gate,
                SIGNAL_CHUNKS=signal, num_warps=plan.gate_warps, num_stages=1,
            )
        late = min(plan.late_chunks, grid_chunks - 1)  # grid_chunks >= 1 here
        parts = ((0, grid_chunks - late), (grid_chunks - late, late)) if late else ((0, grid_chunks),)
        for i, (p0, n_p) in enumerate(parts):
            if signal and i == len(parts) - 1:
                after_gate()  # the walk forks before the last launch: it starts once the chunks before are stored
            if plan.prepare == "hopper":
                _hopper_prepare()[(HV, n_p) if signal else (n_p, HV)](
                    q, k, v, g, beta, A_log, dt_bias, cu, kd_ws, qd_ws, m_ws, n_ws, gt_ws, sc_ws, ready, x_ws,
                    *strides, *v_strides, *g_beta, T, N, NT, p0, n_p, call.scale, lower_bound,
                    H=H, HV=HV, K=K, V=V, BT=BT, BC=plan.BC, BK=plan.prepare_BK, IS_VARLEN=varlen, SHORT=short,
                    **gate, USE_BETA_SIGMOID=call.use_beta_sigmoid_in_kernel, SIGNAL_CHUNKS=signal,
                    FOLD=plan.fold, LAST_WAITS=signal > 0 and plan.spin, num_warps=4,
                )
                continue
            _chunk_prepare_kernel[(HV, n_p) if signal else (n_p, HV)](
                q, k, v, g, beta, A_log, dt_bias, cu, kd_ws, qd_ws, m_ws, n_ws, gt_ws, b2_ws, sc_ws, ready, x_ws,
                *strides, *v_strides, *g_beta, T, N, NT, p0, call.scale, lower_bound,
                H=H, HV=HV, K=K, V=V, BT=BT, BC=plan.BC, BK=plan.prepare_BK, **gate,
                CUMSUM_DTYPE=tl.float64 if plan.cumsum_fp64 else tl.float32, B2_FROM_WS=plan.gate_pass,
                SIGNAL_CHUNKS=signal, FOLD=plan.fold, LAST_WAITS=signal > 0 and plan.spin,
                num_warps=plan.prepare_warps, num_stages=1, **common,
            )
    else:
        akk_ws = torch.empty((total, HV, BT), dtype=torch.float32, device=dev)
        # A_qk and Kr parked in N's and M's workspaces until the solve folds the inverse into them
        _chunk_intra_kernel[(grid_chunks, BT // SUB, HV)](
            q, k, g, beta, A_log, dt_bias, cu, akk_ws, n_ws, kd_ws, qd_ws, m_ws, gt_ws, *strides, *g_beta,
            T, N, NT, call.scale, lower_bound,
            H=H, HV=HV, K=K, BT=BT, BC=SUB, BK=16,
            USE_GATE=call.use_gate_in_kernel, HAS_A_LOG=call.A_log is not None,
            HAS_DT_BIAS=call.dt_bias is not None, USE_LOWER_BOUND=call.lower_bound is not None,
            USE_L2NORM=call.use_qk_l2norm_in_kernel, num_warps=4, num_stages=1, **common,
        )
        _chunk_solve_kernel[(HV, grid_chunks) if signal else (grid_chunks, HV)](
            v, beta, cu, akk_ws, m_ws, n_ws, sc_ws, ready, *v_strides, g_beta[2], g_beta[3],
            T, N, NT, HV=HV, K=K, V=V, BT=BT, BC=SUB, BK=min(32, BK), INV_PREC="ieee", SIGNAL_CHUNKS=signal,
            num_warps=4, num_stages=1, **common,
        )


@functools.cache
def _hopper_prepare():
    """The Gluon prepare (`kda.ops.hopper_prepare`), imported at its first launch: only plans for Hopper pick it."""
    from .hopper_prepare import _chunk_prepare_hopper_kernel

    return _chunk_prepare_hopper_kernel
