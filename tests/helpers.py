"""Input makers and error measures shared by the kernel tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ||x - ref|| / ||ref|| in float64 (0 when both are empty or zero)."""
    x, ref = x.double().cpu(), ref.double().cpu()
    den = ref.norm().item()
    num = (x - ref).norm().item()
    if den == 0.0:
        return num
    return num / den


def make_inputs(B, T, H, HV, K, V, *, dtype=torch.float32, gate="logdecay", device="cpu", seed=0,
                normalize_k=True, beta_logits=False):
    """Random KDA inputs. gate: "logdecay" (g <= 0 passed directly), "softplus" or "lower_bound" (raw gate
    input for the in-kernel gate, with A_log and dt_bias). Returns (q, k, v, g, beta, gate_kwargs)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    if normalize_k:
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    if beta_logits:
        beta = torch.randn(B, T, HV, generator=gen)
    else:
        beta = torch.rand(B, T, HV, generator=gen)
    kw = {}
    if gate == "logdecay":
        g = -torch.rand(B, T, HV, K, generator=gen) * 0.5
    else:
        g = torch.randn(B, T, HV, K, generator=gen)
        kw = dict(use_gate_in_kernel=True, A_log=torch.randn(HV, generator=gen) * 0.5,
                  dt_bias=torch.randn(HV * K, generator=gen) * 0.5)
        if gate == "lower_bound":
            kw["lower_bound"] = -5.0
    to = lambda x: x.to(device)
    q, k, v = (to(x.to(dtype)) for x in (q, k, v))
    g, beta = to(g), to(beta)
    kw = {n: (to(x) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    return q, k, v, g, beta, kw


def rounding_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """The error of the exact answer rounded to `dtype`: no output stored in `dtype` can do better."""
    return rel_err(ref.to(dtype), ref)


def poison_pool(slots, plane, dtype, device, pad=0):
    """A state pool whose every slot holds NaN or 1e30 (alternating): unread and unwritten slots must
    keep these bits. `pad` extra elements per slot make stride(0) larger than the plane."""
    numel = plane[0] * plane[1] * plane[2]
    big = torch.empty(slots, numel + pad, dtype=torch.float32)
    big[0::2] = float("nan")
    big[1::2] = 1e30 if dtype == torch.float32 else 6e4 if dtype == torch.float16 else 1e30
    big = big.to(dtype).to(device)
    return big[:, :numel].view(slots, *plane)


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, for bitwise comparison (NaN == NaN)."""
    itype = {4: torch.int32, 2: torch.int16, 8: torch.int64}[x.element_size()]
    return x.contiguous().view(itype).cpu()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN payloads included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def on_cpu(kwargs: dict) -> dict:
    """The same keyword arguments with every tensor moved to the CPU (for the oracle)."""
    return {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in kwargs.items()}
