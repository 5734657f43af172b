"""The cheap host path keeps every check and every result.

Validation runs fast conditions first and names the argument only once one fails; plans are cached on what
determines them; host bounds are checked with C-level passes. Each test here states what such shortcuts
could break: a fast condition that disagrees with the check it stands for, a cached plan reused where
another shape, dtype, layout or stride needs another, a good call that lets a later bad one through.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import triton
from conftest import DEVICE
from helpers import checked_call, make_inputs, poisoned_pool, rel_err, same_bits, state_plane

import kda
import kda_reference as ref
from kda import contract, plan

FP32_TOL = 1e-5


def test_plain_cdiv_and_next_power_of_2_equal_tritons():
    for n in range(0, 4100):
        assert plan.next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 2, 3, 16, 64, 128):
            assert plan.cdiv(n, d) == triton.cdiv(n, d)


def test_interpreted_is_the_environment_at_first_use():
    assert plan.interpreted() == contract.interpreting()


@pytest.mark.parametrize("bounds", [
    [0, 2, 2, 7], (0, 1, 2, 3), [0, True, 2], [0.0, 2.0, 7.0], [0, 2.9, 7], ["0", "3", "7"], range(4),
    torch.tensor([0, 3, 3, 7]), torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0.0, 2.5, 7.0]),
])
def test_host_bounds_equal_the_int_conversion(bounds):
    """The fast path (int entries summed in C, no per-entry conversion) gives what converting each entry
    with int() gives, for every accepted input kind."""
    entries = bounds.tolist() if isinstance(bounds, torch.Tensor) else bounds
    assert contract.host_bounds_list(bounds) == [int(x) for x in entries]


@pytest.mark.parametrize("bounds", [[0, 2, "x"], [0, None, 2], 5, [[0, 1]], torch.tensor(3)])
def test_host_bounds_that_are_not_ints_raise_naming_the_argument(bounds):
    with pytest.raises((TypeError, ValueError), match="cu_seqlens_cpu|int"):
        contract.host_bounds_list(bounds)


def _strided(shape, strides, offset=0):
    """A view of a fresh buffer with exactly these strides."""
    need = offset + 1 + sum((s - 1) * st for s, st in zip(shape, strides))
    return torch.zeros(need, device=DEVICE).as_strided(shape, strides, offset)


def test_fast_token_layout_condition_equals_the_check_it_stands_for():
    """`_bad_token_layout` (one stride() tuple, no exception) fails exactly where `_check_token_layout`
    raises, over batch, token, head and last-dimension strides."""
    checked = 0
    for B, T, last in itertools.product((1, 2), (1, 3), (1, 4)):
        for s0, s1, s2, s3 in itertools.product((T * 8 * last, T * 8 * last + 5, 1), (8 * last, 7, 1),
                                                (last, 2 * last), (1, 2)):
            x = _strided((B, T, 2, last), (s0, s1, s2, s3))
            try:
                contract._check_token_layout("x", x, B, T)
                raised = False
            except ValueError:
                raised = True
            assert contract._bad_token_layout(x.stride(), last, B, T) == raised, (B, T, x.shape, x.stride())
            beta = x[..., 0]
            try:
                contract._check_token_layout("beta", beta, B, T, last_unit=False)
                raised = False
            except ValueError:
                raised = True
            assert contract._bad_token_layout(beta.stride(), 1, B, T) == raised
            checked += 1
    assert checked == 2 * 2 * 2 * 3 * 3 * 2 * 2


def _dense_call(fn, **over):
    q, k, v, g, beta, _ = make_inputs(1, 4, 1, 2, 8, 8, seed=7, device=DEVICE)
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    args.update(over)
    pos = [args.pop(n) for n in ("q", "k", "v", "g", "beta")]
    return fn(*pos, **args)


@pytest.mark.parametrize("fn", [kda.chunk_kda, kda.fused_recurrent_kda], ids=["chunk", "recurrent"])
def test_a_bad_call_after_good_ones_at_the_same_shapes_still_raises(fn):
    """Nothing learnt from good calls lets a bad one through: after two good calls, a call at the same
    shapes with one bad argument raises naming it and leaves `out` unwritten."""
    for _ in range(2):
        _dense_call(fn)
    q, k, v, g, beta, _ = make_inputs(1, 4, 1, 2, 8, 8, seed=7, device=DEVICE)
    wide_q = torch.zeros(1, 4, 1, 16, device=DEVICE)[..., ::2]  # stride 2 in the last dimension
    wide_q.copy_(q)
    bad = [
        (dict(q=wide_q), "q"),
        (dict(g=g.to(torch.float64)), "g"),
        (dict(beta=beta[..., :1]), "beta"),
        (dict(scale=True), "scale"),
        (dict(state_v_first=1), "state_v_first"),
        (dict(initial_state=torch.zeros(2, 2, 8, 8, device=DEVICE)), "initial_state"),
        (dict(cu_seqlens=torch.tensor([0, 1, 2, 4], device=DEVICE), cu_seqlens_cpu=[0, 3, 2, 4]), "cu_seqlens_cpu"),
        # bounds 0, 1, ..., N take the one-token shortcut only when they end at T; past T they raise
        (dict(cu_seqlens=torch.arange(6, device=DEVICE), cu_seqlens_cpu=[0, 1, 2, 3, 4, 5]), "cu_seqlens_cpu"),
    ]
    for over, word in bad:
        out = torch.full((1, 4, 2, 8), 7.0, device=DEVICE)
        with pytest.raises((ValueError, TypeError), match=word):
            _dense_call(fn, out=out, **over)
        assert torch.equal(out, torch.full_like(out, 7.0)), f"a failed call ({word}) wrote out"


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "the state"])
def test_out_overlapping_any_input_or_the_state_is_refused_and_adjacent_is_not(name):
    """Every tensor is carved out of one flat buffer; `out` overlapping the named one by a single element
    (at its first or its last byte) raises naming it; `out` right after it (touching, not overlapping) is
    accepted."""
    B, T, H, HV, K, V = 1, 3, 1, 1, 4, 4
    shapes = {"q": (B, T, H, K), "k": (B, T, H, K), "v": (B, T, HV, V), "g": (B, T, HV, K),
              "beta": (B, T, HV), "the state": (B, HV, K, V)}
    sizes = {n: torch.Size(s).numel() for n, s in shapes.items()}
    n_out = B * T * HV * V
    gap = n_out + 2
    flat = torch.zeros(sum(sizes.values()) + gap * (len(sizes) + 1), device=DEVICE)
    offsets, pos = {}, gap
    for n in shapes:
        offsets[n] = pos
        pos += sizes[n] + gap
    views = {n: flat[offsets[n]:offsets[n] + sizes[n]].view(shapes[n]) for n in shapes}
    for n, x in zip(("q", "k", "v", "g", "beta"), make_inputs(B, T, H, HV, K, V, seed=3, device=DEVICE)):
        views[n].copy_(x)
    args = [views[n] for n in ("q", "k", "v", "g", "beta")]
    end = offsets[name] + sizes[name]
    for start in (offsets[name] - n_out + 1, end - 1):
        out = flat[start:start + n_out].view(B, T, HV, V)
        with pytest.raises(ValueError, match=f"out overlaps {name}"):
            kda.fused_recurrent_kda(*args, None, views["the state"], True, out=out)
    out = flat[end:end + n_out].view(B, T, HV, V)
    o, _ = kda.fused_recurrent_kda(*args, None, views["the state"], True, out=out)
    assert o is out


def test_decode_plans_follow_dtype_layout_and_host_bounds_in_any_order():
    """The cached decode plan is keyed on what determines it: asked in turn for an fp32 V-first pool, a
    bf16 one, a K-first one and a varlen batch without host bounds, each gets its own plan, the same as
    asked first."""
    H, HV, K, V, N = 1, 2, 16, 32, 3
    q, k, v, g, beta, _ = make_inputs(N, 1, H, HV, K, V, seed=4, device=DEVICE)
    calls = {}
    for dtype, vf in ((torch.float32, True), (torch.bfloat16, True), (torch.float32, False)):
        pool = torch.zeros(N, *state_plane(HV, K, V, vf), dtype=dtype, device=DEVICE)
        idx = torch.arange(N, dtype=torch.int32, device=DEVICE)
        calls[(dtype, vf)] = checked_call(kda.fused_recurrent_kda, q, k, v, g, beta, state_cache=pool,
                                          state_indices=idx, state_v_first=vf)
    flat = [x.transpose(0, 1) for x in (q, k, v, g, beta)]  # [1, N, ...]: varlen, no host bounds
    calls["varlen"] = checked_call(kda.fused_recurrent_kda, *flat, state_cache=pool, state_indices=idx,
                                   state_v_first=False,
                                   cu_seqlens=torch.arange(N + 1, dtype=torch.int32, device=DEVICE))
    first = {key: plan.decode_plan(c) for key, c in calls.items()}
    for key in reversed(list(calls)):
        assert plan.decode_plan(calls[key]) == first[key]
    assert first[(torch.float32, True)].BV == 16 and first[(torch.bfloat16, True)].BV == 8
    assert first[(torch.float32, True)].nsub == 1 and first[(torch.bfloat16, True)].nsub == 4
    assert first[(torch.float32, False)].nsub == 1 and first[(torch.float32, False)].BV == 32  # V = 32
    assert first["varlen"].nsub == 0
    assert plan.decode_plan(calls[(torch.bfloat16, True)], True).sr == 1
    assert plan.decode_plan(calls[(torch.bfloat16, True)]).sr == 0


def test_cached_plans_are_frozen_and_overrides_leave_them_alone():
    q, k, v, g, beta, kw = make_inputs(1, 5, 1, 1, 8, 8, gate="lower_bound", seed=5, device=DEVICE)
    call = checked_call(kda.chunk_kda, q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **kw)
    p = plan.chunk_plan(call)
    assert p.prepare == "fused"
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.fold = False
    assert plan.chunk_plan(call, prepare="split").prepare == "split"
    assert plan.chunk_plan(call) is p and p.prepare == "fused"
    # the GPU's walk beside the prepare: one cached object a shape too (p is already one on a GPU)
    alone = dataclasses.replace(p, wait_chunks=0, wait_in_loop=False, late_chunks=0)
    tune = plan.TUNINGS["sm90"]
    beside = plan._beside_plan(alone, True, tune)
    assert beside is plan._beside_plan(alone, True, tune) and beside.wait_chunks == tune.wait_chunks
    assert dataclasses.replace(beside, wait_chunks=0) == alone and alone.wait_chunks == 0
    unbounded = checked_call(kda.chunk_kda, q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                             **{**kw, "lower_bound": -6.0})
    assert plan.chunk_plan(unbounded).prepare == "split"  # the bound is part of the key


@pytest.mark.parametrize("fn", [kda.chunk_kda, kda.fused_recurrent_kda], ids=["chunk", "recurrent"])
def test_calls_that_differ_only_in_strides_each_equal_the_oracle(fn):
    """One shape and dtype, three layouts in a row (contiguous, q/k/v split out of a fused projection, a
    pool with padded slots, then contiguous again): whatever the first call cached, each call equals the
    oracle and the two contiguous calls give the same bits."""
    B, T, H, HV, K, V = 1, 6, 1, 2, 8, 8
    q, k, v, g, beta, kw = make_inputs(B, T, H, HV, K, V, gate="softplus", seed=6, device=DEVICE)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE)
    qkv = torch.cat([q, k, v], dim=2)  # one projection buffer (K == V)
    split = (qkv[:, :, :H], qkv[:, :, H:2 * H], qkv[:, :, 2 * H:])
    assert split[0].stride() != q.stride() and all(torch.equal(a, b) for a, b in zip(split, (q, k, v)))
    results = []
    for layout, pad in (("contiguous", 0), ("split", 0), ("padded pool", 5), ("contiguous", 0)):
        _, pool = poisoned_pool(3, state_plane(HV, K, V, True), torch.float32, DEVICE, pad=pad)
        pool[1] = 0.3
        pool[2] = -0.2
        pool_ref = pool.clone()
        qq, kk, vv = split if layout == "split" else (q, k, v)
        opts = dict(cu_seqlens=cu, state_v_first=True, state_indices=torch.tensor([2, 1], dtype=torch.int32,
                    device=DEVICE), has_initial_state=torch.tensor([True, True], device=DEVICE), **kw)
        o, _ = fn(qq, kk, vv, g, beta, state_cache=pool, **opts)
        o_ref, _ = ref.recurrent_kda(q, k, v, g, beta, state_cache=pool_ref, **opts)
        assert rel_err(o, o_ref) <= FP32_TOL, layout
        assert rel_err(pool[1:], pool_ref[1:]) <= FP32_TOL, layout
        assert torch.isnan(pool[0]).all(), layout  # the unnamed slot keeps its poison
        results.append((o, pool[1:].clone()))
    assert same_bits(results[0][0], results[3][0]) and same_bits(results[0][1], results[3][1])
