"""The optional in-kernel pre-processing of KDA, written as plain PyTorch.

Each function computes in the dtype of its main input; `prepare_inputs` upcasts first, so under the
oracle all of it runs in float64.
"""

from __future__ import annotations

import torch
from torch import Tensor


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """L2-normalise the last dimension: ``x / sqrt(sum(x^2, -1) + eps)``.

    This is the ``use_qk_l2norm_in_kernel`` normalisation of q and k, applied per head.
    """
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_gate(
    g: Tensor,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
) -> Tensor:
    """The KDA gate: the per-channel log-decay from the raw gate input ``g`` of shape ``[..., HV, K]``.

    With ``lower_bound=None``::

        g_out[..., h, c] = -exp(A_log[h]) * softplus(g[..., h, c] + dt_bias[h, c])

    with ``lower_bound=lb`` (lb < 0)::

        g_out[..., h, c] = lb * sigmoid(exp(A_log[h]) * (g[..., h, c] + dt_bias[h, c]))

    ``A_log`` is ``[HV]`` (None means ``exp(A_log) = 1``); ``dt_bias`` is ``[HV * K]`` or ``[HV, K]``
    (None means 0). Computed in ``g.dtype``. ``softplus(x) = log(1 + exp(x))`` is evaluated as
    ``logaddexp(x, 0)``, exact and stable for any finite x (no threshold cut-off as in the kernels, whose
    ``softplus(x) = x`` above 20 differs by at most ``exp(-20) = 2e-9``).
    """
    HV, K = g.shape[-2], g.shape[-1]
    x = g
    if dt_bias is not None:
        x = x + dt_bias.to(g.dtype).reshape(HV, K)
    rate = torch.ones(HV, 1, dtype=g.dtype, device=g.device)
    if A_log is not None:
        rate = torch.exp(A_log.to(g.dtype)).reshape(HV, 1)
    if lower_bound is None:
        return -rate * torch.logaddexp(x, torch.zeros_like(x))
    return lower_bound * torch.sigmoid(rate * x)


def prepare_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Upcast ``q, k, v, g, beta`` to ``compute_dtype``, then apply the requested in-kernel options.

        q, k <- l2norm(q), l2norm(k)                 if use_qk_l2norm_in_kernel
        beta <- sigmoid(beta)                        if use_beta_sigmoid_in_kernel
        g    <- kda_gate(g, A_log, dt_bias, lb)      if use_gate_in_kernel

    Returns the five tensors, in the same shapes, ready for the recurrence with every flag off.
    """
    q, k, v, g, beta = (x.to(compute_dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta)
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    return q, k, v, g, beta
