"""Fresh random inputs for every study, drawn on the CPU from a seeded generator (the same numbers on
every device), then moved to the device. q, k, v are drawn in fp32 and cast to the input dtype under
study; g and beta stay fp32. The oracle reads the same (cast) tensors, so an error never counts the
rounding of the inputs themselves: it is the kernel's error on the inputs it was given."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace

import torch

from .config import LOWER_BOUND, Regime


def generator(seed: int, label: str) -> torch.Generator:
    """One generator per (run seed, measurement label): a study's inputs do not depend on which other
    studies ran before it."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(label.encode())) % 2**63)


@dataclass
class Inputs:
    """q, k `[B, T, H, K]`; v `[B, T, HV, V]`; g `[B, T, HV, K]`; beta `[B, T, HV]`; and the in-kernel
    options the kernels and the oracle are called with."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    opts: dict = field(default_factory=dict)

    def args(self, tokens: slice = slice(None)) -> tuple:
        """(q, k, v, g, beta) of the given tokens: views, or contiguous copies when B > 1 and the view
        would not be one (the contract needs one stride along the flattened [B*T] token axis)."""
        xs = tuple(x[:, tokens] for x in (self.q, self.k, self.v, self.g, self.beta))
        if self.q.shape[0] > 1 and xs[0].shape[1] > 1:
            xs = tuple(x.contiguous() for x in xs)
        return xs

    def cast(self, dtype: torch.dtype) -> Inputs:
        return replace(self, q=self.q.to(dtype), k=self.k.to(dtype), v=self.v.to(dtype))

    def to(self, device: str) -> Inputs:
        opts = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in self.opts.items()}
        return Inputs(*(x.to(device) for x in (self.q, self.k, self.v, self.g, self.beta)), opts=opts)

    @property
    def T(self) -> int:
        return self.q.shape[1]


SERVING_OPTS = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def regime_inputs(regime: Regime, B, T, H, HV, K, V, gen: torch.Generator) -> Inputs:
    """Decay-regime inputs (docs/accuracy.md): q, k ~ N(0, 1) L2-normalised in the kernel, v ~ N(0, 1), the lower-bound
    gate g = -5 sigmoid(x) with x ~ N(gate_mean, 1), beta = sigmoid(N(beta_mean, 1)) in the kernel."""
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = regime.gate_mean + torch.randn(B, T, HV, K, generator=gen)
    beta = regime.beta_mean + torch.randn(B, T, HV, generator=gen)
    return Inputs(q, k, v, g, beta, dict(SERVING_OPTS, use_gate_in_kernel=True, lower_bound=LOWER_BOUND))


def gate_form_inputs(form: str, B, T, H, HV, K, V, gen: torch.Generator) -> Inputs:
    """The three gate forms of the contract, with q, k, v ~ N(0, 1) and beta = sigmoid(N(0, 1)):
    - "logdecay": g = -5 sigmoid(N(0, 1)) passed as the log-decay itself (no in-kernel gate);
    - "softplus": raw g ~ N(0, 1), g <- -exp(A_log) softplus(g + dt_bias) in the kernel;
    - "lower_bound": raw g ~ N(0, 1), g <- -5 sigmoid(exp(A_log) (g + dt_bias)) in the kernel.
    A_log, dt_bias ~ N(0, 0.5^2)."""
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, V, generator=gen)
    x = torch.randn(B, T, HV, K, generator=gen)
    beta = torch.randn(B, T, HV, generator=gen)
    opts = dict(SERVING_OPTS)
    if form == "logdecay":
        return Inputs(q, k, v, LOWER_BOUND * torch.sigmoid(x), beta, opts)
    opts.update(use_gate_in_kernel=True, A_log=0.5 * torch.randn(HV, generator=gen),
                dt_bias=0.5 * torch.randn(HV * K, generator=gen))
    if form == "lower_bound":
        opts["lower_bound"] = LOWER_BOUND
    elif form != "softplus":
        raise ValueError(f"unknown gate form {form!r}")
    return Inputs(q, k, v, x, beta, opts)


ADVERSARIAL_DOC = {
    "strong_decay": "lower-bound gate saturated: x ~ N(8, 1), g ~ -5 per token (in-chunk cumulative decay "
                    "reaches -320: overflows a naive exp(G) exp(-G) factorisation)",
    "extreme_decay": "log-decay passed directly, g ~ -U(0, 1000) per channel and token (underflow to 0)",
    "weak_decay": "x ~ N(-20, 1): g ~ -1e-8, practically no decay; the state accumulates every token",
    "correlated_keys": "k_t = k_0 + 0.02 N(0, 1) (cosine ~ 0.99 between all keys), beta = sigmoid(N(7, 0.5)) "
                       "~ 0.999, weak decay: (I + A_kk) is ill-conditioned",
    "large_values": "v ~ 1000 N(0, 1), strong regime gate",
}


def adversarial_inputs(case: str, B, T, H, HV, K, V, gen: torch.Generator) -> Inputs:
    """The adversarial cases of ADVERSARIAL_DOC."""
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, V, generator=gen)
    x = torch.randn(B, T, HV, K, generator=gen)
    beta = torch.randn(B, T, HV, generator=gen)
    lb = dict(SERVING_OPTS, use_gate_in_kernel=True, lower_bound=LOWER_BOUND)
    if case == "strong_decay":
        return Inputs(q, k, v, x + 8.0, beta, lb)
    if case == "extreme_decay":
        return Inputs(q, k, v, -1000.0 * torch.rand(B, T, HV, K, generator=gen), beta, dict(SERVING_OPTS))
    if case == "weak_decay":
        return Inputs(q, k, v, x - 20.0, beta, lb)
    if case == "correlated_keys":
        k = torch.randn(B, 1, H, K, generator=gen) + 0.02 * k
        return Inputs(q, k, v, x - 6.0, 7.0 + 0.5 * beta, lb)
    if case == "large_values":
        return Inputs(q, k, 1000.0 * v, x, beta, lb)
    raise ValueError(f"unknown adversarial case {case!r}")
