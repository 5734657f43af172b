"""The public functions. Both share one signature (the first eight parameters positional, as in fla;
the rest keyword-only) and one contract, checked by `kda.contract.check_call` before any launch.

A plain call validates and launches directly; a call of a kind seen before (the same metadata, flags and host
bounds) launches the kernels recorded for that kind (`kda.replay`, docs/contract.md "Repeated calls"). While
`torch.compile` traces a call
(`torch.compiler.is_compiling()`), it goes through the custom op of `kda.library` instead (`out`
allocated here when not given; the op validates when it runs): docs/contract.md, "torch.compile and
custom ops".

The signatures and docstrings below are written out for readers and IDEs; the body both functions share,
`_BODY`, is written out per function from `kda.arguments`' table at import, and each signature is checked
against the table there."""

from __future__ import annotations

import inspect

import torch

from . import arguments, library, replay, run
from .contract import check_call  # noqa: F401  (called by the compiled bodies)

_launchers = (run.chunk, run.recurrent)  # plan, then launch (`kda.run`)


def check_call_args(fn, *args, **kwargs) -> tuple[tuple, dict]:
    """The arguments with which the public `fn` (`chunk_kda` or `fused_recurrent_kda`) would call
    `kda.contract.check_call` for these arguments (its defaults filled in), for tools that validate or plan
    a call without launching it: `check_call(*positional, **keywords)` is the `KDACall` that `kda.plan`
    builds plans from. Unknown keywords raise `TypeError` as the call would."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    kw = bound.arguments
    positional = (fn.__name__, *(kw.pop(a.name) for a in arguments.of(fn.__name__) if a.positional))
    return positional, dict(kw, require_has_initial_state=fn.__name__ == "chunk_kda")


def _through_op(op, q, k, v, g, beta, scale, initial_state, output_final_state, *, cu_seqlens_cpu, state_cache,
                out, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The traced path: one custom op call, `out` allocated when absent, the empty final state mapped to None."""
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # o is [B, T, HV, V]
    final = op(q, k, v, g, beta, scale, initial_state, output_final_state,
               cu_seqlens_cpu=library.host_bounds_tensor(cu_seqlens_cpu), state_cache=state_cache, out=out, **kw)
    return out, (final if output_final_state and state_cache is None else None)


# The body of both public functions; its fields, filled per function from `kda.arguments`: the arguments as the
# callee takes them (`call`), those of the replay key (`key`), the call's tensors (`tensors`), the argument
# passed to each replay (`per_call`) and those passed to the launcher (`launcher`).
_BODY = """\
    if torch.compiler.is_compiling():  # one opaque custom op in the traced graph
        return _through_op(library.{name}_op, {call})
    # a call of a kind seen before launches its recorded kernels (kda.replay); KDA_DEBUG on takes the full path
    key = replay.{key_function}({key})
    if key is not None:
        tensors = {tensors}
        result = replay.replayed(key, tensors, {per_call}, cu_seqlens_cpu)
        if result is not None:
            return result
    call = check_call({name!r}, {call}, require_has_initial_state={requires})
    if key is None:
        return _launchers[{launcher_index}](call{launcher})
    return _recorded(key, tensors, cu_seqlens_cpu, _launchers[{launcher_index}], call{launcher})
"""


def _public(fn: str, key_function: str, launcher_index: int):
    """`arguments.compiled` with `_BODY` filled in for `fn`."""
    return arguments.compiled(fn, _BODY.format(
        name=fn, call=arguments.call_source(fn), key_function=key_function,
        key=", ".join(arguments.key_names(fn)), tensors=arguments.tensors_source(fn),
        per_call=", ".join(arguments.per_call(fn)) or "None", requires=fn == "chunk_kda",
        launcher_index=launcher_index, launcher="".join(f", {n}={n}" for n in arguments.launcher_names(fn)),
    ), globals())


def _recorded(key, tensors, bounds, fwd, call, **kw):
    """`fwd(call, **kw)` with its launches recorded under `key` (`kda.replay`), with its host bounds."""
    record = replay.recording()
    try:
        result = fwd(call, **kw)
    finally:
        replay.stop()
    try:
        replay.remember(key, tensors, record, result, bounds)
    except replay.Unrecordable:  # a kind that cannot be recorded takes the full path next time too; the call has run
        replay.CACHE.pop(key, None)
    return result


@_public("chunk_kda", "chunk_key", 0)
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
    errors: torch.Tensor | None = None,
    checkpoint_every: int | None = None,
    checkpoint_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention, chunked (prefill, any length). Must equal `kda_reference.chunk_kda` and
    `kda_reference.recurrent_kda`:

        S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale q_t)

    Shapes: q, k `[B, T, H, K]`; v `[B, T, HV, V]`; g `[B, T, HV, K]` (a log-decay, <= 0, or the raw gate
    input with `use_gate_in_kernel`); beta `[B, T, HV]`. Returns `(o, final_state)`, o `[B, T, HV, V]`
    in v's dtype (written into `out` when given).

    Gate (`use_gate_in_kernel`): `kda_reference.kda_gate` of g; `A_log` `[HV]` None means `exp(A_log) = 1`
    (no per-head rate), `dt_bias` None means 0.

    Sequences: a dense batch (N = B), or varlen with `B == 1` and `cu_seqlens` `[N+1]` on the device;
    empty sequences are legal anywhere, and the bounds may end below T (a token count padded for a CUDA
    graph: the rows past the last bound are zero in o). `cu_seqlens_cpu` is accepted and checked, never
    needed: chunks are mapped to sequences on the device, so no call syncs.

    State (one contract at a time): none; dense `initial_state` `[N, HV, K, V]` (`[N, HV, V, K]` with
    `state_v_first=True`), final state in the same layout and dtype (else in `state_dtype`, default fp32)
    when `output_final_state`; paged `state_cache` `[slots, HV, V, K]` with `state_v_first=True` or
    `[slots, HV, K, V]` with `state_v_first=False` (required with a pool: a square plane cannot reveal
    its layout; without a pool None means False, fla's K-first layout), read and written in place
    through `state_indices` (int32 `[N]`, `< 0` = padding: no read, no write, zero output rows) and
    `has_initial_state` (bool `[N]`, required). fp32, fp16 or bf16 storage; the recurrence
    accumulates in fp32 and only the store rounds (to nearest even).

    Prefix-cache checkpoints (paged only): `checkpoint_every` (a positive multiple of 64) and
    `checkpoint_indices` (int32 or int64 `[N, C]`, stride 1 along C), given together. The state after the
    first `(j + 1) * checkpoint_every` tokens of sequence n in this call (offsets count from its first token
    here) is stored, in the pool's dtype and layout, to slot `checkpoint_indices[n, j]` during the same walk,
    when that entry is >= 0 and the sequence is that long (a sequence ending exactly there stores it too: it
    equals the final state); the walk goes on from the unrounded state. Padding sequences store nothing;
    a slot outside the pool is skipped. Checkpoint slots must be distinct and differ from every slot in
    `state_indices` (checked under KDA_DEBUG, or on CPU).

    `errors` (optional, int32 `[N]` on the device, zeroed by the caller): the kernels OR into `errors[n]`
    what their guards found for sequence n without a host read (`kda.ERROR_SLOT`, `ERROR_BOUNDS`,
    `ERROR_KEPT_SLOT`; docs/contract.md); the caller reads it whenever it likes, e.g. once per step.
    """
    # the body is `_BODY`, written out for this function by `_public`
@_public("fused_recurrent_kda", "decode_key", 1)
def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
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
    num_accepted_tokens: torch.Tensor | None = None,
    state_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    errors: torch.Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention token by token (decode and short sequences): the same function, signature and
    state contracts as `chunk_kda` (see there), one launch per call. Must equal
    `kda_reference.recurrent_kda`. Differences: `has_initial_state` is optional for the paged contract
    (default: every non-padding slot is read). A varlen decode batch (every sequence one token) takes the
    faster one-token kernel when `cu_seqlens_cpu` is given and equals 0, 1, ..., N (checked on the host);
    without the host copy the kernel cannot know the lengths without a sync and runs the general loop
    kernel (same results to rounding, slower for 2-byte pools).

    `stochastic_rounding=True` (fp16/bf16 storage only; off by default) rounds the stored state
    stochastically instead of to nearest even, with noise drawn from `seed`, the element's slot and head,
    and its value: the same seed and inputs give the same bits. Pass a different seed per decode step (e.g.
    the step number), or a value that recurs rounds the same way every step.

    Speculative verify (vLLM's spec-decode convention, docs/contract.md): `state_indices` int32
    `[N, T_max]` (T_max >= the longest sequence) stores the state after token j of sequence n in slot
    `state_indices[n, j]` (< 0: not kept), and `num_accepted_tokens` int32 `[N]` (optional, values
    1..T_max, only with the 2-D form) starts sequence n from slot
    `state_indices[n, num_accepted_tokens[n] - 1]`, the state after its last accepted draft, instead of
    `state_indices[n, 0]`; that read slot < 0 marks a padding sequence. `has_initial_state[n]` false still
    starts from zeros without a read. The call equals its tokens decoded one call at a time (the carried
    state is rounded to the pool's dtype after every token). Not with `stochastic_rounding`.

    `errors`: as in `chunk_kda` (with `kda.ERROR_ACCEPTED` for a count outside 1..T_max).
    """
    # the body is `_BODY`, written out for this function by `_public`
