"""Property-based checks: random valid serving layouts for both functions against the
float64 oracle. Hypothesis draws the sequence lengths (zeros included), which slots of a poisoned pool the
sequences take (a permutation, with padding sequences), `has_initial_state`, the pool's dtype and layout,
the GVA ratio and K, V (powers of two and not). Every real output row equals the oracle's, every written
slot equals the oracle's final state (to the storage's rounding), padding rows are zero, and every slot
that no sequence names keeps its bits. Bounded to fit CI: derandomized, a fixed number of examples.
The dense and no-state contracts run on a grid instead: every input dtype beside every state dtype, both
layouts, fixed varlen layouts (one token a sequence among them)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from helpers import bits, bounds_of, make_inputs, on_cpu, poison_pool, rel_err, rounding_floor
from hypothesis import given, settings
from hypothesis import strategies as st

import kda
import kda_reference as ref

FP32_TOL = 1e-5


@st.composite
def serving_layouts(draw, max_len):
    H = draw(st.sampled_from([1, 2]))
    HV = H * draw(st.sampled_from([1, 2]))
    K = draw(st.sampled_from([8, 16, 24]))
    V = draw(st.sampled_from([8, 16, 20]))
    lengths = draw(st.lists(st.integers(0, max_len), min_size=1, max_size=4))
    N = len(lengths)
    slots = N + draw(st.integers(0, 3))
    order = draw(st.permutations(range(slots)))
    padding = draw(st.lists(st.booleans(), min_size=N, max_size=N))
    idx = [-1 if pad else order[n] for n, pad in enumerate(padding)]
    has = draw(st.lists(st.booleans(), min_size=N, max_size=N))
    storage = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    v_first = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return H, HV, K, V, lengths, slots, idx, has, storage, v_first, seed


def _check_paged_call(fn, layout):
    H, HV, K, V, lengths, slots, idx, has, storage, v_first, seed = layout
    bounds = bounds_of(lengths)
    T = bounds[-1]
    q, k, v, g, beta, kw = make_inputs(1, T, H, HV, K, V, seed=seed, device=DEVICE)
    plane = (HV, V, K) if v_first else (HV, K, V)
    pool = poison_pool(slots, plane, storage, DEVICE)
    gen = torch.Generator().manual_seed(seed + 1)
    for n, slot in enumerate(idx):  # live slots that will be read hold a real state
        if slot >= 0 and has[n]:
            pool[slot] = torch.randn(plane, generator=gen).to(storage).to(DEVICE)
    before = pool.clone()
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    state_kw = dict(state_cache=pool, state_indices=torch.tensor(idx, dtype=torch.int32, device=DEVICE),
                    has_initial_state=torch.tensor(has, device=DEVICE), state_v_first=v_first, cu_seqlens=cu)
    o, _ = fn(q, k, v, g, beta, **state_kw, **kw)

    ref_pool = before.cpu().clone()
    ro, _ = ref.recurrent_kda(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(),
                             **{**on_cpu(state_kw), "state_cache": ref_pool}, **on_cpu(kw))
    for n, slot in enumerate(idx):
        rows = slice(bounds[n], bounds[n + 1])
        if slot < 0:
            assert torch.equal(o[:, rows].cpu(), torch.zeros_like(o[:, rows].cpu()))
            continue
        assert rel_err(o[:, rows], ro[:, rows]) < FP32_TOL
        tol = FP32_TOL if storage == torch.float32 else torch.finfo(storage).eps
        assert rel_err(pool[slot], ref_pool[slot]) <= tol
    named = {s for s in idx if s >= 0}
    for slot in range(slots):
        if slot not in named:
            assert torch.equal(bits(pool[slot]), bits(before[slot]))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(layout=serving_layouts(max_len=80))
def test_chunk_kda_on_random_serving_layouts(layout):
    _check_paged_call(kda.chunk_kda, layout)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(layout=serving_layouts(max_len=5))
def test_fused_recurrent_kda_on_random_serving_layouts(layout):
    _check_paged_call(kda.fused_recurrent_kda, layout)


# (H, HV, K, V, lengths, host bounds, seed) for the dense and no-state contracts: GVA, K and V not powers of two,
# an empty sequence, a sequence past one chunk; and one token a sequence with host bounds (the one-token forms)
DENSE_LAYOUTS = [(1, 2, 24, 20, [70, 0, 9], True, 3), (2, 2, 16, 16, [0, 66, 3], False, 4)]
DECODE_LAYOUTS = [(1, 2, 24, 20, [1, 1, 1], True, 5), (2, 4, 16, 12, [1, 1], True, 6),
                  (1, 2, 24, 20, [3, 0, 5], False, 7), (2, 2, 8, 20, [2, 1, 0, 4], True, 8)]


def _check_dense_call(fn, layout, contract, storage, in_dtype, v_first):
    """Output and final state against the oracle (its output exact, its state rounded once to the storage), the
    inputs' and the state's dtypes apart."""
    H, HV, K, V, lengths, host_bounds, seed = layout
    bounds = bounds_of(lengths)
    q, k, v, g, beta, kw = make_inputs(1, bounds[-1], H, HV, K, V, dtype=in_dtype, seed=seed, device=DEVICE)
    plane = (HV, V, K) if v_first else (HV, K, V)
    kw.update(cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=DEVICE), state_v_first=v_first,
              output_final_state=True)
    if host_bounds:
        kw["cu_seqlens_cpu"] = torch.tensor(bounds, dtype=torch.int32)
    if contract == "dense":
        gen = torch.Generator().manual_seed(seed + 1)
        kw["initial_state"] = torch.randn(len(lengths), *plane, generator=gen).to(storage).to(DEVICE)
    else:
        kw["state_dtype"] = storage
    o, s = fn(q, k, v, g, beta, **kw)
    ro, rs = ref.recurrent_kda(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), **on_cpu(kw))

    assert o.dtype == in_dtype and s.dtype == storage
    # on a GPU the chunk kernels take tf32 dots for 16-bit inputs (`kda.plan.dot_precision`): operands rounded to
    # fp16's 11 bits in at most eight places (the prepare's A_kk, A_qk, inverse and folds, the walk's four dots),
    # each adding at most fp16's rounding floor; the interpreter's dots are exact
    tf32 = fn is kda.chunk_kda and DEVICE != "cpu" and in_dtype != torch.float32
    slack = 8 * rounding_floor(ro, torch.float16) if tf32 and bounds[-1] else 0.0
    if bounds[-1]:
        assert rel_err(o, ro) <= FP32_TOL + (in_dtype != torch.float32) * 2 * rounding_floor(ro, in_dtype) + slack
    if storage == torch.float32:
        assert rel_err(s, rs) <= FP32_TOL + slack
    elif tf32:  # rounded apart at most an ulp an element, beside the tf32 error of what was rounded
        assert rel_err(s, rs) <= torch.finfo(storage).eps + slack
    else:  # both rounded once to the storage: an ulp apart at most where they round apart
        a, b = s.double().cpu(), rs.double()
        assert ((a - b).abs() <= torch.finfo(storage).eps * torch.maximum(a.abs(), b.abs())
                + FP32_TOL * b.abs().max()).all()


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def dtype_grid(test):
    """Every contract x state dtype x input dtype x layout."""
    for mark in (pytest.mark.parametrize("contract", ["dense", "none"]),
                 pytest.mark.parametrize("storage", DTYPES, ids=["fp32", "bf16", "fp16"]),
                 pytest.mark.parametrize("in_dtype", DTYPES, ids=["in_fp32", "in_bf16", "in_fp16"]),
                 pytest.mark.parametrize("v_first", [True, False], ids=["v_first", "k_first"])):
        test = mark(test)
    return test


@pytest.mark.parametrize("layout", DENSE_LAYOUTS, ids=["gva-host-bounds", "device-bounds"])
@dtype_grid
def test_chunk_kda_dense_contracts(layout, contract, storage, in_dtype, v_first):
    _check_dense_call(kda.chunk_kda, layout, contract, storage, in_dtype, v_first)


@pytest.mark.parametrize("layout", DECODE_LAYOUTS, ids=["one-token", "one-token-gva", "lengths", "lengths-host"])
@dtype_grid
def test_fused_recurrent_kda_dense_contracts(layout, contract, storage, in_dtype, v_first):
    _check_dense_call(kda.fused_recurrent_kda, layout, contract, storage, in_dtype, v_first)
