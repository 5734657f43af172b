"""Properties of the float64 oracle `kda_reference`, each checked independently of the oracle's own code.

Every expected value here is computed in the test from the math (hand-worked numbers, closed forms,
linear algebra identities) or from another call of the public API with a different contract that must
agree (varlen vs separate calls, paged vs dense). Nothing imports the oracle's private helpers.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from helpers import oracle_inputs, poisoned_pool, rel_err, state_plane
from hypothesis import given, settings
from hypothesis import strategies as st

import kda_reference
from kda_reference import kda_gate, l2norm

F64 = torch.float64
# The oracle's exact mode: these properties are checked on float64 inputs and states, which `kda` (and so the
# oracle by default) refuses (tests/test_oracle_agreement.py checks the default).
recurrent_kda = functools.partial(kda_reference.recurrent_kda, allow_float64=True)
chunk_kda = functools.partial(kda_reference.chunk_kda, allow_float64=True)

# The recurrence, the default chunk form, and a chunk length that puts chunk boundaries everywhere.
PATHS = pytest.mark.parametrize(
    "kda",
    [recurrent_kda, chunk_kda, functools.partial(chunk_kda, chunk_size=3)],
    ids=["recurrent", "chunk64", "chunk3"],
)


def random_state(N, HV, K, V, seed=1, dtype=F64):
    return torch.randn(N, HV, K, V, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# Hand-computed steps
# ---------------------------------------------------------------------------------------------------


@PATHS
@pytest.mark.parametrize("state_v_first", [False, True])
def test_one_step_by_hand(kda, state_v_first):
    S0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=F64)  # [K, V]
    g = torch.tensor([math.log(0.5), 0.0], dtype=F64)
    k = torch.tensor([0.6, 0.8], dtype=F64)
    v = torch.tensor([1.0, -1.0], dtype=F64)
    q = torch.tensor([1.0, 2.0], dtype=F64)
    beta, scale = 0.5, 0.5
    # decayed S = [[0.5, 1], [3, 4]];  S^T k = [0.3 + 2.4, 0.6 + 3.2] = [2.7, 3.8]
    # beta (v - S^T k) = 0.5 * [-1.7, -4.8] = [-0.85, -2.4];  k times it = [[-0.51, -1.44], [-0.68, -1.92]]
    S1 = torch.tensor([[-0.01, -0.44], [2.32, 2.08]], dtype=F64)
    # o = S1^T (0.5 q) = S1^T [0.5, 1] = [-0.005 + 2.32, -0.22 + 2.08]
    o1 = torch.tensor([2.315, 1.86], dtype=F64)

    initial = S0.T if state_v_first else S0
    o, final = kda(
        q.view(1, 1, 1, 2), k.view(1, 1, 1, 2), v.view(1, 1, 1, 2), g.view(1, 1, 1, 2),
        torch.tensor([[[beta]]], dtype=F64), scale, initial.reshape(1, 1, 2, 2).contiguous(), True,
        state_v_first=state_v_first,
    )
    assert final.dtype == F64
    torch.testing.assert_close(o.view(2), o1, rtol=0, atol=1e-14)
    torch.testing.assert_close(final.view(2, 2), S1.T if state_v_first else S1, rtol=0, atol=1e-14)


@PATHS
def test_two_steps_by_hand_from_zero_with_default_scale(kda):
    # t=1: from S=0 (the gate has nothing to decay): S1 = 1 * [1, 0]^T [2, 3] = [[2, 3], [0, 0]]
    #      o1 = S1^T [1, 1] / sqrt(2) = [2, 3] / sqrt(2)
    # t=2: decay rows by [1/4, 1/2]: [[0.5, 0.75], [0, 0]];  S^T k2 = S^T [0, 1] = [0, 0]
    #      S2 = S + 0.5 [0, 1]^T ([1, 1] - 0) = [[0.5, 0.75], [0.5, 0.5]]
    #      o2 = S2^T [2, 0] / sqrt(2) = [1, 1.5] / sqrt(2)
    q = torch.tensor([[1.0, 1.0], [2.0, 0.0]], dtype=F64).view(1, 2, 1, 2)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=F64).view(1, 2, 1, 2)
    v = torch.tensor([[2.0, 3.0], [1.0, 1.0]], dtype=F64).view(1, 2, 1, 2)
    g = torch.tensor([[-3.0, -7.0], [math.log(0.25), math.log(0.5)]], dtype=F64).view(1, 2, 1, 2)
    beta = torch.tensor([1.0, 0.5], dtype=F64).view(1, 2, 1)
    o, final = kda(q, k, v, g, beta, output_final_state=True, state_dtype=F64)
    r2 = 2.0**-0.5
    torch.testing.assert_close(o.view(2, 2), torch.tensor([[2 * r2, 3 * r2], [r2, 1.5 * r2]], dtype=F64),
                               rtol=0, atol=1e-14)
    torch.testing.assert_close(final.view(2, 2), torch.tensor([[0.5, 0.75], [0.5, 0.5]], dtype=F64),
                               rtol=0, atol=1e-14)


# ---------------------------------------------------------------------------------------------------
# Closed forms and algebraic properties
# ---------------------------------------------------------------------------------------------------


@PATHS
def test_beta_zero_is_pure_decay(kda):
    B, T, H, HV, K, V = 2, 13, 1, 2, 4, 3
    q, k, v, g, _ = oracle_inputs(B, T, H, HV, K, V)
    beta = torch.zeros(B, T, HV, dtype=F64)
    S0 = random_state(B, HV, K, V)
    scale = 0.7
    o, final = kda(q, k, v, g, beta, scale, S0, True)
    # S_t = Diag(exp(g_1 + ... + g_t)) S0 per K row; o_t = S_t^T (scale q_t).
    decay_to_t = torch.exp(torch.cumsum(g, dim=1))  # [B, T, HV, K]
    S_t = S0[:, None] * decay_to_t[..., None]  # [B, T, HV, K, V]
    o_expected = torch.einsum("bthkv,bthk->bthv", S_t, scale * q.expand(B, T, HV, K))
    torch.testing.assert_close(final, S0 * torch.exp(g.sum(dim=1))[..., None], rtol=1e-13, atol=0)
    torch.testing.assert_close(o, o_expected, rtol=1e-12, atol=1e-14)


@PATHS
@pytest.mark.parametrize("T", [5, 8])
def test_orthonormal_keys_with_beta_one_store_values_exactly(kda, T):
    K, V = 8, 5
    gen = torch.Generator().manual_seed(3)
    orthogonal, _ = torch.linalg.qr(torch.randn(K, K, generator=gen, dtype=F64))
    keys = orthogonal[:T]  # orthonormal rows
    q = torch.randn(1, T, 1, K, generator=gen, dtype=F64)
    v = torch.randn(1, T, 1, V, generator=gen, dtype=F64)
    g = torch.zeros(1, T, 1, K, dtype=F64)
    beta = torch.ones(1, T, 1, dtype=F64)
    S0 = random_state(1, 1, K, V, seed=4)  # whatever was stored before is overwritten along each k_t
    _, final = kda(q, keys.contiguous().view(1, T, 1, K), v, g, beta, None, S0, True)
    recalled = keys @ final[0, 0]  # row t = (S^T k_t)^T
    torch.testing.assert_close(recalled, v[0, :, 0], rtol=0, atol=1e-13)


@PATHS
@pytest.mark.parametrize("a", [0.3, -1.7])
def test_initial_state_to_final_state_is_affine(kda, a):
    B, T, H, HV, K, V = 2, 9, 1, 2, 5, 4
    q, k, v, g, beta = oracle_inputs(B, T, H, HV, K, V, seed=5)
    S1, S2 = random_state(B, HV, K, V, seed=6), random_state(B, HV, K, V, seed=7)

    def f(S):
        return kda(q, k, v, g, beta, None, S, True)

    o_mix, final_mix = f(a * S1 + (1 - a) * S2)
    (o1, final1), (o2, final2) = f(S1), f(S2)
    assert rel_err(final_mix, a * final1 + (1 - a) * final2) < 1e-13
    assert rel_err(o_mix, a * o1 + (1 - a) * o2) < 1e-13


# ---------------------------------------------------------------------------------------------------
# Sequences: varlen, empty sequences
# ---------------------------------------------------------------------------------------------------


def check_varlen_equals_separate_calls(kda, bounds, state_v_first=False, seed=8):
    T, H, HV, K, V = bounds[-1], 1, 2, 3, 4
    N = len(bounds) - 1
    q, k, v, g, beta = oracle_inputs(1, T, H, HV, K, V, seed=seed)
    initial = random_state(N, HV, K, V, seed=seed + 1, dtype=torch.float32)
    if state_v_first:
        initial = initial.transpose(-1, -2).contiguous()
    cu = torch.tensor(bounds, dtype=torch.int32)
    o, final = kda(q, k, v, g, beta, None, initial, True, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(),
                   state_v_first=state_v_first)
    assert o.shape == (1, T, HV, V) and final.shape == initial.shape and final.dtype == torch.float32
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        span = slice(start, end)
        o_n, final_n = kda(q[:, span], k[:, span], v[:, span], g[:, span], beta[:, span], None,
                           initial[n : n + 1], True, state_v_first=state_v_first)
        torch.testing.assert_close(o[:, span], o_n, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(final[n : n + 1], final_n, rtol=0, atol=0)
        if start == end:  # an empty sequence hands its initial state back untouched
            assert torch.equal(final[n].view(torch.int32), initial[n].view(torch.int32))


@PATHS
@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize(
    "bounds",
    [[0, 7], [0, 3, 7, 10], [0, 0, 3, 3, 3, 7, 10, 10], [0, 0], [0, 0, 0, 0], [0]],
    ids=["one", "three", "empty-lead-middle-trail", "one-empty", "all-empty", "no-sequence"],
)
def test_varlen_equals_separate_calls(kda, bounds, state_v_first):
    check_varlen_equals_separate_calls(kda, bounds, state_v_first)


@PATHS
def test_host_bounds_as_a_list(kda):
    """`cu_seqlens_cpu` as `kda` takes it: a CPU tensor, a list or a tuple of ints, the same answer bit for bit;
    other values than cu_seqlens' are rejected in any form."""
    bounds = [0, 1, 4, 4, 9]
    q, k, v, g, beta = oracle_inputs(1, bounds[-1], 1, 2, 3, 4, seed=3)
    cu = torch.tensor(bounds, dtype=torch.int32)
    runs = [kda(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=host)[0]
            for host in (cu.clone(), list(bounds), tuple(bounds))]
    assert all(torch.equal(runs[0], o) for o in runs[1:])
    for host in ([0, 1, 4, 5, 9], (0, 1, 4, 4), torch.tensor([0, 1, 4, 4, 8])):
        with pytest.raises(ValueError, match="cu_seqlens_cpu"):
            kda(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=host)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_varlen_equals_separate_calls_random_splits(lengths, seed):
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    check_varlen_equals_separate_calls(functools.partial(chunk_kda, chunk_size=4), bounds, seed=seed)


def test_all_empty_without_initial_state_gives_zero_states():
    q, k, v, g, beta = oracle_inputs(1, 0, 1, 2, 3, 4)
    o, final = recurrent_kda(q, k, v, g, beta, output_final_state=True,
                             cu_seqlens=torch.tensor([0, 0, 0], dtype=torch.int64))
    assert o.shape == (1, 0, 2, 4)
    assert final.shape == (2, 2, 3, 4) and final.dtype == torch.float32
    assert torch.equal(final, torch.zeros_like(final))


def test_dense_batch_equals_separate_rows():
    B, T, H, HV, K, V = 3, 11, 1, 2, 3, 4
    q, k, v, g, beta = oracle_inputs(B, T, H, HV, K, V, seed=9)
    S0 = random_state(B, HV, K, V, seed=10)
    o, final = recurrent_kda(q, k, v, g, beta, None, S0, True)
    for b in range(B):
        row = slice(b, b + 1)
        o_b, final_b = recurrent_kda(q[row], k[row], v[row], g[row], beta[row], None, S0[row], True)
        assert torch.equal(o[row], o_b) and torch.equal(final[row], final_b)


# ---------------------------------------------------------------------------------------------------
# Paged state
# ---------------------------------------------------------------------------------------------------

INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
            torch.float16: torch.int16}


@PATHS
@pytest.mark.parametrize("state_v_first", [True, False])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_paged_equals_gather_dense_scatter(kda, state_v_first, pool_dtype):
    bounds = [0, 4, 4, 9, 12, 17]  # five sequences, the second one empty
    T, H, HV, K, V, slots = bounds[-1], 1, 2, 3, 4, 9
    q, k, v, g, beta = oracle_inputs(1, T, H, HV, K, V, seed=11)
    cu = torch.tensor(bounds, dtype=torch.int32)
    slot_of_seq = torch.tensor([6, 2, -1, 0, 7], dtype=torch.int32)  # permuted; sequence 2 is padding
    has_initial_state = torch.tensor([True, True, True, False, True])  # slot 0 (NaN) must not be read
    storage, pool = poisoned_pool(slots, state_plane(HV, K, V, state_v_first), pool_dtype, pad=5)
    live = random_state(5, HV, V, K, seed=12) if state_v_first else random_state(5, HV, K, V, seed=12)
    live = live.to(pool_dtype)
    for n, slot in enumerate(slot_of_seq.tolist()):
        if slot >= 0 and has_initial_state[n]:
            pool[slot] = live[n]
    before = storage.clone()

    o, final = kda(q, k, v, g, beta, cu_seqlens=cu, state_cache=pool, state_indices=slot_of_seq,
                   has_initial_state=has_initial_state, state_v_first=state_v_first)
    assert final is None

    # The same thing by hand: gather the initial states, one dense call, scatter the finals.
    gathered = torch.zeros_like(live)
    for n, slot in enumerate(slot_of_seq.tolist()):
        if slot >= 0 and has_initial_state[n]:
            gathered[n] = before[slot, : HV * K * V].view(live.shape[1:])
    o_dense, final_dense = kda(q, k, v, g, beta, None, gathered, True, cu_seqlens=cu,
                               state_v_first=state_v_first)
    expected_storage = before.clone()
    for n, slot in enumerate(slot_of_seq.tolist()):
        if slot >= 0:
            expected_storage[slot, : HV * K * V] = final_dense[n].flatten()
    o_dense[:, bounds[2] : bounds[3]] = 0  # padding sequence: zero output rows

    assert torch.equal(o, o_dense)
    ints = INT_VIEW[pool_dtype]
    # Written slots hold the dense answer; every other slot, and the pad between slots, keeps its bits.
    assert torch.equal(storage.view(ints), expected_storage.view(ints))
    assert not torch.isnan(o).any()


@PATHS
def test_has_initial_state_false_on_nan_slot_equals_zero_start(kda):
    T, H, HV, K, V = 6, 1, 2, 3, 4
    q, k, v, g, beta = oracle_inputs(1, T, H, HV, K, V, seed=13)
    _, pool = poisoned_pool(2, state_plane(HV, K, V, True), torch.float32, pad=5)  # slot 0 is NaN
    o, _ = kda(q, k, v, g, beta, state_cache=pool, state_indices=torch.tensor([0], dtype=torch.int32),
               has_initial_state=torch.tensor([False]), state_v_first=True)
    o_zero, final_zero = kda(q, k, v, g, beta, output_final_state=True, state_v_first=True)
    assert torch.equal(o, o_zero)
    assert torch.equal(pool[0], final_zero[0])


def test_padding_sequence_zeroes_its_rows_of_out():
    T, H, HV, K, V = 5, 1, 2, 3, 4
    q, k, v, g, beta = oracle_inputs(1, T, H, HV, K, V, seed=14)
    _, pool = poisoned_pool(3, state_plane(HV, K, V, True), torch.float32, pad=5)
    out = torch.full((1, T, HV, V), float("nan"), dtype=F64)  # v's dtype
    result, final = recurrent_kda(
        q, k, v, g, beta, cu_seqlens=torch.tensor([0, 2, 5]), out=out, state_cache=pool,
        state_indices=torch.tensor([-1, 1], dtype=torch.int32),
        has_initial_state=torch.tensor([True, False]), state_v_first=True,
    )
    assert result is out and final is None
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))
    assert not torch.isnan(out).any()
    assert torch.isnan(pool[0]).all() and torch.isnan(pool[2]).all()  # slots not named: untouched


# ---------------------------------------------------------------------------------------------------
# State storage dtype and out=
# ---------------------------------------------------------------------------------------------------


@PATHS
@pytest.mark.parametrize("storage_dtype", [torch.bfloat16, torch.float16])
def test_narrow_state_is_the_float64_answer_rounded_once(kda, storage_dtype):
    B, T, H, HV, K, V = 2, 10, 1, 2, 3, 4
    q, k, v, g, beta = oracle_inputs(B, T, H, HV, K, V, seed=15)
    o_exact, final_exact = kda(q, k, v, g, beta, output_final_state=True, state_dtype=F64)
    _, final = kda(q, k, v, g, beta, output_final_state=True, state_dtype=storage_dtype)
    assert final.dtype == storage_dtype
    assert torch.equal(final, final_exact.to(storage_dtype))

    S0 = random_state(B, HV, K, V, seed=16).to(storage_dtype)  # a narrow initial state is upcast on load
    o_exact, final_exact = kda(q, k, v, g, beta, None, S0.to(F64), True)
    o, final = kda(q, k, v, g, beta, None, S0, True)
    assert final.dtype == storage_dtype and o.dtype == F64
    assert torch.equal(final, final_exact.to(storage_dtype))
    assert torch.equal(o, o_exact)


def test_default_state_dtype_is_float32_and_out_gets_o_rounded():
    q, k, v, g, beta = oracle_inputs(1, 4, 1, 1, 2, 3, seed=17, dtype=torch.bfloat16)
    o, final = recurrent_kda(q, k, v, g, beta, output_final_state=True)
    assert o.dtype == F64 and final.dtype == torch.float32
    out = torch.empty(1, 4, 1, 3, dtype=torch.bfloat16)  # v's dtype, as kda requires
    result, no_state = recurrent_kda(q, k, v, g, beta, out=out)
    assert result is out and no_state is None
    assert torch.equal(out, o.to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------------
# In-kernel options and GVA
# ---------------------------------------------------------------------------------------------------


@PATHS
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("bias_layout", ["flat", "2d", "none"])
def test_in_kernel_options_equal_preprocessing_by_hand(kda, lower_bound, bias_layout):
    B, T, H, HV, K, V = 1, 9, 1, 2, 3, 4
    gen = torch.Generator().manual_seed(18)
    q = torch.randn(B, T, H, K, generator=gen, dtype=F64) * 3
    k = torch.randn(B, T, H, K, generator=gen, dtype=F64) * 3
    v = torch.randn(B, T, HV, V, generator=gen, dtype=F64)
    raw_g = torch.randn(B, T, HV, K, generator=gen, dtype=F64) * 3
    raw_beta = torch.randn(B, T, HV, generator=gen, dtype=F64) * 2
    A_log = torch.randn(HV, generator=gen, dtype=F64)
    bias = torch.randn(HV, K, generator=gen, dtype=F64)
    dt_bias = {"flat": bias.flatten(), "2d": bias, "none": None}[bias_layout]

    # By hand: q, k / sqrt(sum(x^2) + 1e-6); beta = 1 / (1 + exp(-beta));
    # g = -exp(A_log[h]) log(1 + exp(g + dt_bias[h])) or lb / (1 + exp(-exp(A_log[h]) (g + dt_bias[h]))).
    q_hand = q / torch.sqrt((q**2).sum(-1, keepdim=True) + 1e-6)
    k_hand = k / torch.sqrt((k**2).sum(-1, keepdim=True) + 1e-6)
    beta_hand = 1 / (1 + torch.exp(-raw_beta))
    x = raw_g + (bias if dt_bias is not None else 0)
    rate = torch.exp(A_log)[:, None]
    if lower_bound is None:
        g_hand = -rate * torch.log1p(torch.exp(x))
    else:
        g_hand = lower_bound / (1 + torch.exp(-rate * x))

    o, final = kda(q, k, v, raw_g, raw_beta, output_final_state=True, state_dtype=F64,
                   use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                   A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    o_hand, final_hand = kda(q_hand, k_hand, v, g_hand, beta_hand, output_final_state=True, state_dtype=F64)
    assert rel_err(o, o_hand) < 1e-13 and rel_err(final, final_hand) < 1e-13


def test_gate_and_l2norm_helpers():
    # softplus must neither overflow for large inputs nor lose the tiny tail for very negative ones.
    g = torch.tensor([[[-1000.0, -30.0, 0.0, 30.0, 1000.0]]], dtype=F64)  # [1, HV=1, K=5]
    gate = kda_gate(g)
    assert torch.isfinite(gate).all()
    tail = math.log1p(math.exp(-30.0))
    expected = torch.tensor([-tail, -math.log(2.0), -(30.0 + tail)], dtype=F64)
    torch.testing.assert_close(gate[0, 0, 1:4], expected, rtol=1e-15, atol=0)
    assert gate[0, 0, 4].item() == -1000.0 and -1e-300 <= gate[0, 0, 0].item() <= 0.0
    A_log = torch.tensor([math.log(3.0)], dtype=F64)
    bounded = kda_gate(g, A_log=A_log, lower_bound=-5.0)
    assert bounded[0, 0, 2].item() == pytest.approx(-2.5, abs=1e-15)  # lb * sigmoid(0)
    assert bounded[0, 0, 4].item() == -5.0 and bounded[0, 0, 0].item() == 0.0
    torch.testing.assert_close(l2norm(torch.tensor([3.0, 4.0], dtype=F64), eps=0.0),
                               torch.tensor([0.6, 0.8], dtype=F64), rtol=0, atol=1e-16)


@PATHS
def test_gva_equals_repeating_qk_heads(kda):
    B, T, H, HV, K, V = 2, 7, 2, 4, 3, 4
    q, k, v, g, beta = oracle_inputs(B, T, H, HV, K, V, seed=19)
    S0 = random_state(B, HV, K, V, seed=20)
    o, final = kda(q, k, v, g, beta, None, S0, True)
    # value head j reads q/k head j // (HV // H): heads 0, 1 -> 0 and 2, 3 -> 1
    q_rep, k_rep = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    o_rep, final_rep = kda(q_rep, k_rep, v, g, beta, None, S0, True)
    assert torch.equal(o, o_rep) and torch.equal(final, final_rep)


# ---------------------------------------------------------------------------------------------------
# chunk_kda == recurrent_kda
# ---------------------------------------------------------------------------------------------------


def assert_chunk_equals_recurrent(q, k, v, g, beta, chunk_size, **contract):
    o_r, final_r = recurrent_kda(q, k, v, g, beta, **contract)
    o_c, final_c = chunk_kda(q, k, v, g, beta, chunk_size=chunk_size, **contract)
    assert torch.isfinite(o_c).all()
    assert rel_err(o_c, o_r) < 1e-12
    if final_r is not None:
        assert torch.isfinite(final_c).all()
        assert rel_err(final_c, final_r) < 1e-12


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("T", [1, 63, 65, 200])
def test_chunk_equals_recurrent(T, chunk_size):
    q, k, v, g, beta = oracle_inputs(1, T, 1, 2, 16, 8, seed=T)
    S0 = random_state(1, 2, 16, 8, seed=21)
    assert_chunk_equals_recurrent(q, k, v, g, beta, chunk_size, initial_state=S0, output_final_state=True)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_equals_recurrent_under_strong_decay(chunk_size):
    T, HV, K, V = 100, 2, 8, 4
    q, k, v, g, beta = oracle_inputs(1, T, 1, HV, K, V, seed=22)
    g[:, 5:60, 0, :3] = -1000.0  # a long run: the in-chunk cumulative sum reaches -64000
    g[:, 70, 1, :] = -1000.0  # one token wipes every channel of head 1
    g[:, 80:90:2, :, 5] = -1000.0
    S0 = random_state(1, HV, K, V, seed=23)
    assert_chunk_equals_recurrent(q, k, v, g, beta, chunk_size, initial_state=S0, output_final_state=True)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_equals_recurrent_with_correlated_keys_and_beta_near_one(chunk_size):
    T, HV, K, V = 130, 1, 32, 8
    gen = torch.Generator().manual_seed(24)
    base = torch.randn(K, generator=gen, dtype=F64)
    k = base + 0.01 * torch.randn(1, T, 1, K, generator=gen, dtype=F64)
    k = k / k.norm(dim=-1, keepdim=True)  # nearly the same key every token: A_kk entries close to 1
    q = torch.randn(1, T, 1, K, generator=gen, dtype=F64)
    v = torch.randn(1, T, HV, V, generator=gen, dtype=F64)
    g = torch.full((1, T, HV, K), -0.01, dtype=F64)
    beta = torch.full((1, T, HV), 0.99, dtype=F64)
    assert_chunk_equals_recurrent(q, k, v, g, beta, chunk_size, output_final_state=True, state_dtype=F64)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_equals_recurrent_varlen_with_empty_sequences(chunk_size):
    bounds = [0, 0, 70, 70, 71, 136, 200, 200]
    T, HV, K, V = bounds[-1], 2, 8, 4
    q, k, v, g, beta = oracle_inputs(1, T, 1, HV, K, V, seed=25)
    S0 = random_state(len(bounds) - 1, HV, V, K, seed=26)
    assert_chunk_equals_recurrent(q, k, v, g, beta, chunk_size, initial_state=S0, output_final_state=True,
                                  cu_seqlens=torch.tensor(bounds), state_v_first=True)


def test_chunk_equals_recurrent_paged():
    bounds = [0, 40, 40, 107]
    T, HV, K, V = bounds[-1], 2, 8, 4
    q, k, v, g, beta = oracle_inputs(1, T, 1, HV, K, V, seed=27)
    _, pool_r = poisoned_pool(4, state_plane(HV, K, V, True), F64, pad=5)
    pool_r[3] = random_state(1, HV, V, K, seed=28)[0]
    storage_c, pool_c = poisoned_pool(4, state_plane(HV, K, V, True), F64, pad=5)
    pool_c.copy_(pool_r)
    contract = dict(cu_seqlens=torch.tensor(bounds), state_v_first=True,
                    state_indices=torch.tensor([3, 1, 0], dtype=torch.int32),
                    has_initial_state=torch.tensor([True, True, False]))
    o_r, _ = recurrent_kda(q, k, v, g, beta, state_cache=pool_r, **contract)
    o_c, _ = chunk_kda(q, k, v, g, beta, state_cache=pool_c, chunk_size=16, **contract)
    assert rel_err(o_c, o_r) < 1e-12
    for slot in (0, 3):
        assert rel_err(pool_c[slot], pool_r[slot]) < 1e-12
    assert torch.isnan(pool_c[2]).all()  # not named: untouched
    assert torch.equal(pool_c[1], pool_r[1]) and (pool_c[1] == 1e30).all()  # empty sequence: kept


# ---------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------


def _bad_calls():
    B, T, H, HV, K, V = 1, 4, 1, 2, 3, 4
    q, k, v, g, beta = oracle_inputs(B, T, H, HV, K, V)
    _, pool = poisoned_pool(3, state_plane(HV, K, V, True), torch.float32, pad=5)
    idx = torch.tensor([0], dtype=torch.int32)
    S0 = random_state(1, HV, K, V)
    two = oracle_inputs(2, T, H, HV, K, V)
    return [
        ("initial_state", dict(initial_state=S0, state_cache=pool, state_indices=idx, state_v_first=True)),
        ("cu_seqlens", dict(inputs=two, cu_seqlens=torch.tensor([0, 4]))),
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 5]))),  # past T (short of T is legal: trailing rows)
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 3, 2, 4]))),
        ("cu_seqlens_cpu", dict(cu_seqlens=torch.tensor([0, 4]), cu_seqlens_cpu=torch.tensor([0, 3]))),
        ("q", dict(inputs=(q[0], k, v, g, beta))),
        ("k", dict(inputs=(q, k[..., :2], v, g, beta))),
        ("g", dict(inputs=(q, k, v, g[..., :2], beta))),
        ("beta", dict(inputs=(q, k, v, g, beta[..., :1]))),
        ("HV", dict(inputs=oracle_inputs(B, T, 2, 3, K, V))),
        ("initial_state", dict(initial_state=S0.transpose(-1, -2))),
        ("state_indices", dict(state_indices=idx)),
        ("has_initial_state", dict(has_initial_state=torch.tensor([True]))),
        ("state_indices", dict(state_cache=pool, state_v_first=True)),
        ("state_indices", dict(state_cache=pool, state_indices=torch.tensor([3], dtype=torch.int32),
                               has_initial_state=torch.tensor([True]), state_v_first=True)),
        ("state_indices", dict(inputs=two, state_cache=pool, state_v_first=True,
                               state_indices=torch.tensor([1, 1], dtype=torch.int32),
                               has_initial_state=torch.tensor([True, True]))),
        ("state_indices", dict(state_cache=pool, state_indices=torch.tensor([0]),  # int64
                               has_initial_state=torch.tensor([True]), state_v_first=True)),
        ("state_v_first", dict(state_cache=pool, state_indices=idx, has_initial_state=torch.tensor([True]))),
        ("has_initial_state", dict(state_cache=pool, state_indices=idx, state_v_first=True,
                                   has_initial_state=torch.tensor([1]))),
        ("state_cache", dict(state_cache=pool, state_indices=idx, state_v_first=False)),
        ("output_final_state", dict(state_cache=pool, state_indices=idx, state_v_first=True,
                                    output_final_state=True)),
        ("state_dtype", dict(initial_state=S0, state_dtype=torch.float32)),
        ("dt_bias", dict(dt_bias=torch.zeros(HV * K))),
        ("dt_bias", dict(use_gate_in_kernel=True, dt_bias=torch.zeros(HV * K + 1))),
        ("A_log", dict(use_gate_in_kernel=True, A_log=torch.zeros(HV + 1))),
        ("lower_bound", dict(use_gate_in_kernel=True, lower_bound=1.0)),
        ("out", dict(out=torch.empty(B, T, HV, V + 1))),
        ("out", dict(inputs=(q, k, v, g, beta), out=v)),
    ]


BAD_CALLS = _bad_calls()


@pytest.mark.parametrize("kda", [recurrent_kda, chunk_kda], ids=["recurrent", "chunk"])
@pytest.mark.parametrize("argument, call", BAD_CALLS, ids=[f"{a}-{i}" for i, (a, _) in enumerate(BAD_CALLS)])
def test_bad_input_raises_naming_the_argument(kda, argument, call):
    call = dict(call)
    inputs = call.pop("inputs", None) or oracle_inputs(1, 4, 1, 2, 3, 4)
    pool = call.get("state_cache")
    pool_bits = None if pool is None else pool.clone().view(torch.int32)
    with pytest.raises((ValueError, TypeError), match=argument):
        kda(*inputs, **call)
    if pool is not None:  # nothing was written before the error
        assert torch.equal(pool.view(torch.int32), pool_bits)


@pytest.mark.parametrize("kda", [recurrent_kda, chunk_kda], ids=["recurrent", "chunk"])
def test_unknown_keyword_and_positional_out_are_type_errors(kda):
    inputs = oracle_inputs(1, 4, 1, 2, 3, 4)
    with pytest.raises(TypeError):
        kda(*inputs, use_qk_l2norm=True)
    with pytest.raises(TypeError):
        kda(*inputs, None, None, False, torch.empty(1, 4, 2, 4))


def test_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(*oracle_inputs(1, 4, 1, 2, 3, 4), chunk_size=0)


def _checkpoint_call(fn, lengths, every, ckpt, pool_dtype=torch.float32, seed=3):
    """A paged call over sequences of `lengths` with checkpoints; returns (pool after, pool before, inputs)."""
    N, H, HV, K, V = len(lengths), 1, 2, 8, 4
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    q, k, v, g, beta = oracle_inputs(1, bounds[-1], H, HV, K, V, seed=seed)
    slots = 12
    gen = torch.Generator().manual_seed(seed)
    pool = (torch.randn(slots, HV, K, V, generator=gen, dtype=torch.float64)).to(pool_dtype)
    before = pool.clone()
    kw = dict(state_cache=pool, state_indices=torch.arange(N, dtype=torch.int32), state_v_first=False,
              has_initial_state=torch.ones(N, dtype=torch.bool), cu_seqlens=torch.tensor(bounds),
              checkpoint_every=every, checkpoint_indices=torch.tensor(ckpt, dtype=torch.int32))
    fn(q, k, v, g, beta, **kw)
    return pool, before, (q, k, v, g, beta, bounds)


@pytest.mark.parametrize("fn", [recurrent_kda, chunk_kda], ids=["recurrent", "chunk"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_checkpoints_equal_the_state_of_the_call_cut_there(fn, pool_dtype):
    """Sequences of 200, 0 and 128 tokens, a checkpoint every 64: each checkpoint slot holds the final state
    of the same sequence cut after that many tokens (stored once in the pool's dtype); a checkpoint at a
    sequence's end equals its final state; slots no one names keep their bits; the final states do not
    change with checkpoints."""
    lengths, every = [200, 0, 128], 64
    ckpt = [[4, -1, 5, 11], [6, 7, -1, -1], [8, 9, 10, -1]]  # 0 reaches 3 and skips its second; 1 none; 2 two
    pool, before, (q, k, v, g, beta, bounds) = _checkpoint_call(fn, lengths, every, ckpt, pool_dtype)
    plain = before.clone()
    fn(q, k, v, g, beta, state_cache=plain, state_indices=torch.arange(3, dtype=torch.int32), state_v_first=False,
       has_initial_state=torch.ones(3, dtype=torch.bool), cu_seqlens=torch.tensor(bounds))
    assert torch.equal(pool[:3], plain[:3])
    for n, row in enumerate(ckpt):
        for c, slot in enumerate(row[: lengths[n] // every]):
            if slot < 0:
                continue
            cut = bounds[n] + (c + 1) * every
            _, s = fn(q[:, bounds[n]:cut], k[:, bounds[n]:cut], v[:, bounds[n]:cut], g[:, bounds[n]:cut],
                      beta[:, bounds[n]:cut], initial_state=before[n:n + 1].double(), output_final_state=True,
                      state_dtype=torch.float64)
            assert torch.equal(pool[slot], s[0].to(pool_dtype)), (n, c)
    assert torch.equal(pool[2], pool[9])  # sequence 2's checkpoint at its end (128) is its final state
    for slot in (3, 6, 7, 10, 11):  # named by no sequence, or by checkpoints past a sequence's end
        assert torch.equal(pool[slot], before[slot])


def test_checkpoints_of_the_two_oracles_agree():
    lengths, every, ckpt = [130, 256], 128, [[5, 6], [7, 8]]
    a, _, _ = _checkpoint_call(recurrent_kda, lengths, every, ckpt, torch.float64)
    b, _, _ = _checkpoint_call(chunk_kda, lengths, every, ckpt, torch.float64)
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("over,word", [
    (dict(checkpoint_every=100), "checkpoint_every"),
    (dict(checkpoint_every=None), "checkpoint_every"),
    (dict(checkpoint_indices=torch.tensor([[5], [6]])), "checkpoint_indices"),  # int64 is fine, shape [N]
    (dict(checkpoint_indices=torch.tensor([[5.0], [6.0], [7.0]])), "checkpoint_indices"),
    (dict(checkpoint_indices=torch.tensor([[5], [5], [7]], dtype=torch.int32)), "checkpoint_indices"),
    (dict(checkpoint_indices=torch.tensor([[0], [6], [7]], dtype=torch.int32)), "checkpoint_indices"),  # a final slot
    (dict(checkpoint_indices=torch.tensor([[12], [6], [7]], dtype=torch.int32)), "checkpoint_indices"),
])
def test_bad_checkpoints_raise_naming_the_argument(over, word):
    q, k, v, g, beta = oracle_inputs(1, 192, 1, 2, 8, 4)
    pool = torch.zeros(12, 2, 8, 4, dtype=torch.float64)
    kw = dict(state_cache=pool, state_indices=torch.arange(3, dtype=torch.int32), state_v_first=False,
              has_initial_state=torch.ones(3, dtype=torch.bool), cu_seqlens=torch.tensor([0, 64, 128, 192]),
              checkpoint_every=64, checkpoint_indices=torch.tensor([[5], [6], [7]], dtype=torch.int32))
    kw.update(over)
    with pytest.raises((ValueError, TypeError), match=word):  # kda's types: a float checkpoint_indices is a TypeError
        chunk_kda(q, k, v, g, beta, **kw)
    assert torch.equal(pool, torch.zeros_like(pool))
