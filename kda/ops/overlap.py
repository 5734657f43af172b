"""The walk beside the prepare: how `chunk_kda`'s serial walk runs while the prepare still stores the chunks it
walks, and why such a call always finishes. Every piece of that protocol is here: the counters' place
(`ready_counter`), the prepare's count (`count_chunk`, and `finish` for the replayed order; `last_program_waits`
for the loop kernel replayed after the walk), the zeroing launch
where no gate pass zeroes them (`_zero_counters_kernel`), the walk's bounded waits (`ready_zero`, `spin_zero`),
its look at the groups counted already (`counted_after`), the workspace they share (`ready_words`) and the walk's
side stream (`side_stream`). Which calls take it is `kda.plan`'s (`ChunkPlan.wait_chunks`, `late_chunks`); the
launch order is `kda.ops.chunk`'s, the replayed order `kda.replay._programmatic`'s; the Gluon prepare counts as
`count_chunk` does (`hopper_prepare._count_chunk`).

The protocol. The prepare, launched chunk by chunk across the heads so that groups of `wait_chunks` chunks
complete in order, adds 1 to its group's counter after its stores (release); a walk program, on a side stream of
higher priority, waits for each group's count (acquire, then a proxy fence before tiles read by TMA) and walks
it. The counters are zeroed by the gate pass (or their own launch) before either starts. Eager, the prepare is
launched first and the walk forked after the gate pass (or after the prepare's first launch: the walk beside its
last chunks); replayed on Hopper, the walk first and the prepare as its programmatic dependent.

Why it always finishes, whatever SMs the call reaches (a GPU partitioned by a green context or MPS, other
streams' kernels holding SMs, kernels run one at a time): no wait is unbounded. A walk program whose wait for a
group reaches its budget (20 ms of the global timer; a group takes microseconds) gives up and waits for nothing
more, so it ends within its own walk's time, giving its SM to the prepare; it stores no final state, so the state
it started from is still in place (output rows and checkpoints it passes after giving up are garbage until the
resume launch rewrites them), and its flag is set (one int32 a walk program, after the counters in the same
workspace: cleared as the program starts, set by any of its threads whose wait gives up, read after a barrier, so
that the program decides once even where its threads, each timing its own spin, disagree). The prepare waits on
nothing but SMs (in the replayed order only its last program waits, for the walk grid, whose programs all end),
so it runs to its end. After the join, on the caller's stream and so after the
whole prepare, the walk is launched once more (`resume` set): a flagged program walks its columns again from the
start, its waits finding every group counted, the others end at once. The result is the one walk's, bit for bit:
the resume launch stores every row, checkpoint and final state column a flagged program owns. On the whole GPU,
where the walk's programs take at most half the SMs and a prepare program fits beside each (`kda.plan._beside`),
no wait gives up, and the resume launch costs a grid of programs reading one flag each.
"""

from __future__ import annotations

import ctypes

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from ..plan import cdiv
from .launch import direct

_SIDE_STREAMS: dict = {}
_DRIVER: list = []  # `_driver()`'s answer, once looked up
_CU_STREAM_NON_BLOCKING = 1  # as torch's own streams: no implicit order with the legacy default stream


def side_stream(device: torch.device, main: torch.cuda.Stream) -> torch.cuda.Stream:
    """The walk's side stream beside the prepare on the caller's stream `main`: one per caller's stream and green
    context, made at its first use, so that two calls on two streams do not queue their walks on one. Where `main`
    is confined to a green context (made in one, or current in one: `cuStreamGetGreenCtx`), the side stream is made
    in the same green context (`cuGreenCtxStreamCreate`), so the walk reaches only the SMs the caller's stream does
    (a torch stream is bound to the context current when torch's pool was made, the whole GPU); else in the
    device's primary context (`cuStreamCreateWithPriority`). Never one of torch's pooled streams: torch hands each of
    those out again every 32 requests, so a caller's `torch.cuda.Stream()` could be the walk's stream, its work then
    ordered before or after the walk's (without a CUDA driver to ask, ROCm, a torch stream all the same).
    At a higher priority than the caller's: the walk is the call's serial chain, and its programs should take the
    SMs a finished prepare program frees before the next prepare's do. One driver query a call."""
    green = _green_context(main.cuda_stream)
    key = (device.index or 0, main.cuda_stream, green)
    stream = _SIDE_STREAMS.get(key)
    if stream is None:
        stream = _SIDE_STREAMS[key] = _new_stream(device, green)
    return stream


def _new_stream(device: torch.device, green: int | None) -> torch.cuda.Stream:
    """A stream of this module's own on `device`, non-blocking, at priority -1: in green context `green`, or in the
    device's primary context (torch's) where None; a torch stream where no CUDA driver answers."""
    fns = _driver()
    if fns is None:
        return torch.cuda.Stream(device=device, priority=-1)
    handle = ctypes.c_void_p()
    if green is None:
        with torch.cuda.device(device):  # the primary context current on this thread, as torch's calls make it
            rc, name = fns[2](ctypes.byref(handle), _CU_STREAM_NON_BLOCKING, -1), "cuStreamCreateWithPriority"
    else:
        rc, name = fns[1](ctypes.byref(handle), green, _CU_STREAM_NON_BLOCKING, -1), "cuGreenCtxStreamCreate"
    if rc != 0:
        raise RuntimeError(f"{name} failed with CUresult {rc}")
    return torch.cuda.ExternalStream(handle.value, device=device)


def _driver() -> tuple | None:
    """libcuda's (cuStreamGetGreenCtx, cuGreenCtxStreamCreate, cuStreamCreateWithPriority), looked up once; the
    first two None before CUDA 12.5 (no green contexts); None without libcuda or on ROCm."""
    if not _DRIVER:
        fns = None
        if torch.version.hip is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError:
                lib = None
            if lib is not None:
                ptr = ctypes.POINTER(ctypes.c_void_p)
                plain = lib.cuStreamCreateWithPriority
                plain.argtypes, plain.restype = (ptr, ctypes.c_uint, ctypes.c_int), ctypes.c_int
                get = getattr(lib, "cuStreamGetGreenCtx", None)
                make = getattr(lib, "cuGreenCtxStreamCreate", None)
                if get is None or make is None:
                    get = make = None
                else:
                    get.argtypes, get.restype = (ctypes.c_void_p, ptr), ctypes.c_int
                    make.argtypes, make.restype = (ptr, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int), ctypes.c_int
                fns = (get, make, plain)
        _DRIVER.append(fns)
    return _DRIVER[0]


def _green_context(stream: int) -> int | None:
    """The green context `stream` (a CUstream handle; 0, the legacy default stream, means the current context's)
    runs in, or None: not in one, or a driver without green contexts (before CUDA 12.5), or not NVIDIA's."""
    fns = _driver()
    if fns is None or fns[0] is None:
        return None
    green = ctypes.c_void_p()
    return green.value if fns[0](stream, ctypes.byref(green)) == 0 and green.value else None


def ready_words(B: int, NT: int, wait_chunks: int, HV: int, walk_programs: int) -> int:
    """int32 words of the workspace a walk beside the prepare shares with it: the `[B, groups, HV]` counters, then
    one flag a walk program (`spin_zero`)."""
    return B * cdiv(NT, wait_chunks) * HV + walk_programs


@triton.jit
def ready_counter(ready, i_n, t0, T, NT, i_hv, HV: tl.constexpr, BT: tl.constexpr, W: tl.constexpr):
    """The counter of the group of W chunks that holds the chunk at token t0 of dense sequence i_n, in
    `ready` ([B, groups, HV] int32, a group's counters HV apart): the prepare counts its chunks into it and
    the walk beside the prepare awaits it (`ready_zero`)."""
    c = (t0 - i_n * T) // BT
    return ready + (i_n * tl.cdiv(NT, W) + c // W) * HV + i_hv


@triton.jit
def count_chunk(ready, i_n, t0, T, NT, i_hv, HV: tl.constexpr, BT: tl.constexpr, W: tl.constexpr):
    """This program's chunk is stored: 1 added to its group's counter with release semantics, after a
    barrier, so that every thread's stores come before it."""
    tl.debug_barrier()
    tl.atomic_add(ready_counter(ready, i_n, t0, T, NT, i_hv, HV, BT, W), 1, sem="release", scope="gpu")


@triton.jit
def finish(i_p, i_hv, N, NT, HV: tl.constexpr):
    """After this program's chunk is counted: the dense grid's last program (the last sequence's last chunk, the
    last value head) waits for the grid it was launched after (the walk, when a recorded call launches the prepare
    as the walk's programmatic dependent: `kda.replay`), so that the prepare ends after the walk and the stream's
    next work sees the walk's outputs. One waiting program holds one slot, so every chunk the walk awaits still
    finds one. Without such a launch the wait returns at once."""
    if (i_p == N * NT - 1) & (i_hv == HV - 1):
        gdc_wait()


@triton.jit
def last_program_waits(WAITS: tl.constexpr):
    """With WAITS, the grid's last program (dispatched last) waits for the grid this one was launched after as its
    programmatic dependent (the routed short sequences' loop after the walk, `kda.ops.chunk`), so that the launch
    still ends after that grid; one waiting program holds one slot. It always finishes: a programmatic dependent
    starts only once every program of the grid before it has started (each lets it at its start), so that grid runs
    to its end whatever this program holds, on any number of SMs. Without such a launch it returns at once."""
    if WAITS:
        if ((tl.program_id(0) == tl.num_programs(0) - 1) & (tl.program_id(1) == tl.num_programs(1) - 1)
                & (tl.program_id(2) == tl.num_programs(2) - 1)):
            gdc_wait()


@direct
@triton.jit
def _zero_counters_kernel(ready, n, BLOCK: tl.constexpr):
    """The counters of a walk beside a prepare that has no gate pass to zero them, before the prepare. A kernel
    of ours rather than `Tensor.zero_`: `kda.replay` records and replays only this package's launches."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ready + o, tl.zeros([BLOCK], dtype=tl.int32), mask=o < n)


@triton.jit
def ready_zero(ready_h, t, t_begin, t_end, HV: tl.constexpr, BT: tl.constexpr, WAIT: tl.constexpr,
               SPIN: tl.constexpr, z_prev, bail, flag):
    """(0, bail), once the group of WAIT chunks holding the chunk at token t (of a walk from t_begin to t_end) is
    counted in `ready_h` (one counter a group, HV apart), or bail set where the wait gave up (`spin_zero`, which
    sets the program's `flag` too). Only a group's first chunk waits, and none once the program gave up (the wait
    reads the flag before it starts its timer: `bail` kept out of the wait's predicate, where each wait would hang
    on the one before and slow the pipelined loop, docs/performance.md); the others take z_prev, the zero of the
    chunk before (each load depends on every earlier wait, so no compiler moves it above one); at once for
    t >= t_end (a prefetch past the end)."""
    first = (t < t_end) & ((t - t_begin) % (WAIT * BT) == 0)
    g_i = tl.where(first, (t - t_begin) // (WAIT * BT), 0)
    target = tl.where(first, tl.cdiv(tl.minimum(t + WAIT * BT, t_end) - t, BT), 0).to(tl.int32)
    z, gave_up = spin_zero(ready_h + g_i * HV, target, first.to(tl.int32), z_prev, SPIN, flag)
    return z, bail | gave_up


@triton.jit
def counted_after(ready_h, t, t_begin, t_end, HV: tl.constexpr, BT: tl.constexpr, W: tl.constexpr,
                  SPIN: tl.constexpr, z_prev, G: tl.constexpr):
    """(t_run, z): where the run of groups of W chunks that are counted already ends, from the group starting at
    token t of a walk from t_begin to t_end, at most G groups on (t_run = t: that group is not counted). No wait:
    the G counters read at once, each by acquire loads (a lane a group), then a barrier, so that every thread's
    later loads come after every acquire, and with SPIN a proxy fence (tiles read by TMA); z is z_prev through
    it, for the walk's addresses. G is 32 x the program's warps, a lane a thread: each counter is read once and
    the min crosses the warps, so every thread gets the one run. With fewer lanes each warp holds and reads a copy
    of all of them, at its own moment, and warps that see different counts walk loops of different lengths, the
    ones ahead waiting at a barrier forever (seen on the H100 and H200). A walk by groups goes on through the
    groups the prepare has finished in one pipelined loop rather than restarting its loop at each group; it
    waits (`spin_zero`) only where it caught up with the prepare. The bits are the same either way."""
    SPAN: tl.constexpr = W * BT
    o_g = tl.arange(0, G)
    lo = t + o_g * SPAN
    ok = lo < t_end
    need = tl.cdiv(tl.minimum(lo + SPAN, t_end) - lo, BT)
    ptr = ready_h + ((t - t_begin) // SPAN + o_g) * HV
    if SPIN:  # not pure: kept before the barrier
        n = tl.inline_asm_elementwise(
            "{ .reg .pred p; mov.b32 $0, 0; setp.ne.s32 p, $2, 0; @p ld.acquire.gpu.global.b32 $0, [$1]; }",
            "=r,l,r", [ptr.to(tl.int64, bitcast=True), ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()
    else:
        n = tl.atomic_add(ptr, 0, mask=ok, sem="acquire", scope="gpu")
    run = tl.min(tl.where(ok & (n >= need), G, o_g))
    if SPIN:  # `run` as an input (unread): after the reads
        z_prev = tl.inline_asm_elementwise("{ fence.proxy.async.global; mov.b32 $0, $2; }", "=r,r,r", [run, z_prev],
                                           dtype=tl.int32, is_pure=True, pack=1)
    return tl.minimum(t + run * SPAN, t_end), z_prev


@triton.jit
def spin_zero(ptr, target, spin, z_prev, SPIN: tl.constexpr, flag):
    """(z_prev, 0) once the counter at `ptr` reaches `target` where `spin` is set (else at once); (z_prev, 1) where
    it has not within 20 ms of the global timer (a prepare group takes microseconds): the wait gives up, so a walk
    program never holds its SM for longer, whatever runs beside it or however few SMs the prepare can reach
    (`chunk_walk._chunk_state_kernel`, `resume`). Each thread spins and times itself, so a count that completes
    as the budget ends may find one thread given up and another not: a thread that gives up also sets the
    program's `flag` (an atomic or), which the program reads after a barrier as its one decision; a wait that
    finds the flag set (this program gave up before) gives up at once.
    The prepare programs each add 1 with release semantics after their stores (`count_chunk`), so what they stored
    is visible to this thread's later loads. One PTX block with its own loop (an acquire, then a proxy
    fence for tiles read by TMA, the async proxy), so that Triton's IR holds no loop: the pipeliner moves it with
    the prefetches whose coordinates depend on it. A pure op to the compiler (the pipeliner runs it for prefetches
    past the end too, where `ready_zero` asks for no spin). Without SPIN, the interpreter, which runs the prepare
    to its end first: one atomic read where `spin` is set, and a count short of `target` gives up at once."""
    if SPIN:
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .s32 v; .reg .u64 t0, t1; mov.b32 $1, 0; setp.eq.s32 p, $4, 0; @p bra DONE; "
            "ld.acquire.gpu.global.b32 v, [$2]; setp.ge.s32 p, v, $3; @p bra READY; "  # counted: no timer read
            "ld.relaxed.gpu.global.b32 v, [$6]; setp.ne.s32 p, v, 0; @p bra GAVE; "  # the program gave up: no wait
            "mov.u64 t0, %globaltimer; "
            "SPIN: ld.acquire.gpu.global.b32 v, [$2]; setp.ge.s32 p, v, $3; @p bra READY; "
            "mov.u64 t1, %globaltimer; sub.u64 t1, t1, t0; setp.lt.u64 p, t1, 20000000; @p bra SPIN; "
            "red.relaxed.gpu.global.or.b32 [$6], 1; GAVE: mov.b32 $1, 1; bra DONE; "
            "READY: fence.proxy.async.global; DONE: mov.b32 $0, $5; }",
            "=r,=r,l,r,r,r,l",
            [ptr.to(tl.int64, bitcast=True), target, spin, z_prev, flag.to(tl.int64, bitcast=True)],
            dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        n = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu", mask=spin != 0)
        gave_up = ((spin != 0) & (n < target)).to(tl.int32)
        tl.atomic_or(flag, gave_up, mask=gave_up != 0)
        return z_prev, gave_up
