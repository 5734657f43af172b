"""What one validated call launches: the host-side plan.

`chunk_plan(call)` and `decode_plan(call)` turn a `kda.contract.KDACall` into everything the kernel modules
need and nothing else: which kernels run (the fused bounded-gate prepare or the split one, whether the walk
applies the inverse itself; the one-token decode kernel or the loop kernel; which sequences of a `chunk_kda`
call the recurrent loop takes, `short_route`), their tiles, warps and stages, the dot precision and workspace
dtype, and where state is read and written (`StatePlan`). The kernel modules (`kda.ops.chunk`,
`kda.ops.fused_recurrent`) only launch what the plan says. Tests pick a path by building a plan with its
keyword overrides (`chunk_plan(call, walk_BV=64)`), never by rewriting globals.

Same bits whatever the batch: a choice that changes a `chunk_kda` sequence's arithmetic (the prepare's form,
the dot precision, the workspace dtype, the gate pass's slices, the walk's V block and `ChunkPlan.fold`,
`wide_heads`, the recurrent route of short sequences) follows only the dtypes, the flags, the head counts, K,
V, the device and the sequence's own length; what else is in the call moves only choices that keep the bits
(stages, TMA, the walk beside the prepare, grid sizes). docs/contract.md, "Batch invariance".

The numbers behind each default are in docs/performance.md. No environment variable chooses a kernel.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, replace

import torch

from .contract import CHECKPOINT_MULTIPLE, KDACall, host_lengths, interpreting

LOG2E = 1.4426950408889634
CHUNK = 64  # BT: tokens per chunk of the prepare stage and the walk
assert CHECKPOINT_MULTIPLE % CHUNK == 0  # every checkpoint offset is a chunk end of the walk
SUB = 16  # BC: rows of the diagonal blocks inverted by forward substitution (split prepare)
# the fused prepare's: 4 x 4 diagonal blocks by their series (two dots), then four block merges as tf32
# dots (timed faster than 16 x 16 blocks and two merges, same accuracy: docs/performance.md)
FUSED_SUB = 4
# chunk_kda sends sequences of 1..SHORT_LEN tokens (decodes and short continuations in a mixed batch)
# through the recurrent loop kernel: a walk program pays a chunk's setup and a whole plane's latency for them
SHORT_LEN = 16
# The fused prepare anchors each 32-row half of a chunk at its middle row: a factor 2^(b_i - a) spans at most
# 16 tokens of the gate, |lb| log2(e) each, and must stay below fp32's 2^128 with K terms summed.
BOUNDED_GATE_MAX_LOG2_SPAN = 118.0


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


DENSE_SLOTS = 2**31 - 1  # the slot bound of the dense contract, whose slot of sequence n is n


@dataclass(slots=True)
class StatePlan:
    """Where the kernels read and write state: pools of dense planes (`KDACall` explains why). Built per
    call, read-only by convention (not frozen, which would cost microseconds per call)."""

    src: torch.Tensor | None  # the pool read (dense initial_state or the paged state_cache)
    dst: torch.Tensor | None  # the pool written (the dense final state, or state_cache itself: in place)
    slot_of_seq: torch.Tensor | None  # int32 [N]; None: sequence n is slot n
    has_initial_state: torch.Tensor | None  # bool [N]; None: every non-padding slot is read
    final_state: torch.Tensor | None  # what the call returns
    paged: bool

    @property
    def src_stride(self) -> int:
        return self.src.stride(0) if self.src is not None else 0

    @property
    def dst_stride(self) -> int:
        return self.dst.stride(0) if self.dst is not None else 0

    @property
    def slot_count(self) -> int:
        """Slots a kernel may address: the paged pool's; dense state is addressed by sequence (always in range)."""
        return self.src.shape[0] if self.paged else DENSE_SLOTS

    def pointers(self, stand_in: torch.Tensor) -> tuple:
        """(src, dst, slot_of_seq, has_initial_state) with `stand_in` for the absent ones (never read: the
        kernels' matching constexpr flags are off)."""
        src, dst, slots, flags = self.src, self.dst, self.slot_of_seq, self.has_initial_state
        return (stand_in if src is None else src, stand_in if dst is None else dst,
                stand_in if slots is None else slots, stand_in if flags is None else flags)

    def flags(self, v_first: bool) -> dict:
        return dict(HAS_SRC=self.src is not None, HAS_DST=self.dst is not None, PAGED=self.paged,
                    HAS_INIT_FLAGS=self.has_initial_state is not None, V_FIRST=v_first)


def state_plan(call: KDACall) -> StatePlan:
    """Allocate the dense final state (if asked) and describe the source and destination pools."""
    if call.state_mode == "paged":
        return StatePlan(call.state_in, call.state_in, call.state_indices, call.has_initial_state, None, True)
    final = None
    if call.output_final_state:
        final = torch.empty((call.N, *call.state_plane_shape), dtype=call.state_dtype, device=call.q.device)
    return StatePlan(call.state_in, final, None, None, final, False)


def output_buffer(call: KDACall) -> torch.Tensor:
    """The caller's `out`, or a new `[B, T, HV, V]` tensor in v's dtype."""
    if call.out is not None:
        return call.out
    return torch.empty((call.B, call.T, call.HV, call.V), dtype=call.v.dtype, device=call.v.device)


def gate_args(call: KDACall) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A_log and dt_bias (g as the stand-in where absent) and the lower bound (0 where absent)."""
    return (call.A_log if call.A_log is not None else call.g,
            call.dt_bias if call.dt_bias is not None else call.g,
            call.lower_bound if call.lower_bound is not None else 0.0)


def dot_precision(input_dtype: torch.dtype) -> str:
    """Precision of the fp32 dots: exact ("ieee") for fp32 inputs and in the interpreter (a caller passing
    fp32 asks for fp32 accuracy); tf32 for bf16/fp16 inputs, with every fp32 operand rounded to nearest
    tf32 before the dot (`kda.ops.common.tf32_round`), so its 2^-11 rounding stays below the inputs' own."""
    if interpreted() or input_dtype == torch.float32:
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
class DeviceInfo:
    """What the plan needs of a device, read once per device: its SM count, compute capability, shared memory a
    block may opt into, and the features that follow from them. The interpreter is a device of its own (one
    SM, no overlap; it emulates TMA)."""

    sm_count: int
    capability: tuple[int, int]
    max_smem: int  # bytes of shared memory one block may use
    hip: bool = False
    interpreter: bool = False

    @property
    def tma(self) -> bool:
        """Tensor-memory-accelerator loads (Hopper and later on NVIDIA; the interpreter emulates them)."""
        return self.interpreter or (not self.hip and self.capability >= (9, 0))

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch (Hopper and later on NVIDIA)."""
        return not self.interpreter and not self.hip and self.capability >= (9, 0)


INTERPRETER = DeviceInfo(sm_count=1, capability=(0, 0), max_smem=227 * 1024, interpreter=True)


@functools.cache
def device_info(device_index: int) -> DeviceInfo:
    """The `DeviceInfo` of CUDA (or HIP) device `device_index`."""
    props = torch.cuda.get_device_properties(device_index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 0)
    return DeviceInfo(props.multi_processor_count, (props.major, props.minor), smem,
                      hip=torch.version.hip is not None)


def _sm_count(device_index: int) -> int:
    return device_info(device_index).sm_count


@dataclass(frozen=True)
class ChunkPlan:
    """What `kda.ops.chunk.chunk_kda_fwd` launches for one call."""

    prepare: str  # "fused" (`_chunk_prepare_kernel`) or "split" (`_chunk_intra_kernel` + `_chunk_solve_kernel`)
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
    walk_tma: bool = False  # the plain walk loads its chunk tiles by TMA (ragged tensor descriptors)
    short_len: int = SHORT_LEN  # sequences of 1..short_len tokens go through the recurrent loop (`short_route`)
    wait_chunks: int = 0  # > 0: the walk runs beside the prepare, awaiting groups of this many chunks (`_beside`)
    wait_in_loop: bool = False  # it awaits them inside its pipelined loop (`_chunk_state_kernel`'s WAIT_IN_LOOP)
    # > 0: the fused prepare's last late_chunks chunk programs are a second launch, and the walk beside it starts
    # after the first launch has finished (it then holds its SMs for the tail of the prepare only)
    late_chunks: int = 0
    # False (fused prepare, fp16 workspaces): the prepare stores Xb, A_qk and Kr instead of folding the inverse
    # into M and N, and the walk forms U = Xb D itself (a dot more a step, the prepare's fold dots fewer). It
    # changes the arithmetic, so it follows the heads and the device alone (`wide_heads`), never the batch.
    fold: bool = True


def chunk_plan(call: KDACall, **overrides) -> ChunkPlan:
    """The plan of a `chunk_kda` call (module docstring); `overrides` replace any field (tests)."""
    return chunk_plan_and_route(call, **overrides)[0]


def chunk_plan_and_route(call: KDACall, **overrides) -> tuple[ChunkPlan, tuple[int, int, int]]:
    """`chunk_plan` and its `short_route`, from one sort of the host lengths (what `chunk_kda` runs: the
    walk's V block and the routing both depend on which sequences the recurrent loop takes)."""
    lengths = _sorted_lengths(call)
    wide = wide_heads(call)
    walk_BV = _walk_bv(call, wide)
    plan = _chunk_plan(call.q.dtype, call.use_qk_l2norm_in_kernel, bounded_gate(call), call.K, call.V,
                       walk_BV, _tma_capable(call), wide)
    beside = _beside(call, walk_BV)
    late = 0 if beside else _tail_chunks(call, walk_BV, plan)
    if late:
        plan = _beside_plan(plan, False, late)
    elif beside:
        plan = _beside_plan(plan, walk_BV != 64)
    if overrides:
        plan = replace(plan, **overrides)
        if not plan.fold and (plan.prepare != "fused" or plan.ws_dtype != torch.float16):
            raise ValueError("ChunkPlan.fold=False needs the fused prepare and fp16 workspaces")
    return plan, _route(call, plan.short_len, lengths)


def short_route(call: KDACall, plan: ChunkPlan) -> tuple[int, int, int | None]:
    """(short, kept, kept_chunks): sequences of 1..short tokens go through the recurrent loop kernel in
    the same call (short = 0: none do); `kept` sequences (the others, empty ones included) need the chunk
    kernels, the walk's grid holds only them, and the gate and prepare grids only their `kept_chunks`
    chunks. A sequence's route follows its own length, read on the device, so its bits never depend on the
    batch: the host's lengths (dense, or `cu_seqlens_cpu`) only trim the grids; without them every varlen call
    routes on the device over the full grids (kept = N, kept_chunks None)."""
    return _route(call, plan.short_len, _sorted_lengths(call))


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


def _route(call: KDACall, S: int, lengths: list[int] | None) -> tuple[int, int, int | None]:
    """`short_route` from the sorted host lengths (None: unknown, routed on the device over the full grids)."""
    N = call.N
    if S == 0:
        return 0, N, None
    if lengths is None:
        return (S if call.cu_seqlens is not None else 0), N, None
    first_long, routed = _routed(lengths, S)
    if not routed:
        return 0, N, None
    return S, N - routed, sum((n + CHUNK - 1) // CHUNK for n in lengths[first_long:])


def one_whole_sequence(call: KDACall) -> bool:
    """The call holds one sequence of all T tokens, known on the host: dense with B = 1, or varlen with one
    sequence and host bounds (`cu_seqlens_cpu`, checked to be [0, T]), the form a serving engine passes for
    a lone prefill."""
    if call.cu_seqlens is None:
        return call.B == 1
    return call.N == 1 and call.host_bounds is not None


# The walk beside the prepare awaits groups of this many chunks: each group's walk starts afresh (its
# pipeline's first loads exposed), and the last group's walk follows the prepare's end.
WAIT_CHUNKS = 16


# A walk at V blocks of 64 runs beside the prepare only where the prepare holds at least this many (chunk, head)
# programs: the prepare then keeps two programs on only half the SMs, which the walk's own time repays only on
# long prepares. A TMA walk waits inside its pipelined loop, for groups of WAIT_CHUNKS_BV64; a pointer walk keeps
# the outer loop (its loads are not pipelined behind an in-loop wait), for groups of WAIT_CHUNKS_BV64_OUTER
# (docs/performance.md, "Tuning constants").
BESIDE_BV64_CHUNKS = 2048
WAIT_CHUNKS_BV64 = 2
# A walk too wide to run beside the whole prepare (`_tail_chunks`) starts for its last NT * free /
# (LATE_PER_SLOT * HV) chunks (free: the prepare slots, two an SM, its programs leave): about the walk's chunk
# steps in one prepare program's time (docs/performance.md, "Tuning constants")
LATE_PER_SLOT = 12
WAIT_CHUNKS_BV64_OUTER = 4


def _beside(call: KDACall, walk_BV: int) -> bool:
    """Whether the walk runs beside the prepare (`kda.ops.chunk`): a dense call (or a lone varlen prefill with
    host bounds, run as dense) whose walk programs, one an SM, leave at least half the SMs to the prepare, so
    the prepare's programs always find SMs while the walk's await them; at V blocks of 64 only for long prepares
    (`BESIDE_BV64_CHUNKS`). On a GPU only (the interpreter runs the launches one after another)."""
    if not _may_wait(call):
        return False
    heads = call.N * call.HV
    if 2 * heads * cdiv(call.V, walk_BV) > _sm_count(call.q.device.index or 0):
        return False
    return walk_BV != 64 or heads * cdiv(call.T, CHUNK) >= BESIDE_BV64_CHUNKS


def _may_wait(call: KDACall) -> bool:
    """Whether a walk may await the prepare's chunks at all: on a GPU (the interpreter runs the launches one
    after another), a prepare to fork after (T > 0), dense rows or one whole varlen sequence."""
    if call.T == 0 or not call.q.is_cuda or interpreted():
        return False
    return call.cu_seqlens is None or one_whole_sequence(call)


def _tail_chunks(call: KDACall, walk_BV: int, plan: ChunkPlan) -> int:
    """The chunks beside which a walk too wide to run beside the whole prepare (`_beside`) runs
    (`ChunkPlan.late_chunks`; `LATE_PER_SLOT`), or 0: one sequence, a long fused prepare with its gate pass
    (`BESIDE_BV64_CHUNKS`), a walk at V blocks of 64 (two programs an SM) whose programs leave at least a quarter
    of the prepare's slots, fewer late chunks than chunks. Live:
    with fewer than two walk programs an SM some SM holds at most one, and a prepare program fits beside one."""
    NT = cdiv(call.T, CHUNK)
    if (not _may_wait(call) or walk_BV != 64 or call.K > 128 or plan.prepare != "fused"
            or not plan.gate_pass or call.N != 1 or call.HV * NT < BESIDE_BV64_CHUNKS):
        return 0
    slots = 2 * _sm_count(call.q.device.index or 0)
    free = slots - call.HV * cdiv(call.V, 64)  # the prepare slots beside the walk's programs
    late = cdiv(NT * free, LATE_PER_SLOT * call.HV)
    return late if 4 * free >= slots and late < NT else 0


def wide_heads(call: KDACall) -> bool:
    """Whether the heads are too many for a walk at V blocks of 32 to run beside the prepare (its programs, one
    an SM, would hold more than half the SMs for one sequence). Then the prepare bounds a call: the walk takes V
    blocks of 64 (half the programs, two an SM by TMA) and applies the inverse itself (`ChunkPlan.fold` off,
    where the prepare is fused and the workspaces fp16), shedding the prepare's fold dots. From the heads, K, V
    and the device alone: both choices change the arithmetic (the fp16 operands' scales are a V block's), so
    the batch must not move them. On a GPU, V > 32 and K <= 128 (a [K, 64] fp32 state tile in registers)."""
    if call.V <= 32 or call.K > 128 or not call.q.is_cuda or interpreted():
        return False
    return 2 * call.HV * cdiv(call.V, 32) > _sm_count(call.q.device.index or 0)


def _walk_bv(call: KDACall, wide: bool) -> int:
    """The walk's V block: 64 for `wide_heads`, else 32 (16 for V <= 16)."""
    return 16 if call.V <= 16 else (64 if wide else 32)


def _tma_capable(call: KDACall) -> bool:
    """Whether the device loads by TMA (Hopper and later; the interpreter emulates it) and the token count
    fits a ragged descriptor's 2^30 rows."""
    if call.B * call.T > 2**30:
        return False
    return interpreted() or (call.q.is_cuda and device_info(call.q.device.index or 0).tma)


@functools.lru_cache(maxsize=1024)
def _beside_plan(plan: ChunkPlan, outer: bool, late: int = 0) -> ChunkPlan:
    """`plan` with the waits of a walk beside the prepare, cached so that every call at a shape gets the
    same frozen object (no dataclass rebuilt per call). `outer`: groups of WAIT_CHUNKS awaited by the walk's
    outer loop (V blocks of 32); else (V blocks of 64) inside the pipelined loop for TMA walks (pointer loads
    lose their pipelining behind an in-loop wait)."""
    if outer:
        return replace(plan, wait_chunks=WAIT_CHUNKS)
    return replace(plan, wait_chunks=WAIT_CHUNKS_BV64 if plan.walk_tma else WAIT_CHUNKS_BV64_OUTER,
                   wait_in_loop=plan.walk_tma, late_chunks=late)


@functools.lru_cache(maxsize=1024)
def _chunk_plan(input_dtype: torch.dtype, qk_l2norm_in_kernel: bool, fused: bool, K: int, V: int,
                walk_BV: int, tma: bool, unfold: bool) -> ChunkPlan:
    """`chunk_plan` from what determines it, cached: one frozen plan shared by every call that agrees."""
    prec = dot_precision(input_dtype)
    ws_dtype = workspace_dtype(input_dtype, qk_l2norm_in_kernel)
    BK = max(16, next_power_of_2(K))
    # TMA wants 16-byte rows and row strides: K, V multiples of 8 (fp16 and fp32 tiles)
    walk_tma = tma and K % 8 == 0 and V % 8 == 0
    stages = _walk_stages(CHUNK, BK, walk_BV, ws_dtype.itemsize)
    if walk_tma and walk_BV == 64 and BK <= 128:
        # V blocks of 64 serve shapes whose programs run in waves; by TMA two stages fit two programs on an
        # SM, so twice the programs run at once (docs/performance.md, "Two walk programs per SM")
        stages = min(stages, 2)
    return ChunkPlan(
        prepare="fused" if fused else "split",
        dot_prec=prec, ws_dtype=ws_dtype, prepare_BK=min(32, BK), cumsum_fp64=prec == "ieee",
        gate_BK=min(64, BK),
        gate_pass=prec != "ieee",  # the fp32 cumsum in its own pass is faster (docs/performance.md)
        walk_BV=walk_BV, walk_stages=stages, walk_tma=walk_tma,
        fold=not (unfold and fused and ws_dtype == torch.float16),
    )


# Hopper's shared memory per block (227 KiB), less what the walk keeps besides its prefetched chunks
WALK_SMEM_BYTES = 227 * 1024 - 8192


def _walk_stages(BT: int, BK: int, BV: int, ws_bytes: int) -> int:
    """Chunks of Kd, Qd, M, N and V in flight in the walk (V counted at 4 bytes, as fp32 inputs have it): as
    many as shared memory holds, at most 3 (each stage timed faster at K = V = 128 with fp16 workspaces:
    docs/performance.md)."""
    per_stage = (3 * BT * BK + BT * BT) * ws_bytes + BT * BV * 4
    return max(1, min(3, WALK_SMEM_BYTES // per_stage))


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
    packed: bool = False  # K-first one-token kernel: the V block read once and held (bf16: as 32-bit words)


SR_MODES = {torch.bfloat16: 1, torch.float16: 2}


def decode_plan(call: KDACall, stochastic_rounding: bool = False, **overrides) -> DecodePlan:
    """The launch of a `fused_recurrent_kda` call at K, V (measured at K = V = 128; docs/performance.md).
    BK covers K; about 64 fp32 state elements per thread.
    - V-first [V, K]: BV = 16 rows of K contiguous elements, one warp (many small programs keep the memory
      busy at small batch); a 2-byte pool BV = 8.
    - K-first [K, V]: BV = 64 (256-byte rows along V), 4 warps at K = 128 (the K reduction stays in a warp).
    - One token per sequence (`KDACall.one_token_per_seq`): the one-token kernel. V-first: NSUB 4 blocks of
      BV 8 for a 2-byte pool (all loaded in the storage dtype before any upcast), 1 of 16 for fp32. K-first:
      one block of BV 64 read once and held (`packed`: fp32 on 2 warps; bf16 on 4 warps as 32-bit words of two
      columns; fp16, or a bf16 pool whose slot stride or address is odd: 1 warp read in row chunks of 32,
      twice), the grid's value heads before its sequences (a slot's planes read one after another; V-first
      pools lose with it at N = 1024).
    `overrides` replace any field (tests)."""
    plan = _decode_plan(call.K, call.V, call.state_v_first, call.state_dtype, call.one_token_per_seq,
                        bool(stochastic_rounding))
    return replace(plan, **overrides) if overrides else plan


def short_plan(call: KDACall) -> DecodePlan:
    """The loop kernel's plan for `chunk_kda`'s short sequences (`short_route`): the loop kernel whatever the
    batch (a call of one-token sequences included), so that a short sequence's bits never depend on it."""
    return _decode_plan(call.K, call.V, call.state_v_first, call.state_dtype, False, False)


@functools.lru_cache(maxsize=1024)
def _decode_plan(K: int, V: int, v_first: bool, state_dtype: torch.dtype, one_token_per_seq: bool,
                 stochastic_rounding: bool) -> DecodePlan:
    """`decode_plan` from what determines it, cached: one frozen plan shared by every call that agrees."""
    state_bytes = state_dtype.itemsize
    BK = max(16, next_power_of_2(K))
    kc = 0
    if v_first:
        BV = 8 if (V <= 8 or state_bytes == 2) else 16
        nsub = (4 if state_bytes == 2 else 1) if one_token_per_seq else 0
    else:
        nsub = 1 if one_token_per_seq else 0
        if nsub and state_bytes == 2:  # row chunks of 32, read twice, on one warp (H200 sweep)
            kc = min(32, BK)
        BV = min(64 if (BK <= 128 or kc) else 32, max(16, next_power_of_2(V)))
    # about 64 fp32 state elements a thread; a K-first one-token program twice that (H200 sweep, fewer
    # threads per plane: docs/performance.md)
    per_warp = 4096 if (nsub and not v_first) else 2048
    # the V block read once and held: fp32 (2 warps), bf16 as 32-bit words (its halves widen by a shift; 4
    # warps, 96 registers); fp16 halves took 128 registers that way and ran no faster than the row chunks
    packed = bool(nsub) and not v_first and (state_dtype == torch.float32 or (bool(kc) and V % 2 == 0
                                                                              and state_dtype == torch.bfloat16))
    if interpreted():
        num_warps = 1
    elif packed and state_bytes == 2:
        num_warps = 4
    else:
        num_warps = 1 if kc else max(1, min(8, BK * BV // per_warp))
    sr = SR_MODES[state_dtype] if stochastic_rounding else 0
    return DecodePlan(BK, BV, num_warps, nsub, sr, kc, heads_fastest=bool(nsub) and not v_first, packed=packed)
