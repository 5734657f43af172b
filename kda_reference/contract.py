"""The call contract shared by `recurrent_kda` and `chunk_kda`: checks, sequences, state load and store.

Nothing here is math. `run_kda` checks the arguments, splits the batch into sequences, loads each
sequence's initial state (zeros, dense `initial_state`, or a slot of the paged `state_cache`), hands one
(sequence, value head) at a time to a `SequenceFn` that does the math in `compute_dtype`, and stores the
result. The two public functions differ only in the `SequenceFn` they pass.

The checks are `kda`'s own: `kda.contract.check_call`, the one rulebook of both packages (plain PyTorch; importing
it loads no Triton), called with ``oracle=True``. So the oracle accepts and rejects exactly the inputs ``kda``
accepts and rejects, with the same exception naming the same argument (docs/contract.md): a pool needs
``state_v_first``; ``state_indices`` and ``num_accepted_tokens`` are int32; ``chunk_kda`` with a pool needs
``has_initial_state`` (``recurrent_kda``, like ``kda.fused_recurrent_kda``, reads every slot without it);
``out`` has v's dtype; inputs keep ``kda``'s dtypes, strides and head sizes. Because the oracle runs on the
host anyway, it always checks what the kernels check only under ``KDA_DEBUG=1``: ``cu_seqlens`` values,
``cu_seqlens_cpu == cu_seqlens``, slot indices in range and unique, verify and checkpoint slots.

Decisions where the interface (docs/contract.md) leaves an oracle a choice:

- ``allow_float64=True`` (the oracle's exact mode, default off, no ``kda`` equivalent): float64 is accepted
  wherever ``kda`` takes a float tensor or ``state_dtype``, for the oracle's own exactness tests and the
  accuracy harness's unrounded state. Off, float64 is refused as ``kda`` refuses it.
- ``o`` is returned in ``compute_dtype`` (float64 by default: the exact answer, not rounded to v's
  dtype). With ``out=``, ``o`` is copied into ``out`` (rounded to ``out.dtype``) and ``out`` is returned.
- Trailing rows: varlen bounds may end below T (a token count padded for a CUDA graph); the rows past the
  last bound are zero in ``o`` (and ``out``), as padding sequences' rows are.
- ``final_state`` is rounded to its storage dtype once, on store (a plain ``.to(dtype)``: round to nearest
  even), as the kernels do. Its dtype is ``initial_state.dtype`` if given, else ``state_dtype``
  (default float32); with ``allow_float64``, ``state_dtype=torch.float64`` keeps it exact.

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
  and no sequence may read a slot that another sequence writes.

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

from kda.contract import check_call  # torch only: `kda`'s package init loads nothing else

from .preprocess import prepare_inputs

# (q [L, K], k [L, K], v [L, V], g [L, K], beta [L], scale, state [K, V]) -> (o [L, V], state [K, V])
SequenceFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float, Tensor], tuple[Tensor, Tensor]]


def run_kda(
    sequence_fn: SequenceFn,
    fn: str,
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
    state_v_first: bool | None,
    state_cache: Tensor | None,
    state_indices: Tensor | None,
    has_initial_state: Tensor | None,
    state_dtype: torch.dtype | None,
    out: Tensor | None,
    compute_dtype: torch.dtype,
    allow_float64: bool,
    num_accepted_tokens: Tensor | None = None,
    checkpoint_every: int | None = None,
    checkpoint_indices: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Check the arguments as ``kda.{fn}`` does (``fn``: "chunk_kda" or "fused_recurrent_kda"), then run
    ``sequence_fn`` on every (sequence, value head); see the module doc."""
    if not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise TypeError(f"compute_dtype must be a floating torch.dtype, got {compute_dtype!r}")
    if not isinstance(allow_float64, bool):
        raise TypeError(f"allow_float64 must be a bool, got {allow_float64!r}")
    call = check_call(
        fn, q, k, v, g, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, state_v_first=state_v_first, state_cache=state_cache,
        state_indices=state_indices, has_initial_state=has_initial_state, state_dtype=state_dtype, out=out,
        require_has_initial_state=fn == "chunk_kda", num_accepted_tokens=num_accepted_tokens,
        checkpoint_every=checkpoint_every, checkpoint_indices=checkpoint_indices,
        oracle=True, allow_float64=allow_float64,
    )
    B, T, H, HV, K, V, N = call.B, call.T, call.H, call.HV, call.K, call.V, call.N
    scale, state_v_first, final_dtype = call.scale, call.state_v_first, call.state_dtype
    if cu_seqlens is None:
        sequences = [(b, 0, T) for b in range(B)]  # (batch row, start, end) per sequence
    else:  # the bounds, read and checked by check_call; rows past the last one stay zero
        bounds = call.host_bounds
        sequences = [(0, start, end) for start, end in zip(bounds, bounds[1:])]
    lengths = [end - start for _, start, end in sequences]
    slots_of = _verify_slots(state_indices, num_accepted_tokens, lengths) if call.verify else None
    checkpoints = (_checkpoint_slots(checkpoint_every, checkpoint_indices, state_indices, lengths)
                   if call.checkpoint_every else None)

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
    o = torch.zeros(B, T, HV, V, dtype=compute_dtype, device=q.device)  # padding and trailing rows stay zero
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


def _verify_slots(state_indices: Tensor, num_accepted_tokens: Tensor | None,
                  lengths: list[int]) -> list[tuple[int, list[int]]]:
    """Speculative verify: per sequence n, (the slot its initial state is read from, the slot receiving the
    state after each of its tokens). The read slot is ``state_indices[n, num_accepted_tokens[n] - 1]``
    (``state_indices[n, 0]`` without ``num_accepted_tokens``); < 0 marks a padding sequence (no token
    slots then). The values were checked by ``check_call``."""
    rows = state_indices.tolist()
    columns = [0] * len(rows) if num_accepted_tokens is None else [a - 1 for a in num_accepted_tokens.tolist()]
    result = []
    for row, column, length in zip(rows, columns, lengths):
        read = row[column]
        result.append((read, row[:length] if read >= 0 else []))
    return result


def _checkpoint_slots(checkpoint_every: int, checkpoint_indices: Tensor, state_indices: Tensor,
                      lengths: list[int]) -> list[list[int]]:
    """Prefix-cache checkpoints: per sequence, the slot of each checkpoint it reaches (entries < 0 store
    nothing; none for a padding sequence). The values were checked by ``check_call``."""
    rows, finals = checkpoint_indices.tolist(), state_indices.tolist()
    return [row[:length // checkpoint_every] if final >= 0 else []
            for row, final, length in zip(rows, finals, lengths)]
