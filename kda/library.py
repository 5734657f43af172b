"""`kda::chunk_kda` and `kda::fused_recurrent_kda` as `torch.library` custom ops, for `torch.compile`.

`kda.chunk_kda` and `kda.fused_recurrent_kda` go through these ops only while `torch.compile` traces them
(`torch.compiler.is_compiling()`); a plain Python call launches the kernels directly, without the
dispatcher (docs/contract.md, "torch.compile and custom ops").

The ops' parameters, their order and the mutated ones come from `kda.arguments` (its op column). The schema
differs from the public signature where the dispatcher needs it:
- `out` is required and mutated (a custom op's output may not alias an input): the public wrapper
  allocates it with `torch.empty` when the caller passed none.
- `state_cache` is mutated (the paged contract writes it in place).
- they return the final state alone: a fresh tensor, or an empty `[0]` tensor of the state dtype when
  the call has none (paged, or `output_final_state=False`); the wrapper maps that back to None.
- `cu_seqlens_cpu` is a CPU tensor or None (the wrapper turns a list or tuple into a tensor).
- `fused_recurrent_kda`'s `num_accepted_tokens` (speculative verify) comes last, after `seed`; the pool
  (`state_cache`) is the only state it mutates, whatever the shape of `state_indices`.
- `chunk_kda`'s `checkpoint_every` and `checkpoint_indices` (prefix-cache checkpoints) come last, after
  `out` and `errors`; the checkpoints go into `state_cache`, already declared mutated.
- `errors` (the caller's error word, or None) comes right after `out`, declared mutated and with no
  default: PyTorch 2.11's in-place bookkeeping indexes the mutated arguments among the positional ones,
  and a trailing argument left at its default is dropped from them (an IndexError under `opcheck` and
  `torch.compile`).

The real implementations run `kda.contract.check_call` (every check of the contract) and then the
kernels. The fake implementations compute the final state's shape and dtype from the arguments alone, by
the rules of `kda.ops.buffers.state_plan`, without reading any tensor's values.
"""

from __future__ import annotations

import torch

from . import arguments, run
from .contract import check_call

# How many times each op's real implementation ran (the tests assert that a plain call never does).
calls = {"chunk_kda": 0, "fused_recurrent_kda": 0}


def _no_final(call) -> torch.Tensor:
    return torch.empty(0, dtype=call.state_dtype, device=call.q.device)


def _run(fn: str, args: dict) -> torch.Tensor:
    """The real implementation of op `fn` for its arguments `args` (by name)."""
    call = check_call(fn, require_has_initial_state=fn == "chunk_kda", **args)
    calls[fn] += 1
    fwd = run.chunk if fn == "chunk_kda" else run.recurrent
    _, final = fwd(call, **{n: args[n] for n in arguments.launcher_names(fn)})
    return final if final is not None else _no_final(call)


def fake_final_state(q, v, initial_state, output_final_state, cu_seqlens, state_v_first, state_cache,
                     state_dtype) -> torch.Tensor:
    """The final state's metadata by `kda.ops.buffers.state_plan`'s rules, from shapes and dtypes only: paged or
    no `output_final_state` -> `[0]`; else `[N, *plane]` with N = len(cu_seqlens) - 1 (varlen) or B, the
    plane `[HV, V, K]` (`state_v_first=True`) or `[HV, K, V]`, in `state_dtype`, else the pool's dtype,
    else fp32."""
    pool = state_cache if state_cache is not None else initial_state
    dtype = state_dtype if state_dtype is not None else (pool.dtype if pool is not None else torch.float32)
    if state_cache is not None or not output_final_state:
        return q.new_empty((0,), dtype=dtype)
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    plane = (HV, V, K) if state_v_first else (HV, K, V)
    return q.new_empty((N, *plane), dtype=dtype)


def _op(fn: str):
    """`kda::{fn}`: its implementation and fake implementation take the parameters `kda.arguments` gives the op
    (the schema is inferred from their annotations), its mutated arguments are the table's."""
    params = arguments.op_parameters_source(fn)
    real = arguments.define(f"{fn}_op", f"def {fn}_op({params}) -> torch.Tensor:\n"
                                        f"    return _run({fn!r}, locals())  # the parameters, by name\n", globals())
    real.__doc__ = f"`kda.{fn}` writing o into `out`; returns the final state (or an empty `[0]` tensor)."
    fake = arguments.define(f"_{fn}_fake", f"def _{fn}_fake({params}):\n"
                                           "    return fake_final_state(q, v, initial_state, output_final_state, "
                                           "cu_seqlens, state_v_first, state_cache, state_dtype)\n", globals())
    op = torch.library.custom_op(f"kda::{fn}", real, mutates_args=arguments.mutated(fn))
    op.register_fake(fake)
    return op


chunk_kda_op = _op("chunk_kda")
fused_recurrent_kda_op = _op("fused_recurrent_kda")


def host_bounds_tensor(cu_seqlens_cpu) -> torch.Tensor | None:
    """`cu_seqlens_cpu` as the ops take it: None or a CPU tensor (a list or tuple becomes an int64 tensor)."""
    if cu_seqlens_cpu is None or isinstance(cu_seqlens_cpu, torch.Tensor):
        return cu_seqlens_cpu
    return torch.tensor(list(cu_seqlens_cpu), dtype=torch.int64)
