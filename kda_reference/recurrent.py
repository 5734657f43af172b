"""KDA token by token: the definition every other path must equal."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .contract import run_kda


def recurrent_sequence(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, state: Tensor
) -> tuple[Tensor, Tensor]:
    """One sequence of one value head, token by token. State ``S`` is ``[K, V]`` (K-first)::

        S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
        o_t = S_t^T (scale * q_t)

    computed as the step ``S <- Diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T``.

    q, k, g: ``[L, K]``; v: ``[L, V]``; beta: ``[L]``; state: ``[K, V]``. Returns (o ``[L, V]``, state).
    """
    o = v.new_empty(v.shape)
    for t in range(v.shape[0]):
        state = state * torch.exp(g[t])[:, None]
        state = state + beta[t] * torch.outer(k[t], v[t] - state.T @ k[t])
        o[t] = state.T @ (scale * q[t])
    return o, state


def recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | Sequence[int] | None = None,
    state_v_first: bool | None = None,
    state_cache: Tensor | None = None,
    state_indices: Tensor | None = None,
    has_initial_state: Tensor | None = None,
    state_dtype: torch.dtype | None = None,
    out: Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
    allow_float64: bool = False,
    num_accepted_tokens: Tensor | None = None,
    checkpoint_every: int | None = None,
    checkpoint_indices: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The KDA oracle: the exact recurrence, token by token, in ``compute_dtype`` (float64 by default).

    Per value head ``j`` (q/k head ``j // (HV // H)``), with state ``S`` ``[K, V]`` and each token t::

        S <- Diag(exp(g_t)) S
        S <- S + beta_t k_t (v_t - S^T k_t)^T
        o_t = S^T (scale * q_t)                      scale defaults to K ** -0.5

    Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``.
    Sequences: ``B`` dense rows, or varlen with ``B == 1`` and ``cu_seqlens`` ``[N + 1]`` (empty
    sequences legal; their final state is their initial state; rows past ``cu_seqlens[-1] <= T`` are
    zero). State: zeros; dense ``initial_state`` ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
    ``state_v_first``); or the paged pool ``state_cache`` ``[slots, HV, K, V]`` / ``[slots, HV, V, K]``
    (``state_v_first`` stated) with int32 ``state_indices`` (``< 0``: padding, zero output, no read or
    write) and ``has_initial_state`` (false: start from zeros without reading the slot), written in place.
    In-kernel options (l2norm of q, k; sigmoid of beta; the gate from raw ``g`` with ``A_log``, ``dt_bias``,
    ``lower_bound``) are applied first, in ``compute_dtype``: see ``prepare_inputs``.

    Speculative verify (vLLM's spec-decode convention): ``state_indices`` ``[N, T_max]`` stores the state
    after token ``j`` of sequence ``n`` in slot ``state_indices[n, j]`` (``< 0``: not kept), and
    ``num_accepted_tokens`` ``[N]`` (optional, values ``1 .. T_max``) makes sequence ``n`` start from slot
    ``state_indices[n, num_accepted_tokens[n] - 1]`` (the state after its last accepted draft) instead of
    ``state_indices[n, 0]``; that read slot ``< 0`` marks a padding sequence. ``has_initial_state[n]``
    false still means zeros, no read. A verify call equals its tokens decoded one call at a time: the
    carried state is rounded to the pool's dtype after every token, as each call's store would. The
    defaults (1-D ``state_indices``, no ``num_accepted_tokens``) are the plain paged contract above.

    Returns ``(o, final_state)``:

    - ``o``: ``[B, T, HV, V]`` in ``compute_dtype``, the exact answer (not rounded to v's dtype). With
      ``out=``, o is copied into ``out`` (in out's dtype) and ``out`` is returned.
    - ``final_state``: None unless ``output_final_state`` (dense contract; always None for the paged
      one). Layout per ``state_v_first``; dtype ``initial_state.dtype`` if given, else ``state_dtype``
      (default float32). The value is rounded (``.to(dtype)``, round to nearest even) once, on store, like
      the kernels' fp32 accumulation; with ``allow_float64=True``, ``state_dtype=torch.float64`` keeps it
      exact. Paged slots are rounded to ``state_cache.dtype`` the same way.

    The arguments are checked by ``kda``'s own rules, so this accepts and rejects exactly what
    ``kda.fused_recurrent_kda`` does (``allow_float64=True``, the oracle's exact mode, adds float64 inputs and
    states), and it always checks the device values ``kda`` checks under ``KDA_DEBUG=1``; see
    ``kda_reference.contract``. ``checkpoint_every`` and ``checkpoint_indices`` store the state at
    every ``checkpoint_every`` tokens of a sequence into pool slots (prefix-cache checkpoints; the module
    doc of ``kda_reference.contract``).
    """
    return run_kda(
        recurrent_sequence, "fused_recurrent_kda", q, k, v, g, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        state_v_first=state_v_first, state_cache=state_cache, state_indices=state_indices,
        has_initial_state=has_initial_state, state_dtype=state_dtype, out=out,
        compute_dtype=compute_dtype, allow_float64=allow_float64, num_accepted_tokens=num_accepted_tokens,
        checkpoint_every=checkpoint_every, checkpoint_indices=checkpoint_indices,
    )
