"""The float64 oracle the harness measures against, and the float64 emulation of a narrow state.

- `exact`: `kda_reference` in float64 with a float64 state (never rounded). Token by token
  (`recurrent_kda`, the definition) on the CPU; on CUDA for T >= 128 the chunked form
  (`kda_reference.chunk_kda`, float64, equal to the token loop to ~1e-14) because the token loop is
  launch-bound there. The method used is recorded in each entry.
- `Recurrence`: the same recurrence for N sequences and all heads at once, one token per step (the
  decode study carries it across 16384 steps in O(steps)). With `store_dtype` it is the emulation of
  float64 arithmetic, the state rounded to the storage dtype after every token
  (round to nearest even), as a decode loop through a paged pool does. `selfcheck` compares it with
  `kda_reference.recurrent_kda` on every run.
"""

from __future__ import annotations

import torch

import kda_reference as ref

from .inputs import Inputs

F64 = torch.float64


def exact(inp: Inputs, *, initial_state=None, state_v_first=False, cu_seqlens=None, method=None,
          tokens: slice = slice(None)):
    """(o, final_state), both float64 and exact (the state is never rounded); `method` "recurrent" or
    "chunk" (default: see the module docstring). `initial_state` may have any dtype: its values are used
    exactly. Returns also the method used."""
    q = inp.q[:, tokens]
    if method is None:
        method = "chunk" if (q.is_cuda and q.shape[1] >= 128) else "recurrent"
    fn = ref.chunk_kda if method == "chunk" else ref.recurrent_kda
    state = dict(initial_state=initial_state.to(F64)) if initial_state is not None else dict(state_dtype=F64)
    o, s = fn(*inp.args(tokens), output_final_state=True, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
              allow_float64=True, **state, **inp.opts)
    return o, s, method


def prepared(inp: Inputs, tokens: slice = slice(None)):
    """q, k, v, g, beta in float64 after the in-kernel options (l2norm, sigmoid, gate), ready to step."""
    return ref.prepare_inputs(*inp.args(tokens), **inp.opts, compute_dtype=F64)


class Recurrence:
    """Float64 KDA over N sequences, all heads at once, one token per `step`. State `[N, HV, K, V]`
    (K-first). With `store_dtype`, the state is rounded to it after every token (the emulation)."""

    def __init__(self, state: torch.Tensor, H: int, scale: float, store_dtype: torch.dtype | None = None):
        self.store_dtype = store_dtype
        self.S = self._store(state.to(F64))
        self.rep = state.shape[1] // H  # GVA: value head j uses q/k head j // rep
        self.scale = scale

    def _store(self, S: torch.Tensor) -> torch.Tensor:
        return S if self.store_dtype is None else S.to(self.store_dtype).to(F64)

    def step(self, q, k, v, g, beta) -> torch.Tensor:
        """One token: q, k `[N, H, K]`, v `[N, HV, V]`, g `[N, HV, K]`, beta `[N, HV]`, all float64
        and prepared. Returns o `[N, HV, V]` (computed before the state is stored, as the kernel does)."""
        if self.rep > 1:
            q, k = q.repeat_interleave(self.rep, dim=1), k.repeat_interleave(self.rep, dim=1)
        S = self.S * torch.exp(g)[..., None]
        u = beta[..., None] * (v - torch.einsum("nhkv,nhk->nhv", S, k))
        S = S + k[..., :, None] * u[..., None, :]
        o = torch.einsum("nhkv,nhk->nhv", S, q * self.scale)
        self.S = self._store(S)
        return o


def selfcheck(inp: Inputs, state: torch.Tensor, H: int, scale: float, steps: int) -> float:
    """Largest relative difference (outputs and final state) between `Recurrence` and
    `kda_reference.recurrent_kda` over the first `steps` tokens of `inp` from `state` (float64,
    K-first). Should be ~1e-15: the two are the same arithmetic in a different order."""
    tokens = slice(0, steps)
    o_ref, s_ref, _ = exact(inp, initial_state=state, method="recurrent", tokens=tokens)
    rec = Recurrence(state, H, scale)
    q, k, v, g, beta = prepared(inp, tokens)
    o = torch.stack([rec.step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t]) for t in range(steps)], dim=1)
    from .measure import rel_l2

    return max(rel_l2(o, o_ref), rel_l2(rec.S, s_ref))
