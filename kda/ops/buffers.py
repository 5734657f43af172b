"""What a call's kernels read and write besides their inputs: the output buffer, the state pools (`StatePlan`) and
the gate's parameters with their stand-ins. Allocated here, when `kda.ops` runs a plan, never while planning."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract import KDACall

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
        """(src, dst, slot_of_seq, has_initial_state) with stand-ins for the absent ones (never read or written:
        the kernels' matching constexpr flags are off). An absent pool is stood in for by the other one, so that
        a kernel choosing its form by the source pool's dtype sees the state's dtype, not `stand_in`'s."""
        src, dst, slots, flags = self.src, self.dst, self.slot_of_seq, self.has_initial_state
        src = dst if src is None else src
        dst = src if dst is None else dst
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
