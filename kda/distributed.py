"""Context-parallel prefill: `chunk_kda` over a token axis split across the ranks of a process group.

A thin layer on `torch.distributed` and the public `kda.chunk_kda`: no communication of its own, one
plain collective per call (`all_gather_single`, or `all_gather_into_tensor` on older torch), no symmetric
memory or multimem. The design, what crosses the wire and how to call it from a serving engine or a
trainer: docs/distributed.md.

The recurrence is affine in the state, column by column of V: over any run of tokens of one sequence,
`S_out = A S_in + B` per value head, `A` `[K, K]` independent of V and of `S_in`, `B` the state reached from
zeros; and the outputs are `o_t = o_t(0) + S_in^T P_t`, `P_t = A_t^T (scale q_t)` `[K]`. One local pass of
width `V + K` (`v' = [v, 0_K]`, initial state `[0, I]`) gives all four: outputs `o(0)` and `P` in its V and
K columns, final state `[B | A]`. Each rank:

1. runs its local parts: the sequences that start on the rank, from their true initial state (a plain
   `chunk_kda` call: their outputs and final states are final); and the one part (a dense batch: the B
   parts) that continues a sequence from the previous rank, with the `[v, 0_K]` / `[0, I]` trick;
2. sends its transfer, `[C, HV, K, V + K]` fp32 (`[B | A]` per carried sequence, C = 1 for varlen, C = B
   dense), describing the state at its end boundary as an affine function of the state at its start
   boundary: `[B | A]` of a part that passes through the rank, `[E | 0]` for a sequence that starts on the
   rank and goes on (E its end state), `[0 | I]` for a rank that holds no token of a sequence carried
   through it, zeros when no sequence crosses its end boundary;
3. the collective is posted as soon as the transfer is known and overlaps the rest of the local pass;
4. folds the transfers of the ranks from the one where its continued sequence starts, in rank order
   (`X <- A_j X + B_j`), to its incoming state `S_in`, and finishes that part: outputs
   `o(0) + P S_in` (a small matmul), final state `A S_in + B`.

Decisions (docs/distributed.md): rank r holds the contiguous range `[rank_bounds[r], rank_bounds[r+1])`
of the global packed token axis (default: `split_tokens`, an even split); the host needs the global bounds
(`cu_seqlens_cpu`, required with `cu_seqlens`) and the rank bounds to know which sequences cross, and
reads nothing back from the device. The rank holding a sequence's first token reads its initial state
(dense row or pool slot); the rank holding its last token writes its final state (dense row, or its own
pool's slot); an empty sequence at position p belongs to the rank holding token p (the last rank when p
is the end of the axis). No other rank reads or writes that sequence's state: a dense final state has
zero rows for the sequences a rank does not end. A dense batch (no `cu_seqlens`) is the trainer's split:
rank r holds the r-th consecutive time slice of every row (any lengths), rank 0 reads the initial states
and the last rank writes the final states.
"""

from __future__ import annotations

import bisect
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import api, arguments
from .contract import MAX_HEAD_DIM, check_call, debug_enabled, host_bounds_list

__all__ = ["chunk_kda", "split_tokens", "state_owners"]


def split_tokens(total: int, world_size: int) -> list[int]:
    """The default rank bounds: `total` tokens split evenly over `world_size` ranks (lengths differ by at
    most one), `[ (r * total) // world_size for r in 0..world_size ]`."""
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"total must be a non-negative int, got {total!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return [(r * total) // world_size for r in range(world_size + 1)]


def _owner(rank_bounds: list[int], pos: int) -> int:
    """The rank holding token `pos`: the last rank whose range starts at or before it (the last rank for
    the end of the axis)."""
    return bisect.bisect_right(rank_bounds, pos, 0, len(rank_bounds) - 1) - 1


def state_owners(cu_seqlens_cpu, rank_bounds) -> tuple[list[int], list[int]]:
    """Per sequence of a varlen call, (the rank that reads its initial state, the rank that writes its final
    state): the ranks holding its first and its last token; for an empty sequence at position p, both are
    the rank holding token p (the last rank when p is the end of the axis). Host arithmetic only."""
    bounds = host_bounds_list(cu_seqlens_cpu)
    R = host_bounds_list(rank_bounds)
    readers = [_owner(R, s) for s in bounds[:-1]]
    writers = [_owner(R, e - 1) if e > s else _owner(R, s) for s, e in zip(bounds, bounds[1:])]
    return readers, writers


@dataclass(frozen=True)
class _Plan:
    """One rank's share of a call, from host bounds only. Local tokens `[0, L0)` continue sequence(s) from
    the previous rank (`cont`); `[L0, T)` hold the sequences `[a, b)` that start on this rank."""

    rank: int
    world: int
    slots: int  # C: sequences a rank boundary can carry (1 varlen, B dense)
    cont: range  # the continued sequences with a local part (varlen: at most one; dense: every row)
    L0: int  # their local tokens (dense: every token, maybe none)
    cont_ends: bool  # they end on this rank
    fold_from: int  # the rank where the continued sequence(s) start
    a: int  # sequences a..b-1 start on this rank
    b: int
    b_end: int  # of these, a..b_end-1 also end on it (b_end = b - 1 when the last one crosses out)
    # the transfer sent: "zeros"; "pass" ([B | A] of the continued part, [0 | I] without tokens); "start" ([E | 0])
    kind: str


def _varlen_plan(bounds: list[int], R: list[int], rank: int) -> _Plan:
    world = len(R) - 1
    N = len(bounds) - 1
    lo, hi = R[rank], R[rank + 1]

    def carried(pos: int) -> int | None:  # the sequence n with bounds[n] < pos < bounds[n + 1]
        n = bisect.bisect_left(bounds, pos) - 1
        return n if 0 <= n < N and bounds[n + 1] > pos else None

    n_in, n_out = carried(lo), carried(hi)
    a = bisect.bisect_left(bounds, lo, 0, N)
    b = bisect.bisect_left(bounds, hi, 0, N) if rank < world - 1 else N
    if n_out is None:
        kind = "zeros"
    elif n_out == n_in:
        kind = "pass"
    else:
        kind = "start"
        assert n_out == b - 1
    cont = range(n_in, n_in + 1) if n_in is not None and hi > lo else range(0)
    L0 = min(bounds[n_in + 1], hi) - lo if cont else 0
    return _Plan(rank=rank, world=world, slots=1, cont=cont, L0=L0,
                 cont_ends=bool(cont) and bounds[n_in + 1] <= hi,
                 fold_from=_owner(R, bounds[n_in]) if n_in is not None else 0,
                 a=a, b=b, b_end=b - 1 if kind == "start" else b, kind=kind)


def _dense_plan(B: int, T: int, rank: int, world: int) -> _Plan:
    """A dense batch: rank r holds the r-th time slice of every row; rank 0 starts every row, the last rank
    ends every row, the ranks between pass every row through."""
    last = rank == world - 1
    if rank == 0:
        return _Plan(rank=rank, world=world, slots=B, cont=range(0), L0=0, cont_ends=False, fold_from=0, a=0, b=B,
                     b_end=B if last else 0, kind="zeros" if last else "start")
    return _Plan(rank=rank, world=world, slots=B, cont=range(B), L0=T, cont_ends=last,
                 fold_from=0, a=0, b=0, b_end=0, kind="zeros" if last else "pass")


def _all_gather(output: torch.Tensor, input: torch.Tensor, group):
    """`output` `[world, *input.shape]` <- every rank's `input`, posted asynchronously (the concatenated form,
    which every backend takes)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output.flatten(0, 1), input, group=group, async_op=True)


def _store_rows(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """`pool[slots[i]] = values[i]` (rounded to the pool's dtype, to nearest even) for every `slots[i] >= 0`;
    no other slot changes. Without a host sync: a row with a slot < 0 repeats the first kept row's write
    (same slot, same bits), and when no row is kept one slot is rewritten with its own bits."""
    n = slots.shape[0]
    if n == 0 or pool.shape[0] == 0:
        return
    keep = slots >= 0
    first = keep.to(torch.int32).argmax()  # the first kept row, 0 when none is
    src = torch.where(keep, torch.arange(n, device=slots.device), first)
    target = slots.index_select(0, src).clamp(min=0).long()
    rows = values.index_select(0, src).to(pool.dtype)
    rows = torch.where(keep.any(), rows, pool.index_select(0, target))
    pool.index_copy_(0, target, rows)


def _identity(shape, K: int, device) -> torch.Tensor:
    return torch.eye(K, dtype=torch.float32, device=device).expand(*shape, K, K)


def _chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, *, group, rank_bounds, kernel_kw,
               cu_seqlens, cu_seqlens_cpu, state_v_first, state_cache, state_indices, has_initial_state,
               state_dtype, out, fuse_identity: bool | None):
    """`chunk_kda` with the continued part's form chosen: `fuse_identity` True runs `[v, 0_K]` in one pass
    (needs V + K <= 256), False runs v and the identity as two passes, None picks True where it fits."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("kda.distributed.chunk_kda needs an initialised torch.distributed process group")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this process is not a member of group")
    debug = debug_enabled() and world > 1
    error = layout = None
    try:
        plan, call, bounds, lo, layout = _validate(
            rank, world, q, k, v, g, beta, scale, initial_state, output_final_state, rank_bounds, kernel_kw,
            cu_seqlens, cu_seqlens_cpu, state_v_first, state_cache, state_indices, has_initial_state, state_dtype,
            out, fuse_identity)
    except (ValueError, TypeError) as e:
        if not debug:
            raise
        error = e
    if debug:  # one collective of its own: a rank's failed check raises on every rank, not only on that one
        _agree(group, world, layout, error)
        if error is not None:
            raise error
    B, T = q.shape[0], q.shape[1]
    HV, K, V, vf = call.HV, call.K, call.V, call.state_v_first
    paged, device = call.state_mode == "paged", q.device
    if fuse_identity is None:
        fuse_identity = V + K <= MAX_HEAD_DIM

    def kfirst(x):  # user layout <-> K-first [K, V] planes
        return x.transpose(-1, -2) if vf else x

    o = out if out is not None else torch.empty(B, T, HV, V, dtype=v.dtype, device=device)
    final = None
    if output_final_state:
        final = torch.zeros(call.N, *call.state_plane_shape, dtype=call.state_dtype, device=device)
    msg = torch.zeros(plan.slots, HV, K, V + K, dtype=torch.float32, device=device)
    gathered = torch.empty(world, *msg.shape, dtype=torch.float32, device=device)
    work = None

    def post():
        return _all_gather(gathered, msg, group) if world > 1 else None

    if plan.kind == "zeros":
        work = post()  # nothing crosses this rank's end: the collective overlaps all of its local work

    # the sequences that start here: a plain call from their true initial states
    start_final = None
    if plan.b > plan.a:
        start_final = _start_pass(q, k, v, g, beta, scale, o, plan, call, initial_state, state_cache,
                                  state_indices, has_initial_state, cu_seqlens, bounds, lo, kernel_kw,
                                  need_final=output_final_state or paged or plan.kind == "start")
        if plan.kind == "start":
            msg[..., :V] = kfirst(start_final[plan.b - plan.a - plan.slots:])
            work = post()

    # the part continued from the previous rank: outputs from zeros, P, and its transfer [B | A]
    cont = None
    rows = slice(plan.cont.start, plan.cont.stop)
    if plan.cont:
        cont = _continued_pass(q, k, v, g, beta, scale, plan, cu_seqlens, lo, HV, K, V, kernel_kw, fuse_identity)
        if plan.kind == "pass":
            msg[..., :V] = cont[2]
            msg[..., V:] = cont[3]
            work = post()
    elif plan.kind == "pass":  # no token of the carried sequence here: the identity transfer
        msg[..., V:] = _identity((plan.slots, HV), K, device)
        work = post()

    if work is not None:
        work.wait()
    if cont is not None:
        o_zero, P, B_t, A_t = cont
        S_in = gathered[plan.fold_from, ..., :V]  # the starting rank sent [E | 0]
        for j in range(plan.fold_from + 1, rank):
            S_in = gathered[j, ..., :V] + torch.matmul(gathered[j, ..., V:], S_in)
        o_cont = o_zero.float() + torch.einsum("bthk,bhkv->bthv", P.float(), S_in)
        if paged:
            o_cont.masked_fill_((state_indices[rows] < 0).view(-1, 1, 1, 1), 0.0)
        o[:, :plan.L0].copy_(o_cont)
        if plan.cont_ends and (output_final_state or paged):
            state = kfirst(B_t + torch.matmul(A_t, S_in))
            if paged:
                _store_rows(state_cache, state_indices[rows], state)
            else:
                final[rows] = state.to(final.dtype)

    if start_final is not None and plan.b_end > plan.a:
        ended = start_final[:plan.b_end - plan.a]
        if paged:
            _store_rows(state_cache, state_indices[plan.a:plan.b_end], ended)
        elif final is not None:
            final[plan.a:plan.b_end] = ended
    return o, final


# `chunk_kda`'s body: the arguments `_chunk_kda` names, passed by name; the table's others (the in-kernel
# pre-processing and gate arguments) go to every local `kda.chunk_kda` call as they are (`kernel_kw`)
_OWN = inspect.signature(_chunk_kda).parameters
_PASSED = [n for n in arguments.names(arguments.DISTRIBUTED) if n not in _OWN]
_BODY = f"""\
    return _chunk_kda({arguments.call_source(arguments.DISTRIBUTED, only=_OWN)},
                      kernel_kw=dict({arguments.call_source(arguments.DISTRIBUTED, only=_PASSED)}), fuse_identity=None)
"""


@arguments.compiled(arguments.DISTRIBUTED, _BODY, globals())
def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    group=None,
    rank_bounds=None,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu=None,
    state_v_first: bool | None = None,
    state_cache: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    state_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`kda.chunk_kda` over the ranks of `group` (default: the default group), each passing its local token
    slice; every rank of the group calls it with the same global arguments. Equals the single-device
    `kda.chunk_kda` of the whole token axis within rounding.

    Varlen (`cu_seqlens` given, `B == 1`): `cu_seqlens` `[N+1]` on the device and `cu_seqlens_cpu` (required)
    are the global bounds of the packed axis; rank r holds tokens `[rank_bounds[r], rank_bounds[r+1])`
    of it (q, k `[1, T_r, H, K]`, v `[1, T_r, HV, V]`, ...), `rank_bounds` a host sequence of
    `world_size + 1` ints from 0 to the total (default `split_tokens(total, world_size)`). Sequences may
    cross any number of rank boundaries, lie inside one rank, or be empty; a rank may hold no token.

    Dense (`cu_seqlens` None): rank r holds the r-th consecutive time slice (any length, zero too) of each of
    the B rows; `rank_bounds`, when given, is only checked against the local length.

    The other arguments are `kda.chunk_kda`'s, with per-sequence arguments global (`initial_state` `[N, ...]`,
    `state_indices` and `has_initial_state` `[N]`) and per-token ones local (`out` `[B, T_r, HV, V]`). The
    rank holding a sequence's first token reads its initial state (its row of `initial_state`, or its slot
    of this rank's `state_cache`); the rank holding its last token writes its final state (its row of the
    returned final state, zero on the other ranks, or its slot of this rank's pool); no other rank reads or
    writes it. Returns `(o_local, final_state)`.
    """
    # the body is `_BODY`, written out by `arguments.compiled`


def _validate(rank, world, q, k, v, g, beta, scale, initial_state, output_final_state, rank_bounds, kernel_kw,
              cu_seqlens, cu_seqlens_cpu, state_v_first, state_cache, state_indices, has_initial_state, state_dtype,
              out, fuse_identity):
    """Every check of a call: the host bounds, and `kda.contract.check_call` on the rank's local view of every
    sequence. Returns (plan, call, the host bounds or None, the rank's first token, the layout the ranks
    must agree on)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError("q must be a 4-D tensor [B, T, H, K]")  # the full checks follow in check_call
    B, T = q.shape[0], q.shape[1]
    if cu_seqlens is not None:
        if cu_seqlens_cpu is None:
            raise ValueError("kda.distributed.chunk_kda with cu_seqlens needs cu_seqlens_cpu (the global bounds "
                             "on the host): each rank plans its share from them without reading the device")
        bounds = host_bounds_list(cu_seqlens_cpu)
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.shape != (len(bounds),):
            raise ValueError(f"cu_seqlens must be a [N+1] = [{len(bounds)}] tensor like cu_seqlens_cpu")
        if bounds[0] != 0 or sorted(bounds) != bounds:
            raise ValueError("cu_seqlens_cpu must start at 0 and be non-decreasing")
        R = split_tokens(bounds[-1], world) if rank_bounds is None else host_bounds_list(rank_bounds)
        if len(R) != world + 1 or R[0] != 0 or R[-1] != bounds[-1] or sorted(R) != R:
            raise ValueError(f"rank_bounds must hold world_size + 1 = {world + 1} non-decreasing ints from 0 to "
                             f"the total token count {bounds[-1]}, got {R}")
        lo, hi = R[rank], R[rank + 1]
        plan = _varlen_plan(bounds, R, rank)
        # the local view of every sequence, for the contract checks (and the KDA_DEBUG comparison)
        local_cu = (cu_seqlens - lo).clamp_(0, hi - lo)
        local_cpu = [min(max(x - lo, 0), hi - lo) for x in bounds]
    else:
        bounds = None
        if rank_bounds is not None:
            R = host_bounds_list(rank_bounds)
            if len(R) != world + 1 or R[0] != 0 or sorted(R) != R:
                raise ValueError(f"rank_bounds must hold world_size + 1 = {world + 1} non-decreasing ints from 0, "
                                 f"got {R}")
            lo, hi = R[rank], R[rank + 1]
        else:
            R, lo, hi = None, 0, T
        plan = _dense_plan(B, T, rank, world)
        local_cu, local_cpu = None, None
    if hi - lo != T:
        raise ValueError(f"rank {rank} holds tokens [{lo}, {hi}) by rank_bounds but q has T={T} (q.shape[1])")
    call = check_call(
        "chunk_kda", q, k, v, g, beta, scale, initial_state, output_final_state, **kernel_kw,
        cu_seqlens=local_cu, cu_seqlens_cpu=local_cpu, state_v_first=state_v_first, state_cache=state_cache,
        state_indices=state_indices, has_initial_state=has_initial_state, state_dtype=state_dtype, out=out,
        require_has_initial_state=True,
    )
    if fuse_identity and call.V + call.K > MAX_HEAD_DIM:
        raise ValueError(f"fuse_identity needs V + K <= {MAX_HEAD_DIM}, got {call.V + call.K}")
    return plan, call, bounds, lo, (bounds, R, B if bounds is None else None)


def _agree(group, world: int, layout, error) -> None:
    """KDA_DEBUG: one `all_gather_object` of every rank's (bounds, rank bounds, B) and its failed check, if
    any. Raises on the ranks that passed their checks when another failed or when the ranks disagree (a
    rank with an error of its own raises it); without it, a rank that raises leaves the others waiting in
    the call's collective until the group's timeout."""
    seen = [None] * world
    dist.all_gather_object(seen, (layout, None if error is None else f"{type(error).__name__}: {error}"),
                           group=group)
    if error is not None:
        return  # the caller raises its own error
    failed = [(r, e) for r, (_, e) in enumerate(seen) if e is not None]
    if failed:
        raise ValueError(f"rank {failed[0][0]} failed its checks: {failed[0][1]} (KDA_DEBUG check)")
    if any(x != layout for x, _ in seen):
        raise ValueError("the ranks disagree on cu_seqlens_cpu, rank_bounds or B (KDA_DEBUG check)")


def _start_pass(q, k, v, g, beta, scale, o, plan: _Plan, call, initial_state, state_cache, state_indices,
                has_initial_state, cu_seqlens, bounds, lo: int, kernel_kw, need_final: bool):
    """The sequences a..b-1 that start on this rank (local tokens [L0, T)): one `kda.chunk_kda` call from their
    initial states (read here: the dense rows or the pool slots, fp32, in the caller's layout), writing
    their outputs into `o`. Returns their final states (fp32, the caller's layout) or None."""
    a, b, L0, T = plan.a, plan.b, plan.L0, q.shape[1]
    xs = [x[:, L0:] for x in (q, k, v, g, beta)]
    if cu_seqlens is not None:
        cu, cu_cpu = (cu_seqlens[a:b + 1] - (lo + L0)).clamp_(0, T - L0), \
            [min(max(x - lo - L0, 0), T - L0) for x in bounds[a:b + 1]]
    else:
        cu, cu_cpu = None, None
    init = None
    if call.state_mode == "dense":
        init = initial_state[a:b].float()  # a view when the state is fp32 already
    elif call.state_mode == "paged":
        slots = state_indices[a:b]
        read = (slots >= 0) & has_initial_state[a:b]
        planes = (state_cache.index_select(0, slots.clamp(min=0).long()) if state_cache.shape[0]
                  else state_cache.new_zeros(b - a, *state_cache.shape[1:]))
        init = torch.where(read.view(-1, 1, 1, 1), planes.float(), 0.0)
    _, state = api.chunk_kda(*xs, scale, init, need_final, **kernel_kw, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                             state_v_first=call.state_v_first, state_dtype=torch.float32, out=o[:, L0:])
    if call.state_mode == "paged":  # padding sequences: zero output rows
        pad = state_indices[a:b] < 0
        if cu is None:
            o.masked_fill_(pad.view(-1, 1, 1, 1), 0.0)
        else:
            tokens = torch.repeat_interleave(pad, cu[1:] - cu[:-1], output_size=T - L0)
            o[:, L0:].masked_fill_(tokens.view(1, -1, 1, 1), 0.0)
    return state


def _continued_pass(q, k, v, g, beta, scale, plan: _Plan, cu_seqlens, lo: int, HV: int, K: int, V: int,
                    kernel_kw, fuse: bool):
    """The part continued from the previous rank (local tokens [0, L0)) from a zero state, with the identity:
    returns (outputs from zeros [B, L0, HV, V], P [B, L0, HV, K], B_t [C, HV, K, V], A_t [C, HV, K, K]), the
    states fp32 K-first. One pass of width V + K (`[v, 0_K]` from `[0, I]`) when `fuse`, else two."""
    L0, C = plan.L0, plan.slots
    q1, k1, v1, g1, beta1 = (x[:, :L0] for x in (q, k, v, g, beta))
    cu, cu_cpu = None, None
    if cu_seqlens is not None:
        n = plan.cont.start
        cu, cu_cpu = (cu_seqlens[n:n + 2] - lo).clamp_(0, L0), [0, L0]
    kw = dict(kernel_kw, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, state_v_first=False)
    eye = _identity((C, HV), K, q.device)
    if L0 == 0:  # a dense batch's rank without tokens: the identity transfer, no launch
        empty = v1.new_empty(*v1.shape[:3], K)
        return v1, empty, eye.new_zeros(C, HV, K, V), eye
    zeros_k = v1.new_zeros(*v1.shape[:3], K)
    if fuse:
        init = torch.cat([torch.zeros(C, HV, K, V, dtype=torch.float32, device=q.device), eye], dim=-1)
        o1, s1 = api.chunk_kda(q1, k1, torch.cat([v1, zeros_k], dim=-1), g1, beta1, scale, init, True, **kw)
        return o1[..., :V], o1[..., V:], s1[..., :V], s1[..., V:]
    o_zero, B_t = api.chunk_kda(q1, k1, v1, g1, beta1, scale, None, True, state_dtype=torch.float32, **kw)
    P, A_t = api.chunk_kda(q1, k1, zeros_k, g1, beta1, scale, eye.contiguous(), True, **kw)
    return o_zero, P, B_t, A_t
