"""The one helpers module of the tests: input makers, poisoned pools, error measures, bit comparisons."""

from __future__ import annotations

import itertools

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


def bounds_of(lengths) -> list[int]:
    """Varlen bounds (`cu_seqlens` as a host list) of these sequence lengths: 0 and their running sums."""
    return [0, *itertools.accumulate(lengths)]


def make_inputs(B, T, H, HV, K, V, *, dtype=torch.float32, gate="logdecay", device="cpu", seed=0,
                normalize_k=True, beta_logits=False, beta_sigmoid=False, lower_bound=-5.0, decay=0.5):
    """Random KDA inputs, the one maker of the kernel and oracle tests. Returns (q, k, v, g, beta, gate_kwargs).

    q, k, v in `dtype`; g and beta in fp32 (float64 when `dtype` is float64, for the oracle's exactness
    tests). gate: "logdecay" (alias "none": g in (-decay, 0] passed directly), "softplus" or "lower_bound"
    (raw gate input for the in-kernel gate, with A_log and dt_bias; `lower_bound` is the bound).
    `normalize_k`: unit keys. `beta_logits`: beta drawn as logits; `beta_sigmoid`: the same and the
    `use_beta_sigmoid_in_kernel=True` flag in gate_kwargs. Without either, beta in [0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    if normalize_k:
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    if beta_logits or beta_sigmoid:
        beta = torch.randn(B, T, HV, generator=gen)
    else:
        beta = torch.rand(B, T, HV, generator=gen)
    kw = {}
    if gate in ("logdecay", "none"):
        g = -torch.rand(B, T, HV, K, generator=gen) * decay
    else:
        g = torch.randn(B, T, HV, K, generator=gen)
        kw = dict(use_gate_in_kernel=True, A_log=torch.randn(HV, generator=gen) * 0.5,
                  dt_bias=torch.randn(HV * K, generator=gen) * 0.5)
        if gate == "lower_bound":
            kw["lower_bound"] = lower_bound
    if beta_sigmoid:
        kw["use_beta_sigmoid_in_kernel"] = True
    side = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = (x.to(device, dtype) for x in (q, k, v))
    g, beta = g.to(device, side), beta.to(device, side)
    kw = {n: (x.to(device, side) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    return q, k, v, g, beta, kw


def oracle_inputs(B, T, H, HV, K, V, seed=0, dtype=torch.float64):
    """`make_inputs` for the float64 oracle tests: unit keys, beta in (0, 1), log-decay in (-1, 0]; the five
    tensors only."""
    return make_inputs(B, T, H, HV, K, V, dtype=dtype, seed=seed, decay=1.0)[:5]


def rounding_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """The error of the exact answer rounded to `dtype`: no output stored in `dtype` can do better."""
    return rel_err(ref.to(dtype), ref)


def state_plane(HV, K, V, v_first: bool) -> tuple[int, int, int]:
    """One sequence's (or slot's) state plane: [HV, V, K] V-first, [HV, K, V] K-first."""
    return (HV, V, K) if v_first else (HV, K, V)


def poisoned_pool(slots, plane, dtype, device="cpu", pad=0):
    """A state pool whose every slot holds NaN (even slots) or 1e30 (odd; 6e4 in fp16): unread and
    unwritten slots must keep these bits. `pad` extra elements per slot make stride(0) larger than the
    plane (a padded pool). Returns (storage [slots, plane + pad], pool [slots, *plane], a view of it)."""
    numel = plane[0] * plane[1] * plane[2]
    storage = torch.empty(slots, numel + pad, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    storage[0::2] = float("nan")
    storage[1::2] = 6e4 if dtype == torch.float16 else 1e30
    storage = storage.to(dtype).to(device)
    pool = storage[:, :numel].view(slots, *plane)
    assert pool.stride(0) == numel + pad
    return storage, pool


def poison_pool(slots, plane, dtype, device, pad=0):
    """`poisoned_pool`'s pool alone."""
    return poisoned_pool(slots, plane, dtype, device, pad)[1]


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


def checked_call(fn, q, k, v, g, beta, **kwargs):
    """The validated call (`kda.contract.KDACall`) that `fn` (`kda.chunk_kda` or `kda.fused_recurrent_kda`)
    makes of these arguments: what `kda.plan` builds a plan from."""
    from kda.api import check_call_args
    from kda.contract import check_call

    positional, keywords = check_call_args(fn, q, k, v, g, beta, **kwargs)
    return check_call(*positional, **keywords)


def run_planned(fn, q, k, v, g, beta, plan_overrides: dict, **kwargs):
    """`fn`'s call run through a plan built with `plan_overrides` (tests reach a path this way, never by
    rewriting module globals). Returns (o, final_state, plan)."""
    import kda
    from kda.plan import decode_plan, prefill_plan

    call = checked_call(fn, q, k, v, g, beta, **kwargs)
    if fn is kda.chunk_kda:
        from kda.ops.chunk import chunk_kda_fwd

        plan, route = prefill_plan(call, **plan_overrides)
        return (*chunk_kda_fwd(call, plan, route), plan)
    sr = kwargs.get("stochastic_rounding", False)
    plan = decode_plan(call, sr, **plan_overrides)
    from kda.ops.fused_recurrent import fused_recurrent_kda_fwd

    return (*fused_recurrent_kda_fwd(call, plan, seed=kwargs.get("seed", 0)), plan)


def run_chunk(call, **plan_overrides):
    """`kda.ops.chunk.chunk_kda_fwd` of a validated call under its plan, with `plan_overrides`: (o, final_state)."""
    from kda.ops.chunk import chunk_kda_fwd
    from kda.plan import prefill_plan

    return chunk_kda_fwd(call, *prefill_plan(call, **plan_overrides))


def run_decode(call, **plan_overrides):
    """`kda.ops.fused_recurrent.fused_recurrent_kda_fwd` of a validated call under its plan: (o, final_state)."""
    from kda.ops.fused_recurrent import fused_recurrent_kda_fwd
    from kda.plan import decode_plan

    return fused_recurrent_kda_fwd(call, decode_plan(call, **plan_overrides))
