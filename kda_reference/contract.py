"""The call contract shared by `recurrent_kda` and `chunk_kda`: checks, sequences, state load and store.

Nothing here is math. `run_kda` checks the arguments, splits the batch into sequences, loads each
sequence's initial state (zeros, dense `initial_state`, or a slot of the paged `state_cache`), hands one
(sequence, value head) at a time to a `SequenceFn` that does the math in `compute_dtype`, and stores the
result. The two public functions differ only in the `SequenceFn` they pass.

Decisions where the interface (docs/contract.md) leaves an oracle a choice:

- ``o`` is returned in ``compute_dtype`` (float64 by default: the exact answer, not rounded to v's
  dtype). With ``out=``, ``o`` is copied into ``out`` (rounded to ``out.dtype``) and ``out`` is returned.
- ``final_state`` is rounded to its storage dtype once, on store (a plain ``.to(dtype)``: round to nearest
  even), as the kernels do. Its dtype is ``initial_state.dtype`` if given, else ``state_dtype``
  (default float32); pass ``state_dtype=torch.float64`` to keep it exact. A ``state_dtype`` that differs
  from ``initial_state.dtype`` or ``state_cache.dtype`` is a ValueError (no silent conversion).
- ``output_final_state=True`` with ``state_cache`` is a ValueError: the paged contract writes the final
  state into the pool and returns ``None``; a flag it cannot honour is not ignored silently.
- ``A_log``, ``dt_bias`` or ``lower_bound`` without ``use_gate_in_kernel``, and ``state_indices`` or
  ``has_initial_state`` without ``state_cache``, are ValueErrors for the same reason.
- ``has_initial_state=None`` means all true, for both functions.
- ``state_indices`` may be int32 or int64. Because the oracle runs on the host anyway, it always checks what
  the kernels check only under ``KDA_DEBUG=1``: ``cu_seqlens`` values, ``cu_seqlens_cpu == cu_seqlens``,
  slot indices in range and unique.

Speculative verify (``recurrent_kda`` only; ``chunk_kda`` raises, as ``kda.chunk_kda`` does):

- ``state_indices`` of shape ``[N, T_max]`` (``T_max`` >= the longest sequence) keeps the state after
  every token: the state after token ``j`` of sequence ``n`` is stored in slot ``state_indices[n, j]``, or
  nowhere when that entry is < 0. Entries past a sequence's length are ignored.
- Sequence ``n`` starts from slot ``state_indices[n, num_accepted_tokens[n] - 1]`` (the state after its
  last accepted draft of the previous verify step) when ``num_accepted_tokens`` (``[N]``, values in
  ``1 .. T_max``) is given, else from ``state_indices[n, 0]``. That read slot < 0 makes ``n`` a padding
  sequence: no read, no write, zero output rows (as a 1-D slot < 0 does).
- ``has_initial_state[n]`` false starts ``n`` from zeros without reading any slot, whatever
  ``num_accepted_tokens[n]`` says (the flag decides whether a state is read, ``num_accepted_tokens``
  where it is read from).
- A verify call is, by definition, its tokens decoded one call at a time: after each token the carried
  state is rounded to the pool's dtype, as a one-token call's store rounds it, whether or not the token's
  slot keeps it. A verify call and a chain of one-token calls therefore give the same states and outputs.
  An empty sequence keeps no state (no token, no slot written).
- Slots written (non-negative entries within each sequence's length) must be distinct over the call,
  and no sequence may read a slot that another sequence writes (checked always here, under
  ``KDA_DEBUG=1`` or on CPU by ``kda``).

Prefix-cache checkpoints (both functions here; in ``kda`` they are ``chunk_kda``'s):

- ``checkpoint_every`` (a positive multiple of 64, the kernels' chunk, so that a checkpoint lands on a chunk
  boundary of the walk) and ``checkpoint_indices`` (int32 or int64 ``[N, C]``), given together and only
  with ``state_cache``: the state after the first ``(j + 1) * checkpoint_every`` tokens of sequence ``n`` in
  this call is stored in slot ``checkpoint_indices[n, j]`` when that entry is >= 0 and the sequence is that
  long; entries past it are ignored. An engine that caches a state per block aligns its prefill chunks to
  blocks, so offsets count from the sequence's first token in the call.
- A checkpoint is rounded to the pool's dtype on store, as the final state is; the recurrence goes on from
  the unrounded state. A padding sequence writes no checkpoint.
- Checkpoint slots used must be distinct, must not be a slot any sequence's final state is written to, and
  must not be a slot any sequence reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .preprocess import prepare_inputs

# (q [L, K], k [L, K], v [L, V], g [L, K], beta [L], scale, state [K, V]) -> (o [L, V], state [K, V])
SequenceFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float, Tensor], tuple[Tensor, Tensor]]


def run_kda(
    sequence_fn: SequenceFn,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None,
    initial_state: Tensor | None,
    output_final_state: bool,
    *,
    use_qk_l2norm_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    use_gate_in_kernel: bool,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    lower_bound: float | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | Sequence[int] | None,
    state_v_first: bool,
    state_cache: Tensor | None,
    state_indices: Tensor | None,
    has_initial_state: Tensor | None,
    state_dtype: torch.dtype | None,
    out: Tensor | None,
    compute_dtype: torch.dtype,
    num_accepted_tokens: Tensor | None = None,
    allow_verify: bool = False,
    checkpoint_every: int | None = None,
    checkpoint_indices: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Check the arguments, then run ``sequence_fn`` on every (sequence, value head); see the module doc.
    ``allow_verify``: whether 2-D ``state_indices`` (speculative verify) is accepted (``recurrent_kda``)."""
    _check_tensors(q, k, v, g, beta)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _check_gate_options(use_gate_in_kernel, A_log, dt_bias, lower_bound, HV, K)
    sequences = _sequences(B, T, cu_seqlens, cu_seqlens_cpu)  # (batch row, start, end) per sequence
    N = len(sequences)
    final_dtype = _check_state(
        N, HV, K, V, initial_state, output_final_state, state_v_first, state_cache, state_indices,
        has_initial_state, state_dtype,
    )
    verify = state_cache is not None and isinstance(state_indices, Tensor) and state_indices.dim() == 2
    if verify and not allow_verify:
        raise ValueError("state_indices of shape [N, T_max] (speculative verify) is only available in "
                         "recurrent_kda (token by token)")
    if num_accepted_tokens is not None and not verify:
        raise ValueError("num_accepted_tokens needs state_indices of shape [N, T_max] (speculative verify) "
                         "with state_cache")
    slots_of = None  # verify: per sequence (read slot, [slot after token j])
    if verify:
        slots_of = _verify_slots(state_indices, num_accepted_tokens, [end - start for _, start, end in sequences],
                                 state_cache.shape[0])
    checkpoints = _checkpoint_slots(checkpoint_every, checkpoint_indices, state_cache, state_indices,
                                    has_initial_state, [end - start for _, start, end in sequences], verify)
    _check_out(out, (B, T, HV, V), q, k, v, g, beta)
    if scale is None:
        scale = K**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise TypeError(f"compute_dtype must be a floating torch.dtype, got {compute_dtype!r}")

    q, k, v, g, beta = prepare_inputs(
        q, k, v, g, beta,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        compute_dtype=compute_dtype,
    )

    def to_stored(state_kv: Tensor) -> Tensor:  # internal [K, V] -> stored layout
        return state_kv.T if state_v_first else state_kv

    def from_stored(plane: Tensor) -> Tensor:  # stored layout -> internal [K, V] in compute_dtype
        # Contiguous whatever the stored layout: the recurrence's matmuls then run on the same strides (so the
        # same BLAS kernel and summation order, on GPU too) for a paged, a dense and a zero initial state.
        return (plane.T if state_v_first else plane).to(compute_dtype).contiguous()

    zeros_kv = torch.zeros(K, V, dtype=compute_dtype, device=q.device)
    o = torch.zeros(B, T, HV, V, dtype=compute_dtype, device=q.device)  # padding rows stay zero
    final_state = None
    if output_final_state:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        final_state = torch.empty(shape, dtype=final_dtype, device=q.device)

    heads_per_qk_head = HV // H
    for n, (row, start, end) in enumerate(sequences):
        slot = None
        if slots_of is not None:
            slot, token_slots = slots_of[n]  # read slot; slot after each token
            if slot < 0:  # padding sequence: no read, no write, output rows stay zero
                continue
        elif state_cache is not None:
            slot = int(state_indices[n])
            if slot < 0:  # padding sequence: no read, no write, output rows stay zero
                continue
        for j in range(HV):
            hq = j // heads_per_qk_head  # GVA: value head j reads q/k head j // (HV // H)
            if initial_state is not None:
                state = from_stored(initial_state[n, j])
            elif slot is not None and (has_initial_state is None or bool(has_initial_state[n])):
                state = from_stored(state_cache[slot, j])
            else:
                state = zeros_kv
            if slots_of is not None:
                # verify: one decode call per token; each stores (rounded) and the next starts from the store
                for t in range(start, end):
                    o_tok, state = sequence_fn(
                        q[row, t:t + 1, hq], k[row, t:t + 1, hq], v[row, t:t + 1, j],
                        g[row, t:t + 1, j], beta[row, t:t + 1, j], float(scale), state,
                    )
                    o[row, t, j] = o_tok[0]
                    state = state.to(state_cache.dtype).to(compute_dtype)  # a decode call's store rounding
                    if token_slots[t - start] >= 0:
                        state_cache[token_slots[t - start], j].copy_(to_stored(state))
                continue
            # the sequence in pieces that end at its checkpoints (multiples of the chunk: the same arithmetic)
            reached = checkpoints[n] if checkpoints is not None else []
            t0 = start
            for c, t1 in enumerate([start + (c + 1) * checkpoint_every for c in range(len(reached))] + [end]):
                if t1 > t0:
                    o_seq, state = sequence_fn(
                        q[row, t0:t1, hq], k[row, t0:t1, hq], v[row, t0:t1, j],
                        g[row, t0:t1, j], beta[row, t0:t1, j], float(scale), state,
                    )
                    o[row, t0:t1, j] = o_seq
                t0 = t1
                if c < len(reached) and reached[c] >= 0:
                    state_cache[reached[c], j].copy_(to_stored(state))  # rounded to the pool dtype; go on unrounded
            if slot is not None:
                state_cache[slot, j].copy_(to_stored(state))  # in place; copy_ rounds to the pool dtype
            elif final_state is not None:
                final_state[n, j] = to_stored(state)  # the single rounding to final_dtype

    if out is not None:
        out.copy_(o)
        return out, final_state
    return o, final_state


def _check_tensors(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> None:
    for name, x, ndim, layout in (
        ("q", q, 4, "[B, T, H, K]"), ("k", k, 4, "[B, T, H, K]"), ("v", v, 4, "[B, T, HV, V]"),
        ("g", g, 4, "[B, T, HV, K]"), ("beta", beta, 3, "[B, T, HV]"),
    ):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
        if x.dim() != ndim:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(x.shape)}")
    B, T, H, K = q.shape
    HV = v.shape[2]
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B={B}, T={T}, HV, V], got {tuple(v.shape)}")
    if H == 0 or HV % H != 0:
        raise ValueError(f"v's head count HV={HV} must be a multiple of q's head count H={H}")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g must be [B, T, HV, K] = {(B, T, HV, K)}, got {tuple(g.shape)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = {(B, T, HV)}, got {tuple(beta.shape)}")


def _check_gate_options(use_gate: bool, A_log, dt_bias, lower_bound, HV: int, K: int) -> None:
    if not use_gate:
        for name, value in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if value is not None:
                raise ValueError(f"{name} is only used with use_gate_in_kernel=True; it would be ignored")
        return
    if A_log is not None and (not isinstance(A_log, Tensor) or A_log.shape != (HV,)):
        raise ValueError(f"A_log must be a tensor of shape [HV] = ({HV},), got {_describe(A_log)}")
    if dt_bias is not None and (
        not isinstance(dt_bias, Tensor) or tuple(dt_bias.shape) not in ((HV * K,), (HV, K))
    ):
        raise ValueError(f"dt_bias must be [HV * K] = ({HV * K},) or [HV, K] = ({HV}, {K}), "
                         f"got {_describe(dt_bias)}")
    if lower_bound is not None and not float(lower_bound) < 0:
        raise ValueError(f"lower_bound must be negative (or None), got {lower_bound}")


def _sequences(B: int, T: int, cu_seqlens: Tensor | None, cu_seqlens_cpu):
    """[(batch row, start, end)] for each sequence: B dense rows, or the varlen spans of cu_seqlens.
    `cu_seqlens_cpu`, as `kda` takes it: a tensor or a list or tuple of ints, equal to cu_seqlens."""
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise ValueError("cu_seqlens_cpu was given without cu_seqlens")
        return [(b, 0, T) for b in range(B)]
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be an int32 or int64 tensor, got {_describe(cu_seqlens)}")
    if B != 1:
        raise ValueError(f"cu_seqlens (varlen) needs B == 1, got B={B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be [N + 1], got shape {tuple(cu_seqlens.shape)}")
    bounds = cu_seqlens.tolist()
    if cu_seqlens_cpu is not None:
        host = cu_seqlens_cpu.tolist() if isinstance(cu_seqlens_cpu, Tensor) else cu_seqlens_cpu
        if not isinstance(host, (list, tuple)) or list(host) != bounds:
            raise ValueError("cu_seqlens_cpu must hold the same values as cu_seqlens")
    if bounds[0] != 0 or bounds[-1] != T or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T={T}, got {bounds}")
    return [(0, start, end) for start, end in zip(bounds, bounds[1:])]


def _check_state(
    N, HV, K, V, initial_state, output_final_state, state_v_first, state_cache, state_indices,
    has_initial_state, state_dtype,
) -> torch.dtype:
    """Check the state arguments; return the dtype the final state is stored in."""
    plane = (HV, V, K) if state_v_first else (HV, K, V)
    layout = "[., HV, V, K] (state_v_first=True)" if state_v_first else "[., HV, K, V] (state_v_first=False)"
    if state_dtype is not None and not (
        isinstance(state_dtype, torch.dtype) and state_dtype.is_floating_point
    ):
        raise TypeError(f"state_dtype must be a floating torch.dtype or None, got {state_dtype!r}")
    if initial_state is not None and state_cache is not None:
        raise ValueError("pass either initial_state (dense state) or state_cache (paged state), not both")
    if state_cache is None:
        for name, value in (("state_indices", state_indices), ("has_initial_state", has_initial_state)):
            if value is not None:
                raise ValueError(f"{name} is only used with state_cache (paged state); it would be ignored")
    if initial_state is not None:
        if not isinstance(initial_state, Tensor) or not initial_state.is_floating_point():
            raise TypeError(f"initial_state must be a floating tensor, got {_describe(initial_state)}")
        if initial_state.shape != (N, *plane):
            raise ValueError(
                f"initial_state must be {layout} = {(N, *plane)}, got {tuple(initial_state.shape)}"
            )
        if state_dtype is not None and state_dtype != initial_state.dtype:
            raise ValueError(
                f"state_dtype={state_dtype} differs from initial_state.dtype={initial_state.dtype}"
            )
        return initial_state.dtype
    if state_cache is None:
        return torch.float32 if state_dtype is None else state_dtype

    if not isinstance(state_cache, Tensor) or not state_cache.is_floating_point():
        raise TypeError(f"state_cache must be a floating tensor, got {_describe(state_cache)}")
    if state_cache.dim() != 4 or state_cache.shape[1:] != plane:
        raise ValueError(f"state_cache must be {layout} with plane {plane}, got {tuple(state_cache.shape)}")
    slots = state_cache.shape[0]
    if slots > 0 and not state_cache[0].is_contiguous():
        raise ValueError(f"each state_cache slot plane must be dense, got strides {state_cache.stride()}")
    if state_dtype is not None and state_dtype != state_cache.dtype:
        raise ValueError(f"state_dtype={state_dtype} differs from state_cache.dtype={state_cache.dtype}")
    if output_final_state:
        raise ValueError("output_final_state=True is not available with state_cache: the paged contract "
                         "writes the final state into the pool and returns None")
    if (not isinstance(state_indices, Tensor) or state_indices.dtype not in (torch.int32, torch.int64)
            or state_indices.dim() not in (1, 2) or state_indices.shape[0] != N):
        raise ValueError(f"state_indices must be an int32 (or int64) tensor of shape [N] = ({N},) or "
                         f"[N, T_max] = ({N}, T_max), got {_describe(state_indices)}")
    named = [i for i in state_indices.tolist() if i >= 0] if state_indices.dim() == 1 else []
    if any(i >= slots for i in named) or len(set(named)) != len(named):
        raise ValueError(f"state_indices must name distinct slots in [0, {slots}) or be < 0 (padding), "
                         f"got {state_indices.tolist()}")
    if has_initial_state is not None and (
        not isinstance(has_initial_state, Tensor) or has_initial_state.dtype != torch.bool
        or has_initial_state.shape != (N,)
    ):
        raise ValueError(f"has_initial_state must be a bool tensor of shape [N] = ({N},), "
                         f"got {_describe(has_initial_state)}")
    return state_cache.dtype


def _verify_slots(state_indices: Tensor, num_accepted_tokens: Tensor | None, lengths: list[int],
                  slots: int) -> list[tuple[int, list[int]]]:
    """Speculative verify: per sequence n, (the slot its initial state is read from, the slot receiving the
    state after each of its tokens). The read slot is ``state_indices[n, num_accepted_tokens[n] - 1]``
    (``state_indices[n, 0]`` without ``num_accepted_tokens``); < 0 marks a padding sequence (no token
    slots then). Checks the shapes and every value used (see the module doc)."""
    N, T_max = state_indices.shape
    if lengths and max(lengths) > T_max:
        raise ValueError(f"state_indices [N, T_max] needs T_max >= the longest sequence ({max(lengths)}), "
                         f"got T_max={T_max}")
    if num_accepted_tokens is None:
        columns = [0] * N
    else:
        if (not isinstance(num_accepted_tokens, Tensor)
                or num_accepted_tokens.dtype not in (torch.int32, torch.int64)
                or num_accepted_tokens.shape != (N,)):
            raise ValueError(f"num_accepted_tokens must be an int32 (or int64) tensor of shape [N] = ({N},), "
                             f"got {_describe(num_accepted_tokens)}")
        accepted = num_accepted_tokens.tolist()
        if any(not 1 <= a <= T_max for a in accepted):
            raise ValueError(f"num_accepted_tokens must lie in 1 .. T_max={T_max}, got {accepted}")
        columns = [a - 1 for a in accepted]
    rows = state_indices.tolist()
    result = []
    for n in range(N):
        read = rows[n][columns[n]]
        result.append((read, rows[n][:lengths[n]] if read >= 0 else []))
    written = [s for _, token_slots in result for s in token_slots if s >= 0]
    used = written + [read for read, _ in result if read >= 0]
    if any(s >= slots for s in used):
        raise ValueError(f"state_indices must name slots in [0, {slots}) or be < 0, got {rows}")
    if len(set(written)) != len(written):
        raise ValueError(f"state_indices names one slot twice among the slots written, got {rows}")
    for n, (read, token_slots) in enumerate(result):
        if read >= 0 and read in set(written) - set(token_slots):
            raise ValueError(f"state_indices: sequence {n} reads slot {read}, which another sequence writes")
    return result


def _checkpoint_slots(checkpoint_every, checkpoint_indices, state_cache, state_indices, has_initial_state,
                      lengths: list[int], verify: bool) -> list[list[int]] | None:
    """Prefix-cache checkpoints: per sequence, the slot of each checkpoint it reaches (entries < 0 store
    nothing; none for a padding sequence), or None without checkpoints. Checks them (see the module doc)."""
    if checkpoint_every is None and checkpoint_indices is None:
        return None
    if checkpoint_every is None or checkpoint_indices is None:
        raise ValueError("checkpoint_every and checkpoint_indices are given together")
    if state_cache is None or verify:
        raise ValueError("checkpoint_indices needs state_cache with state_indices of shape [N] (not verify)")
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every <= 0 \
            or checkpoint_every % 64 != 0:
        raise ValueError(f"checkpoint_every must be a positive multiple of 64, got {checkpoint_every!r}")
    N = len(lengths)
    if (not isinstance(checkpoint_indices, Tensor) or checkpoint_indices.dtype not in (torch.int32, torch.int64)
            or checkpoint_indices.dim() != 2 or checkpoint_indices.shape[0] != N):
        raise ValueError(f"checkpoint_indices must be an int32 (or int64) tensor of shape [N, C] = ({N}, C), "
                         f"got {_describe(checkpoint_indices)}")
    rows, finals = checkpoint_indices.tolist(), state_indices.tolist()
    reached = [row[:lengths[n] // checkpoint_every] if finals[n] >= 0 else [] for n, row in enumerate(rows)]
    used = [s for row in reached for s in row if s >= 0]
    slots = state_cache.shape[0]
    read = [s for n, s in enumerate(finals) if s >= 0 and (has_initial_state is None or bool(has_initial_state[n]))]
    if (any(s >= slots for s in used) or len(set(used)) != len(used)
            or set(used) & {s for s in finals if s >= 0} or set(used) & set(read)):
        raise ValueError(f"checkpoint_indices must name distinct slots in [0, {slots}) that no sequence reads "
                         f"or ends in (state_indices {finals}), got {rows}")
    return reached


def _check_out(out: Tensor | None, shape: tuple, *inputs: Tensor) -> None:
    if out is None:
        return
    if not isinstance(out, Tensor) or not out.is_floating_point():
        raise TypeError(f"out must be a floating tensor, got {_describe(out)}")
    if out.shape != shape:
        raise ValueError(f"out must be [B, T, HV, V] = {shape}, got {tuple(out.shape)}")
    out_storage = out.untyped_storage().data_ptr()
    if out.numel() > 0 and any(x.untyped_storage().data_ptr() == out_storage for x in inputs):
        raise ValueError("out must not share memory with q, k, v, g or beta")


def _describe(x) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
