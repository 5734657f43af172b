"""What one validated call launches: the host-side plan, built before any kernel module runs.

`prefill_plan(call)` and `decode_plan(call)` turn a `kda.contract.KDACall` and the device's properties
(`DeviceInfo`: SM count, shared memory, capability) into frozen objects that say everything the kernel modules
(`kda.ops.chunk`, `kda.ops.fused_recurrent`) launch and nothing else: which kernels run (the fused bounded-gate
prepare or the split one, whether the walk applies the inverse itself; the one-token decode kernel or the loop
kernel), their tiles, warps and stages, the dot precision and workspace dtype, and which sequences of a
`chunk_kda` call the recurrent loop takes (`Route`). Planning reads shapes, dtypes, flags and host bounds, never a
tensor's values, and allocates nothing; the kernel modules read the plan and never plan. Tests pick a path by
building a plan with keyword overrides (`chunk_plan(call, walk_BV=64)`) or for another device
(`chunk_plan(call, device=DeviceInfo(...))`), never by rewriting globals; a whole run (the test suite's or the
benchmark's `--plan-device sm_80`) plans every GPU as an older one through `plan_as`.

Same bits whatever the batch: a choice that changes a `chunk_kda` sequence's arithmetic (the prepare's form, the dot
precision, the workspace dtype, the gate pass's slices, the walk's V block and `ChunkPlan.fold` by `wide_heads`,
the recurrent route of short sequences) follows only the dtypes, the flags, the head counts, K, V, the device and
the sequence's own length; what else is in the call moves only choices that keep the bits (stages, TMA, the walk
beside the prepare, grid sizes). docs/contract.md, "Batch invariance".

The tuning constants of an architecture are one `Tuning` (`TUNINGS`); the measurements behind them are in
docs/performance.md ("Tuning constants"). No environment variable chooses a kernel.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton

from .contract import CHECKPOINT_MULTIPLE, KDACall, host_lengths, interpreting

LOG2E = 1.4426950408889634
# (major, minor) of the Triton releases the Gluon kernels were tested with: Gluon's API moves between releases
GLUON_TRITON = ((3, 6),)
TRITON = tuple(int(x) for x in triton.__version__.split(".")[:2])
CHUNK = 64  # BT: tokens per chunk of the prepare stage and the walk
assert CHECKPOINT_MULTIPLE % CHUNK == 0  # every checkpoint offset is a chunk end of the walk
SUB = 16  # BC: rows of the diagonal blocks inverted by forward substitution (split prepare)
FUSED_SUB = 4  # the fused prepare's: 4 x 4 diagonal blocks by their series, then four block merges as tf32 dots
# The fused prepare anchors each 32-row half of a chunk at its middle row: a factor 2^(b_i - a) spans at most
# 16 tokens of the gate, |lb| log2(e) each, and must stay below fp32's 2^128 with K terms summed.
BOUNDED_GATE_MAX_LOG2_SPAN = 118.0
SR_MODES = {torch.bfloat16: 1, torch.float16: 2}  # `DecodePlan.sr` of a stochastically rounded 2-byte pool


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` as plain Python: Triton's is a constexpr function, several microseconds a call."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` (n >= 0) as plain Python, for the same reason."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.cache
def interpreted() -> bool:
    """Whether the kernels run in the interpreter, read once: `triton.jit` chose the interpreter or the
    compiler once, when the kernels of `kda.ops` were defined, so reading `TRITON_INTERPRET` at every call
    would cost time without following a later change."""
    return interpreting()


# eq=False: hashed by identity, one object per device (`device_info`), so the plans' caches key on it for free
@dataclass(frozen=True, eq=False)
class DeviceInfo:
    """What the plan needs of a device, read once per device: its SM count, compute capability, shared memory a
    block may opt into, and the features that follow from them. The interpreter is a device of its own
    (`INTERPRETER`: one SM, launches run one after another, TMA emulated)."""

    sm_count: int
    capability: tuple[int, int]
    max_smem: int  # bytes of shared memory one block may use
    hip: bool = False
    interpreter: bool = False
    triton: tuple[int, int] = TRITON  # the Triton release the kernels compile with (major, minor)

    @property
    def tma(self) -> bool:
        """Tensor-memory-accelerator loads (Hopper and later on NVIDIA; the interpreter emulates them)."""
        return self.interpreter or (not self.hip and self.capability >= (9, 0))

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch (Hopper and later on NVIDIA)."""
        return not self.interpreter and not self.hip and self.capability >= (9, 0)

    @property
    def ptx(self) -> bool:
        """Inline PTX may run (NVIDIA GPUs): the decode's paired bf16 conversion. Never on HIP, never in the
        interpreter."""
        return not self.interpreter and not self.hip

    @property
    def register_cap(self) -> bool:
        """A launch may cap the registers a thread (`maxnreg`, NVIDIA's compiler option): the devices that run
        inline PTX, never HIP or the interpreter."""
        return self.ptx

    @property
    def spin(self) -> bool:
        """A walk may spin on the prepare's counters beside it: its wait is PTX with Hopper's proxy fence, and
        the kernels around it take PDL's griddepcontrol (sm_90 and later on NVIDIA; sm_80's ptxas refuses both)."""
        return self.pdl

    @property
    def gluon(self) -> bool:
        """The Gluon kernels (`kda.ops.hopper_prepare`) may run: sm_90 exactly (their wgmma), NVIDIA, never the
        interpreter, under a Triton release they were tested with (`GLUON_TRITON`)."""
        return not self.interpreter and not self.hip and self.capability == (9, 0) and self.triton in GLUON_TRITON

    @property
    def tf32(self) -> bool:
        """tf32 dots: NVIDIA from Ampere (sm_80) on; on AMD CDNA3 (gfx942, capability 9.4) as xf32. Triton has no
        tf32 for gfx950 (CDNA4)."""
        if self.interpreter:
            return False
        return self.capability == (9, 4) if self.hip else self.capability >= (8, 0)


INTERPRETER = DeviceInfo(sm_count=1, capability=(0, 0), max_smem=227 * 1024, interpreter=True)


# the devices a run may plan its GPU as (`plan_as`; the test suite's and the benchmark's `--plan-device NAME`):
# capability and the shared memory a block may opt into. sm_80: the A100's 163 KiB.
PLAN_DEVICES = {"sm_80": ((8, 0), 166912)}
# (capability, max_smem) every GPU is planned as, None for a GPU's own (`plan_as`)
_PLANNED_AS: tuple[tuple[int, int] | None, int | None] = (None, None)


@functools.cache
def device_info(device_index: int) -> DeviceInfo:
    """The `DeviceInfo` of CUDA (or HIP) device `device_index`: its own properties, with the capability and
    shared memory `plan_as` set, if any."""
    props = torch.cuda.get_device_properties(device_index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 0)
    capability, max_smem = _PLANNED_AS
    return DeviceInfo(props.multi_processor_count, capability or (props.major, props.minor), max_smem or smem,
                      hip=torch.version.hip is not None)


def plan_as(capability: tuple[int, int] | None = None, max_smem: int | None = None) -> None:
    """Plan every GPU call as if its device had this compute capability and this much shared memory a block (None:
    the device's own), its SM count and vendor its own; `plan_as()` restores the devices' own descriptions.
    For the test suite and the benchmark (`--plan-device sm_80`: an A100's plan run on the H200,
    docs/platforms.md), not for serving: the kernels still compile for the device at hand, so describe it as an
    older one (fewer features, less shared memory), never as a newer one. Set it before the calls it is for, on
    one thread: it drops the cached device descriptions and the recorded calls (`kda.replay`), whose launches
    follow the previous description's plans (the plan caches key on the description, a new object)."""
    global _PLANNED_AS
    _PLANNED_AS = (None if capability is None else tuple(capability), max_smem)
    device_info.cache_clear()
    from . import replay  # imported here: replay imports this module

    replay.CACHE.clear()


def device_of(call: KDACall) -> DeviceInfo:
    """The device a call's kernels run on: its tensors' GPU, or the interpreter."""
    if interpreted() or not call.q.is_cuda:
        return INTERPRETER
    return device_info(call.q.device.index or 0)


@dataclass(frozen=True, eq=False)  # hashed by identity, as DeviceInfo: one object per architecture
class Tuning:
    """The plan's tuning constants for one architecture; docs/performance.md ("Tuning constants") has the
    measurement behind each, by this name."""

    short_len: int = 16  # `chunk_kda` sends sequences of 1..short_len tokens through the recurrent loop kernel
    wait_chunks: int = 1  # chunks a BV-32 walk beside the prepare awaits at a time (outer loop; counted ones walked on)
    beside_bv64_chunks: int = 2048  # (chunk, head) programs from which a BV-64 walk runs beside the prepare
    wait_chunks_bv64: int = 2  # groups a BV-64 TMA walk awaits inside its pipelined loop
    wait_chunks_bv64_outer: int = 4  # groups a BV-64 pointer walk awaits in its outer loop
    late_per_slot: int = 12  # the walk beside the prepare's tail starts NT * free / (late_per_slot * HV) chunks early
    walk_max_stages: int = 4  # the walk's pipeline depth by TMA, at most (stages - 1 chunks in flight; pointer walks 3)
    walk_smem_reserve: int = 8192  # shared memory the walk keeps besides its chunks in flight (K = 128, fp16)


# Measured on the H200 (sm_90); other architectures take the same values until measured (docs/platforms.md).
TUNINGS = {"sm90": Tuning()}


def tuning_of(device: DeviceInfo) -> Tuning:
    """The `Tuning` a device takes."""
    return TUNINGS["sm90"]


def dot_precision(input_dtype: torch.dtype, device: DeviceInfo) -> str:
    """Precision of the fp32 dots: exact ("ieee") for fp32 inputs, in the interpreter and on devices without
    tf32 dots (`DeviceInfo.tf32`; a caller passing fp32 asks for fp32 accuracy); tf32 for bf16/fp16 inputs, with
    every fp32 operand rounded to nearest tf32 before the dot (`kda.ops.common.tf32_round`), so its 2^-11
    rounding stays below the inputs' own."""
    if not device.tf32 or input_dtype == torch.float32:
        return "ieee"
    return "tf32"


def bounded_gate(call: KDACall) -> bool:
    """Whether the fused prepare kernel may run: the in-kernel lower-bound gate g = lb sigmoid(.) costs at most
    |lb| log2(e) log2 units per token, so 16 tokens stay within 2^118 for |lb| <= 5.11 (Kimi's -5 gives
    2^115.4); and q, k are l2-normalised in the kernel, so a dot of K such terms stays below 2^128. Other
    gates (a raw log-decay may be -1000 per token) take the split prepare with its pairwise diagonal."""
    return (call.use_gate_in_kernel and call.lower_bound is not None and call.use_qk_l2norm_in_kernel
            and -call.lower_bound * LOG2E * 16 <= BOUNDED_GATE_MAX_LOG2_SPAN)


def workspace_dtype(input_dtype: torch.dtype, qk_l2norm_in_kernel: bool) -> torch.dtype:
    """Storage of Qd, Kd, M and N, the bulk of what the walk reads per chunk. fp16 when the inputs are
    16-bit and q, k are l2-normalised in the kernel: then |Qd| <= scale, |Kd|, |Kr| <= 1, |A_qk| <= scale,
    M = Xb^T Kr and N = A_qk Xb are stored times a power of two per chunk (`chunk_prepare._store_folded`),
    and fp16's 11-bit significand is what the tf32 dots that consume them keep. Otherwise fp32 (raw q, k
    have no bound; fp32 inputs ask for fp32 accuracy)."""
    if input_dtype != torch.float32 and qk_l2norm_in_kernel:
        return torch.float16
    return torch.float32


@dataclass(frozen=True)
class ChunkPlan:
    """The kernels `kda.ops.chunk.chunk_kda_fwd` launches for one call, their tiles and their options."""

    # "fused" (`_chunk_prepare_kernel`), "hopper" (its Gluon form, `gluon_prepare`) or "split" (`_chunk_intra_kernel`
    # + `_chunk_solve_kernel`)
    prepare: str
    dot_prec: str  # input_precision of the fp32 dots (`dot_precision`)
    ws_dtype: torch.dtype  # Qd, Kd, M and N
    BT: int = CHUNK
    BC: int = FUSED_SUB  # the fused prepare's forward-substitution blocks (the split prepare's are SUB)
    prepare_BK: int = 32  # K slice of the fused prepare
    prepare_warps: int = 4
    cumsum_fp64: bool = True  # the fused prepare's cumulative decay in fp64 (fp32 inputs) or fp32
    gate_pass: bool = False  # the fp32 cumsum in `_chunk_gate_kernel` before the fused prepare (fp32 only)
    # the gate pass's K slice and warps: one configuration for every call, since the cumsum's bits follow it
    gate_BK: int = 64
    gate_warps: int = 2
    walk_BV: int = 32
    walk_warps: int = 4
    walk_stages: int = 2
    walk_tma: bool = False  # the walk loads its chunk tiles by TMA (ragged tensor descriptors)
    short_len: int = 16  # sequences of 1..short_len tokens go through the recurrent loop (`Route`)
    wait_chunks: int = 0  # > 0: the walk runs beside the prepare, awaiting groups of this many chunks (`_beside`)
    wait_in_loop: bool = False  # it awaits them inside its pipelined loop (`_chunk_state_kernel`'s WAIT_IN_LOOP)
    # > 0: the fused prepare's last late_chunks chunk programs are a second launch, and the walk beside it starts
    # after the first launch has finished (it then holds its SMs for the tail of the prepare only)
    late_chunks: int = 0
    # False (fused prepare, fp16 workspaces): the prepare stores Xb, A_qk and Kr instead of folding the inverse
    # into M and N, and the walk forms U = Xb D itself (a dot more a step, the prepare's fold dots fewer). It
    # changes the arithmetic, so it follows the heads and the device alone (`wide_heads`), never the batch.
    fold: bool = True
    spin: bool = True  # a waiting walk spins in PTX (`DeviceInfo.spin`: sm_90 and later, not HIP or the interpreter)


class Route(NamedTuple):
    """Where a `chunk_kda` call's sequences go. `short` > 0: those of 1..short tokens take the recurrent loop
    kernel (`loop` its plan), chosen on the device by each sequence's own length; `kept` sequences (the others,
    empty ones included) have walk programs, and the gate and prepare grids hold `kept_chunks` chunks (None:
    the full grids, where the host has no lengths). `varlen`: the chunk kernels locate sequences through
    `cu_seqlens` (a lone varlen prefill with host bounds runs as the dense call it equals)."""

    short: int
    kept: int
    kept_chunks: int | None
    varlen: bool
    loop: DecodePlan | None


def chunk_plan(call: KDACall, device: DeviceInfo | None = None, **overrides) -> ChunkPlan:
    """The kernels of a `chunk_kda` call (module docstring); `overrides` replace any field (tests)."""
    return prefill_plan(call, device, **overrides)[0]


def prefill_plan(call: KDACall, device: DeviceInfo | None = None, **overrides) -> tuple[ChunkPlan, Route]:
    """A `chunk_kda` call's plan: its kernels (`ChunkPlan`) and where its sequences go (`Route`)."""
    device = device_of(call) if device is None else device
    tune = tuning_of(device)
    wide = wide_heads(call, device)
    walk_BV = _walk_bv(call, wide)
    plan = _chunk_plan(call.q.dtype, call.use_qk_l2norm_in_kernel, bounded_gate(call), call.K, call.V, walk_BV,
                       device.tma and call.B * call.T <= 2**30, wide, gluon_prepare(call, device), device, tune)
    beside = _beside(call, walk_BV, device, tune)
    late = 0 if beside else _tail_chunks(call, walk_BV, plan, device, tune)
    if late:
        plan = _beside_plan(plan, False, tune, late)
    elif beside:
        plan = _beside_plan(plan, walk_BV != 64, tune)
    if overrides:
        plan = replace(plan, **overrides)
        if not plan.fold and (plan.prepare not in ("fused", "hopper") or plan.ws_dtype != torch.float16):
            raise ValueError("ChunkPlan.fold=False needs the fused prepare and fp16 workspaces")
        _check_device(plan, device)
        if plan.prepare == "hopper" and plan.gate_pass:
            raise ValueError("ChunkPlan.prepare='hopper' forms b2 itself: it takes gate_pass=False")
    return plan, route(call, plan, device)


def _check_device(plan: ChunkPlan, device: DeviceInfo) -> None:
    """Refuse an overridden plan that asks for what `device` lacks: TMA loads, the PTX spin, or waits inside the
    walk's loop on a GPU without the spin (there the wait is the interpreter's form, one read of the counter: the
    interpreter runs the prepare to its end first, a GPU does not)."""
    if plan.walk_tma and not device.tma:
        raise ValueError(f"ChunkPlan.walk_tma: {device} has no TMA")
    if plan.spin and not device.spin:
        raise ValueError(f"ChunkPlan.spin: {device} has no PTX spin")
    if plan.wait_chunks and plan.wait_in_loop and not device.spin and not device.interpreter:
        raise ValueError(f"ChunkPlan.wait_in_loop: a wait inside the walk's loop needs the PTX spin, which {device} "
                         "lacks")
    if plan.prepare == "hopper" and not (device.gluon and plan.ws_dtype == torch.float16):
        raise ValueError(f"ChunkPlan.prepare='hopper': the Gluon prepare needs sm_90 under Triton {GLUON_TRITON} "
                         f"({device}) and fp16 workspaces")


def route(call: KDACall, plan: ChunkPlan, device: DeviceInfo | None = None) -> Route:
    """The `Route` of a call under `plan`: from the sorted host lengths (dense, or `cu_seqlens_cpu`) where the host
    has them, which only trim the grids; else every varlen call routes on the device over the full grids."""
    S, N = plan.short_len, call.N
    varlen = call.cu_seqlens is not None and not one_whole_sequence(call)
    if S == 0:
        return Route(0, N, None, varlen, None)
    lengths = _sorted_lengths(call)
    loop = _decode_plan(call.K, call.V, call.state_v_first, call.state_dtype, False, False, device or device_of(call))
    if lengths is None:
        return Route(S if call.cu_seqlens is not None else 0, N, None, varlen, loop)
    first_long, routed = _routed(lengths, S)
    if not routed:
        return Route(0, N, None, varlen, loop)
    return Route(S, N - routed, sum((n + CHUNK - 1) // CHUNK for n in lengths[first_long:]), varlen, loop)


def _sorted_lengths(call: KDACall) -> list[int] | None:
    """Every sequence's length, sorted, where the host has it: dense, or varlen with `cu_seqlens_cpu` (bounds
    in a CPU tensor are not read: CPU and GPU runs are to take the same path, and on a GPU the read would
    be a sync). Else None."""
    if call.N == 0 or (call.cu_seqlens is not None and call.host_bounds is None):
        return None
    lengths = host_lengths(call.cu_seqlens, call.host_bounds, call.T, call.N)
    lengths.sort()
    return lengths


def _routed(lengths: list[int], S: int) -> tuple[int, int]:
    """(index of the first length over S, how many lengths are in 1..S) of sorted `lengths`."""
    first_long = bisect.bisect_right(lengths, S)
    return first_long, first_long - bisect.bisect_left(lengths, 1)


def one_whole_sequence(call: KDACall) -> bool:
    """The call holds one sequence of all T tokens, known on the host: dense with B = 1, or varlen with one
    sequence and host bounds [0, T] (`cu_seqlens_cpu`), the form a serving engine passes for a lone prefill
    (bounds [0, t < T] leave trailing rows, zeroed by the varlen kernels)."""
    if call.cu_seqlens is None:
        return call.B == 1
    return call.N == 1 and call.host_bounds is not None and call.host_bounds[1] == call.T


def wide_heads(call: KDACall, device: DeviceInfo) -> bool:
    """Whether the heads are too many for a walk at V blocks of 32 to run beside the prepare (its programs, one
    an SM, would hold more than half the SMs for one sequence). Then the prepare bounds a call: the walk takes V
    blocks of 64 (half the programs, two an SM by TMA) and applies the inverse itself (`ChunkPlan.fold` off,
    where the prepare is fused and the workspaces fp16), shedding the prepare's fold dots. From the heads, K, V
    and the device alone: both choices change the arithmetic (the fp16 operands' scales are a V block's), so
    the batch must not move them. On a GPU with TMA (a pointer walk at V blocks of 64 spills: sm_80 in
    benchmarks/results/offline-compile.md), V > 32 and K <= 128 (a [K, 64] fp32 state tile in registers)."""
    if call.V <= 32 or call.K > 128 or device.interpreter or not device.tma:
        return False
    return 2 * call.HV * cdiv(call.V, 32) > device.sm_count


def gluon_prepare(call: KDACall, device: DeviceInfo) -> bool:
    """Whether the fused prepare runs as its Gluon form (`kda.ops.hopper_prepare`, `DeviceInfo.gluon`): on sm_90
    under the Triton its GPU tests ran with, at every head count (it forms b2 itself, so the call has no gate pass;
    docs/performance.md, "Tuning constants"). It needs K = V = 128 and as many q/k heads as value heads (the shapes
    its GPU tests and timings cover; K = V = 256 compiles to 184 KB of shared memory, one program an SM), and q, k,
    v at 16-byte aligned addresses and token and head strides (its asynchronous copies); `_chunk_plan` takes it only
    for the fused prepare with tf32 dots and fp16 workspaces, in place of the gate pass. It changes the bits (the
    state about 2e-5 relative from the twin's, the bf16 output 5e-4), so it follows K, V, the heads, the inputs'
    layout and the device, never the batch."""
    if not device.gluon or call.K != 128 or call.V != 128 or call.H != call.HV:
        return False
    return all(x.data_ptr() % 16 == 0 and x.stride(-2) % 16 == 0 and x.stride(-3) % 16 == 0
               for x in (call.q, call.k, call.v))


def _walk_bv(call: KDACall, wide: bool) -> int:
    """The walk's V block: 64 for `wide_heads`, else 32 (16 for V <= 16)."""
    return 16 if call.V <= 16 else (64 if wide else 32)


def _may_wait(call: KDACall, device: DeviceInfo) -> bool:
    """Whether a walk may await the prepare's chunks at all: on an NVIDIA GPU from Hopper on (`DeviceInfo.spin`;
    the interpreter runs the launches one after another), a prepare to fork after (T > 0), dense rows or one whole
    varlen sequence."""
    if call.T == 0 or not device.spin:
        return False
    return call.cu_seqlens is None or one_whole_sequence(call)


def _beside(call: KDACall, walk_BV: int, device: DeviceInfo, tune: Tuning) -> bool:
    """Whether the walk runs beside the prepare (`kda.ops.chunk`): a dense call (or a lone varlen prefill with
    host bounds, run as dense) whose walk programs, one an SM, leave at least half the SMs to the prepare, so
    the prepare's programs always find SMs while the walk's await them; at V blocks of 64 only for long prepares
    (`Tuning.beside_bv64_chunks`)."""
    if not _may_wait(call, device):
        return False
    heads = call.N * call.HV
    if 2 * heads * cdiv(call.V, walk_BV) > device.sm_count:
        return False
    return walk_BV != 64 or heads * cdiv(call.T, CHUNK) >= tune.beside_bv64_chunks


def _tail_chunks(call: KDACall, walk_BV: int, plan: ChunkPlan, device: DeviceInfo, tune: Tuning) -> int:
    """The chunks beside which a walk too wide to run beside the whole prepare (`_beside`) runs
    (`ChunkPlan.late_chunks`; `Tuning.late_per_slot`), or 0: one sequence, a long fused prepare after its gate pass
    or the Gluon one (`Tuning.beside_bv64_chunks`), a walk at V blocks of 64 (two programs an SM) whose programs
    leave at least a quarter of the prepare's slots, fewer late chunks than chunks: with fewer than two walk programs
    an SM some SM holds at most one, and a prepare program fits beside one, so on the whole GPU no wait reaches its
    budget (where it would, the call still finishes: `kda.ops.overlap`)."""
    NT = cdiv(call.T, CHUNK)
    if (not _may_wait(call, device) or walk_BV != 64 or call.K > 128 or plan.prepare == "split"
            or not (plan.gate_pass or plan.prepare == "hopper") or call.N != 1
            or call.HV * NT < tune.beside_bv64_chunks):
        return 0
    slots = 2 * device.sm_count
    free = slots - call.HV * cdiv(call.V, 64)  # the prepare slots beside the walk's programs
    late = cdiv(NT * free, tune.late_per_slot * call.HV)
    return late if 4 * free >= slots and late < NT else 0


@functools.lru_cache(maxsize=1024)
def _beside_plan(plan: ChunkPlan, outer: bool, tune: Tuning, late: int = 0) -> ChunkPlan:
    """`plan` with the waits of a walk beside the prepare, cached so that every call at a shape gets the
    same frozen object (no dataclass rebuilt per call). `outer`: groups awaited by the walk's outer loop (V blocks
    of 32); else (V blocks of 64) inside the pipelined loop for TMA walks (pointer loads lose their pipelining
    behind an in-loop wait)."""
    if outer:
        return replace(plan, wait_chunks=tune.wait_chunks)
    return replace(plan, wait_chunks=tune.wait_chunks_bv64 if plan.walk_tma else tune.wait_chunks_bv64_outer,
                   wait_in_loop=plan.walk_tma, late_chunks=late)


def walk_reserve(BK: int, BV: int, ws_dtype: torch.dtype, dot_prec: str, tma: bool, tune: Tuning) -> int:
    """Shared memory the walk holds besides its chunks in flight: `Tuning.walk_smem_reserve` at K blocks of 128
    in fp16 workspaces, in proportion to the K block and the workspace's element size (S's staged tile). A TMA walk
    with exact ("ieee") dots also stages fp32 operands of a chunk's rows (K, V and chunk wide) in shared memory
    (offline sm_90, fp32 inputs at V blocks of 32: 28.8 KB at K blocks of 16 to 57.4 KB at 128); pointer walks keep
    a chunk a stage, whose slack has held it (sm_80; on AMD every dot is exact)."""
    staged = CHUNK * (BK + BV + CHUNK) * 4 if tma and dot_prec == "ieee" else 0
    return tune.walk_smem_reserve * (BK * ws_dtype.itemsize) // (128 * 2) + staged


@functools.lru_cache(maxsize=1024)
def _chunk_plan(input_dtype: torch.dtype, qk_l2norm_in_kernel: bool, fused: bool, K: int, V: int, walk_BV: int,
                tma: bool, wide: bool, gluon: bool, device: DeviceInfo, tune: Tuning) -> ChunkPlan:
    """`chunk_plan` from what determines it, cached: one frozen plan shared by every call that agrees."""
    prec = dot_precision(input_dtype, device)
    ws_dtype = workspace_dtype(input_dtype, qk_l2norm_in_kernel)
    BK = max(16, next_power_of_2(K))
    # TMA wants 16-byte rows and row strides: K, V multiples of 8 (fp16 and fp32 tiles)
    walk_tma = tma and K % 8 == 0 and V % 8 == 0
    # the chunks that fit in shared memory beside `walk_reserve`: a chunk's Kd, Qd, M, N and V (V counted at 4
    # bytes, as fp32 inputs have it)
    per_stage = (3 * CHUNK * BK + CHUNK * CHUNK) * ws_dtype.itemsize + CHUNK * walk_BV * 4
    chunks = (device.max_smem - walk_reserve(BK, walk_BV, ws_dtype, prec, walk_tma, tune)) // per_stage
    if walk_tma:  # Triton's pipeliner holds stages - 1 chunks of TMA tiles (benchmarks/results/offline-compile*.md)
        stages = max(1, min(tune.walk_max_stages, 1 + chunks))
    else:  # pointer walks keep a chunk a stage (untimed on sm_80 and AMD; gfx950's LDS overflows at 1 + chunks)
        stages = max(1, min(tune.walk_max_stages - 1, chunks))
    if walk_tma and walk_BV == 64 and BK <= 128:
        stages = min(stages, 2)  # two programs an SM by TMA: twice the walk programs run at once
    # the Gluon form stores fp16 workspaces and forms b2 itself (`gluon_prepare`): no gate pass before it
    hopper = fused and gluon and prec == "tf32" and ws_dtype == torch.float16
    return ChunkPlan(
        prepare="hopper" if hopper else ("fused" if fused else "split"),
        dot_prec=prec, ws_dtype=ws_dtype, prepare_BK=min(32, BK), cumsum_fp64=prec == "ieee",
        gate_BK=min(64, BK),
        gate_pass=prec != "ieee" and not hopper,  # the twin's fp32 cumsum: faster in its own pass (docs/performance.md)
        walk_BV=walk_BV, walk_stages=stages, walk_tma=walk_tma, short_len=tune.short_len,
        fold=not (wide and fused and ws_dtype == torch.float16), spin=device.spin,
    )


@dataclass(frozen=True)
class DecodePlan:
    """What `kda.ops.fused_recurrent.fused_recurrent_kda_fwd` launches for one call."""

    BK: int
    BV: int
    num_warps: int
    nsub: int = 0  # 0: `_fused_recurrent_kda_kernel` (the loop); 1, 2, 4: `_fused_recurrent_one_token_kernel`
    sr: int = 0  # store rounding: 0 nearest even, 1 stochastic bf16, 2 stochastic fp16
    kc: int = 0  # K-first one-token kernel: rows of K per chunk, the plane read twice (0: the whole tile once)
    heads_fastest: bool = False  # one-token kernel: grid (V block, value head, sequence), not (.., sequence, head)
    packed: bool = False  # K-first one-token kernel: the V block read once and held (2-byte: as 32-bit words)
    ptx: bool = False  # packed 2-byte words converted by one PTX instruction (`DeviceInfo.ptx`), else two casts
    maxnreg: int = 0  # registers a thread at most (NVIDIA), so more programs share an SM; 0: the compiler's choice


def decode_plan(call: KDACall, stochastic_rounding: bool = False, device: DeviceInfo | None = None,
                **overrides) -> DecodePlan:
    """The launch of a `fused_recurrent_kda` call at K, V (measured at K = V = 128; docs/performance.md).
    BK covers K; about 64 fp32 state elements per thread.
    - V-first [V, K]: BV = 16 rows of K contiguous elements, one warp (many small programs keep the memory
      busy at small batch); a 2-byte pool BV = 8.
    - K-first [K, V]: BV = 64 (256-byte rows along V), 4 warps at K = 128 (the K reduction stays in a warp).
    - The loop (spec verify, varlen decode without host bounds, `chunk_kda`'s short sequences) on a 2-byte pool:
      BV = 32 at K = 128 (4096 state elements) on one warp, either layout.
    - One token per sequence (`KDACall.one_token_per_seq`): the one-token kernel. V-first: NSUB 4 blocks of
      BV 8 for a 2-byte pool (all loaded in the storage dtype before any upcast), 1 of 16 for fp32. K-first:
      one block read once and held (`packed`): fp32 BV 64 on 4 warps under a 128-register cap on NVIDIA (2
      warps elsewhere); bf16 and fp16 as 32-bit words of two columns on 4 warps, 16384 elements a program
      under a 168-register cap on NVIDIA (BV 128 at K = 128; BV 64 elsewhere); a 2-byte pool whose slot
      stride or address is odd: 1 warp read in row chunks of 32, twice. The grid's value heads before its
      sequences (a slot's planes read one after another; V-first pools lose with it at N = 1024).
    `overrides` replace any field (tests)."""
    device = device_of(call) if device is None else device
    plan = _decode_plan(call.K, call.V, call.state_v_first, call.state_dtype, call.one_token_per_seq,
                        bool(stochastic_rounding), device)
    if overrides:
        plan = replace(plan, **overrides)
        if plan.ptx and not device.ptx:
            raise ValueError(f"DecodePlan.ptx: {device} runs no inline PTX")
        if plan.maxnreg and not device.register_cap:
            raise ValueError(f"DecodePlan.maxnreg: {device} has no register cap a launch may set")
    return plan


@functools.lru_cache(maxsize=1024)
def _decode_plan(K: int, V: int, v_first: bool, state_dtype: torch.dtype, one_token_per_seq: bool,
                 stochastic_rounding: bool, device: DeviceInfo) -> DecodePlan:
    """`decode_plan` from what determines it, cached: one frozen plan shared by every call that agrees."""
    state_bytes = state_dtype.itemsize
    BK = max(16, next_power_of_2(K))
    kc = 0
    # the loop on a 2-byte pool: 32 rows (V-first) or columns (K-first) on one warp (docs/performance.md)
    narrow_loop = not one_token_per_seq and state_bytes == 2
    if v_first:
        BV = 8 if (V <= 8 or state_bytes == 2) else 16
        nsub = (4 if state_bytes == 2 else 1) if one_token_per_seq else 0
    else:
        nsub = 1 if one_token_per_seq else 0
        if nsub and state_bytes == 2:  # row chunks of 32, read twice, on one warp
            kc = min(32, BK)
        BV = min(64 if (BK <= 128 or kc) else 32, max(16, next_power_of_2(V)))
    if narrow_loop:  # 4096 state elements a warp
        BV = min(4096 // BK, max(8 if v_first else 16, next_power_of_2(V)))
    # about 64 fp32 state elements a thread; a K-first one-token program twice that (fewer threads per plane)
    per_warp = 4096 if (nsub and not v_first) else 2048
    # the V block read once and held: fp32, 2-byte pools as 32-bit words of two columns (4 warps); under a
    # register cap where a launch may set one, so more programs share an SM: fp32 128 registers; 2-byte 16384
    # elements a program at 168 (at 128 the random bits of stochastic rounding spill the tile)
    packed = bool(nsub) and not v_first and (state_dtype == torch.float32 or (bool(kc) and V % 2 == 0))
    capped = packed and device.register_cap
    if capped and state_bytes == 2:
        BV = min(max(64, 16384 // BK), max(16, next_power_of_2(V)))
    if device.interpreter:
        num_warps = 1
    elif packed and (state_bytes == 2 or capped):  # uncapped fp32 (HIP): 2 warps
        num_warps = 4
    elif narrow_loop:
        num_warps = 1
    else:
        num_warps = 1 if kc else max(1, min(8, BK * BV // per_warp))
    sr = SR_MODES[state_dtype] if stochastic_rounding else 0
    return DecodePlan(BK, BV, num_warps, nsub, sr, kc, heads_fastest=bool(nsub) and not v_first, packed=packed,
                      ptx=packed and state_bytes == 2 and device.ptx,
                      maxnreg=(168 if state_bytes == 2 else 128) if capped else 0)
