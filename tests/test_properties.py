"""Property-based checks: random valid serving layouts for both functions against the
float64 oracle. Hypothesis draws the sequence lengths (zeros included), which slots of a poisoned pool the
sequences take (a permutation, with padding sequences), `has_initial_state`, the pool's dtype and layout,
the GVA ratio and K, V (powers of two and not). Every real output row equals the oracle's, every written
slot equals the oracle's final state (to the storage's rounding), padding rows are zero, and every slot
that no sequence names keeps its bits. Bounded to fit CI: derandomized, a fixed number of examples."""

from __future__ import annotations

import torch
from conftest import DEVICE
from helpers import bits, bounds_of, make_inputs, on_cpu, poison_pool, rel_err
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
