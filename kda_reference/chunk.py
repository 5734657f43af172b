"""KDA in the chunked WY/UT form that the Triton kernels implement, written to be read."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from .contract import run_kda


def chunk_sequence(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, state: Tensor,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """One sequence of one value head, ``chunk_size`` tokens at a time (the last chunk may be shorter).

    Within a chunk of C tokens, ``b_i = g_1 + ... + g_i`` (inclusive cumulative sum, per channel), and
    with ``S`` the state entering the chunk, ``[K, V]``::

        A_kk[i, j] = beta_i * sum_c k_ic k_jc exp(b_ic - b_jc)           j < i   (strictly lower)
        A_qk[i, j] = scale  * sum_c q_ic k_jc exp(b_ic - b_jc)           j <= i
        INV = (I + A_kk)^-1                                               forward substitution
        W   = INV Diag(beta) (exp(b) * K)          U0 = INV Diag(beta) V
        U   = U0 - W S
        O   = (scale * exp(b) * Q) S + A_qk U
        S  <- Diag(exp(b_C)) S + (exp(b_C - b) * K)^T U

    Derivation. Write token i's update as ``S_i = Diag(exp(g_i)) S_{i-1} + k_i u_i^T`` with
    ``u_i = beta_i (v_i - S_{i-1}^T Diag(exp(g_i)) k_i)``. Unrolled from the chunk start,
    ``S_i = Diag(exp(b_i)) S + sum_{j<=i} Diag(exp(b_i - b_j)) k_j u_j^T``. Putting ``S_{i-1}`` into
    ``u_i`` gives ``u_i + sum_{j<i} A_kk[i, j] u_j = beta_i (v_i - S^T (exp(b_i) * k_i))``, i.e.
    ``(I + A_kk) U = Diag(beta) (V - (exp(b) * K) S)``, so ``U = U0 - W S``. Then ``o_i = S_i^T scale q_i``
    is row i of O, and ``S_C`` is the state update.

    The decay between tokens is formed pairwise, ``exp(b_i - b_j) <= 1`` for ``j <= i``, never as
    ``exp(b_i) * exp(-b_j)``: a log-decay of -1000 per token underflows to 0 and never reaches inf/NaN.
    """
    o = v.new_empty(v.shape)
    for start in range(0, v.shape[0], chunk_size):
        end = min(start + chunk_size, v.shape[0])
        o[start:end], state = _chunk_step(
            q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], scale, state
        )
    return o, state


def _chunk_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, S: Tensor
) -> tuple[Tensor, Tensor]:
    """One chunk: the equations of ``chunk_sequence``. Returns (O ``[C, V]``, the state after the chunk)."""
    C = v.shape[0]
    b = torch.cumsum(g, dim=0)  # [C, K]
    on_or_below_diagonal = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()  # j <= i
    # decay[i, j, c] = exp(b_ic - b_jc) for j <= i, 0 for j > i (masked before exp, so never exp(+big)).
    log_decay = (b[:, None, :] - b[None, :, :]).masked_fill(~on_or_below_diagonal[:, :, None], -torch.inf)
    decay = torch.exp(log_decay)  # [C, C, K]

    A_kk = (beta[:, None] * (k[:, None, :] * k[None, :, :] * decay).sum(-1)).tril(-1)
    A_qk = scale * (q[:, None, :] * k[None, :, :] * decay).sum(-1)  # lower triangular through decay

    eye = torch.eye(C, dtype=v.dtype, device=v.device)
    INV = torch.linalg.solve_triangular(eye + A_kk, eye, upper=False, unitriangular=True)
    W = INV @ (beta[:, None] * torch.exp(b) * k)  # [C, K]
    U0 = INV @ (beta[:, None] * v)  # [C, V]

    U = U0 - W @ S
    O = (scale * torch.exp(b) * q) @ S + A_qk @ U
    b_last = b[-1]
    S = torch.exp(b_last)[:, None] * S + (torch.exp(b_last - b) * k).T @ U
    return O, S


def chunk_kda(
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
    chunk_size: int = 64,
    checkpoint_every: int | None = None,
    checkpoint_indices: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """KDA in the chunked form (``chunk_sequence``), with exactly the contract of ``recurrent_kda``.

    Same arguments, same return values and rounding decisions as ``recurrent_kda``, and the checks of
    ``kda.chunk_kda`` (``has_initial_state`` required with a pool; no verify); only the
    per-sequence math differs: each sequence is processed ``chunk_size`` tokens at a time with the WY/UT
    equations of ``chunk_sequence``; per chunk, with ``b`` the in-chunk cumulative log-decay::

        U = INV Diag(beta) (V - (exp(b) * K) S)                  INV = (I + A_kk)^-1
        O = (scale * exp(b) * Q) S + A_qk U
        S <- Diag(exp(b_C)) S + (exp(b_C - b) * K)^T U

    In float64 it equals ``recurrent_kda`` to about 1e-14 relative. ``chunk_size`` (default 64) is the
    chunk length C; any C >= 1 gives the same answer up to rounding. Prefix-cache checkpoints
    (``checkpoint_every``, ``checkpoint_indices``) as in ``recurrent_kda``.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return run_kda(
        functools.partial(chunk_sequence, chunk_size=chunk_size), "chunk_kda",
        q, k, v, g, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        state_v_first=state_v_first, state_cache=state_cache, state_indices=state_indices,
        has_initial_state=has_initial_state, state_dtype=state_dtype, out=out,
        compute_dtype=compute_dtype, allow_float64=allow_float64, checkpoint_every=checkpoint_every,
        checkpoint_indices=checkpoint_indices,
    )
