"""A validated call, run: `kda.plan` plans it from shapes, flags and the device, then `kda.ops` launches that
plan (allocating outputs and workspaces). The public functions (`kda.api`) and the custom ops (`kda.library`)
both come here after `kda.contract.check_call`."""

from __future__ import annotations

import functools

import torch

from . import plan
from .contract import KDACall


@functools.cache
def _kernels():
    """(chunk_kda_fwd, fused_recurrent_kda_fwd), imported at the first call, not with this module (the kernels
    are defined on import, which must follow TRITON_INTERPRET), and looked up once: an import statement in the
    call path costs microseconds per call."""
    from .ops.chunk import chunk_kda_fwd
    from .ops.fused_recurrent import fused_recurrent_kda_fwd

    return chunk_kda_fwd, fused_recurrent_kda_fwd


def chunk(call: KDACall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_kda` of a validated call: (o, final_state)."""
    kernels, route = plan.prefill_plan(call)
    return _kernels()[0](call, kernels, route)


def recurrent(call: KDACall, stochastic_rounding: bool = False,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`fused_recurrent_kda` of a validated call: (o, final_state)."""
    return _kernels()[1](call, plan.decode_plan(call, stochastic_rounding), seed=seed)
