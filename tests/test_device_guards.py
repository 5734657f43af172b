"""Device values the host does not read (no KDA_DEBUG on a GPU) are guarded in the kernels: varlen bounds
outside 0 <= bos <= eos <= T make that sequence a no-op, as a padding slot does, and no kernel touches memory
outside its tensors or another sequence's slot.

Each case validates a good call (`checked_call`: the host checks pass), then overwrites `cu_seqlens` on the
device with bad values before the launch, as an engine's bookkeeping bug would. Properties: the sequences whose
bounds stay valid give exactly the output rows and slots of the good call; the bad sequences write no output
row (the caller's `out`, filled with a sentinel, keeps it) and read or write no slot; every slot not named and
the storage past the pool keep their poison bits. On CPU the interpreter would also raise on an access out of
its tensors.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import bits, checked_call, make_inputs, poisoned_pool, run_chunk, run_decode

import kda

H, HV, K, V = 1, 2, 16, 16
BOUNDS = [0, 70, 140, 200]
SLOTS = [4, 1, 6]
SENTINEL = 7.0
# bad values written over cu_seqlens, and the sequences whose bounds they leave as they were
BAD = {
    "end past T": ([0, 70, 140, 999], [0, 1]),
    "negative": ([0, -64, 140, 200], [2]),
    "decreasing": ([0, 70, 140, 100], [0, 1]),
    "all past T": ([0, 300, 300, 300], []),
}


def _run(fn, bad, device, errors=None):
    T = BOUNDS[-1]
    q, k, v, g, beta, kw = make_inputs(1, T, H, HV, K, V, gate="lower_bound", device=device, seed=71)
    storage, pool = poisoned_pool(8, (HV, K, V), torch.float32, device, pad=4)
    for n, slot in enumerate(SLOTS):
        pool[slot] = torch.randn(HV, K, V, generator=torch.Generator().manual_seed(80 + n)).to(device)
    extra = dict(has_initial_state=torch.ones(3, dtype=torch.bool, device=device)) if fn is kda.chunk_kda else {}
    out = torch.full_like(v, SENTINEL)
    call = checked_call(fn, q, k, v, g, beta, cu_seqlens=torch.tensor(BOUNDS, dtype=torch.int32, device=device),
                        state_cache=pool, state_indices=torch.tensor(SLOTS, dtype=torch.int32, device=device),
                        state_v_first=False, use_qk_l2norm_in_kernel=True, out=out, errors=errors, **extra, **kw)
    if bad is not None:
        call = dataclasses.replace(call, cu_seqlens=torch.tensor(bad, dtype=torch.int32, device=device))
    if fn is kda.chunk_kda:
        run_chunk(call)
    else:
        run_decode(call)
    return out, storage


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("fn", [kda.chunk_kda, kda.fused_recurrent_kda], ids=["chunk", "recurrent"])
def test_bounds_out_of_range_make_no_op_sequences(fn, case, device):
    bad, valid = BAD[case]
    errors_good = torch.full((3,), 16, dtype=torch.int32, device=device)  # a bit the caller set: kept
    o_good, s_good = _run(fn, None, device, errors_good)
    before, _ = poisoned_pool(8, (HV, K, V), torch.float32, device, pad=4)
    errors = torch.zeros(3, dtype=torch.int32, device=device)
    o, s = _run(fn, bad, device, errors)
    assert errors_good.tolist() == [16, 16, 16]
    assert errors.tolist() == [0 if n in valid else kda.ERROR_BOUNDS for n in range(3)], case
    for n in valid:  # bounds kept: the good call's rows and slot, bit for bit
        rows = slice(BOUNDS[n], BOUNDS[n + 1])
        assert torch.equal(bits(o[:, rows]), bits(o_good[:, rows])), (case, n)
        assert torch.equal(bits(s[SLOTS[n]]), bits(s_good[SLOTS[n]])), (case, n)
    for n in set(range(3)) - set(valid):  # bad bounds: the slot neither read nor written
        start = torch.randn(HV, K, V, generator=torch.Generator().manual_seed(80 + n)).to(device)
        assert torch.equal(bits(s[SLOTS[n], :HV * K * V].view(HV, K, V)), bits(start)), (case, n)
    written = {BOUNDS[n] + t for n in valid for t in range(BOUNDS[n + 1] - BOUNDS[n])}
    untouched = [t for t in range(BOUNDS[-1]) if t not in written]
    assert bool((o[:, untouched] == SENTINEL).all()), case  # no row of a bad sequence written
    unnamed = [x for x in range(8) if x not in SLOTS]
    assert torch.equal(bits(s[unnamed]), bits(before[unnamed]))
    assert torch.equal(bits(s[:, HV * K * V:]), bits(before[:, HV * K * V:]))  # the padding past each plane


def _verify_call(device, idx_rows, accepted, errors, dtype=torch.float32):
    q, k, v, g, beta, kw = make_inputs(1, 5, H, HV, K, V, gate="lower_bound", device=device, seed=72)
    storage, pool = poisoned_pool(8, (HV, K, V), dtype, device)
    pool[[0, 3]] = 0.5
    call = checked_call(kda.fused_recurrent_kda, q, k, v, g, beta,
                        cu_seqlens=torch.tensor([0, 3, 5], dtype=torch.int32, device=device),
                        state_cache=pool, state_indices=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32,
                                                                     device=device),
                        num_accepted_tokens=torch.ones(2, dtype=torch.int32, device=device), state_v_first=False,
                        errors=errors, **kw)
    call = dataclasses.replace(call, state_indices=torch.tensor(idx_rows, dtype=torch.int32, device=device),
                               num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32, device=device))
    run_decode(call)


@pytest.mark.parametrize("case,rows,accepted,expect", [
    ("good", [[0, 1, 2], [3, 4, 5]], [1, 1], [0, 0]),
    ("read slot past the pool", [[0, 1, 2], [30, 4, 5]], [1, 1], [0, kda.ERROR_SLOT]),
    ("count past T_max", [[0, 1, 2], [3, 4, 5]], [1, 4], [0, kda.ERROR_ACCEPTED]),
    ("count 0", [[0, 1, 2], [3, 4, 5]], [0, 1], [kda.ERROR_ACCEPTED, 0]),
    ("kept slot past the pool", [[0, 1, 9], [3, 4, 5]], [1, 1], [kda.ERROR_KEPT_SLOT, 0]),
    ("kept slot past the sequence's end: not looked at", [[0, 1, 2], [3, 4, 99]], [1, 1], [0, 0]),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16 words"])
def test_verify_error_word(case, rows, accepted, expect, dtype, device):
    """The error word on an fp32 pool and on a 2-byte one (its state rounded after each draft)."""
    errors = torch.zeros(2, dtype=torch.int32, device=device)
    _verify_call(device, rows, accepted, errors, dtype)
    assert errors.tolist() == expect, case


@pytest.mark.parametrize("fn", [kda.chunk_kda, kda.fused_recurrent_kda], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("one_token", [False, True], ids=["varlen", "one_token"])
def test_slot_past_the_pool_sets_its_bit(fn, one_token, device):
    """The state slot past the pool (both functions; the decode's one-token kernel too) sets ERROR_SLOT of
    that sequence alone."""
    n_tok = 1 if one_token else 3
    bounds = [0, n_tok, 2 * n_tok]
    q, k, v, g, beta, kw = make_inputs(1, bounds[-1], H, HV, K, V, gate="lower_bound", device=device, seed=73)
    _, pool = poisoned_pool(8, (HV, K, V), torch.float32, device)
    pool[[0, 1]] = 0.5
    extra = dict(has_initial_state=torch.ones(2, dtype=torch.bool, device=device)) if fn is kda.chunk_kda else {}
    errors = torch.zeros(2, dtype=torch.int32, device=device)
    call = checked_call(fn, q, k, v, g, beta, cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device),
                        cu_seqlens_cpu=bounds, state_cache=pool,
                        state_indices=torch.tensor([0, 1], dtype=torch.int32, device=device), state_v_first=False,
                        errors=errors, **extra, **kw)
    call = dataclasses.replace(call, state_indices=torch.tensor([0, 8], dtype=torch.int32, device=device))
    if fn is kda.chunk_kda:
        run_chunk(call)
    else:
        assert call.one_token_per_seq == one_token
        run_decode(call)
    assert errors.tolist() == [0, kda.ERROR_SLOT]


def test_checkpoint_slot_past_the_pool_sets_its_bit(device):
    q, k, v, g, beta, kw = make_inputs(1, 200, H, HV, K, V, gate="lower_bound", device=device, seed=74)
    _, pool = poisoned_pool(8, (HV, K, V), torch.float32, device)
    pool[[0, 1]] = 0.5
    errors = torch.zeros(2, dtype=torch.int32, device=device)
    call = checked_call(kda.chunk_kda, q, k, v, g, beta,
                        cu_seqlens=torch.tensor([0, 130, 200], dtype=torch.int32, device=device), state_cache=pool,
                        state_indices=torch.tensor([0, 1], dtype=torch.int32, device=device),
                        has_initial_state=torch.ones(2, dtype=torch.bool, device=device), state_v_first=False,
                        checkpoint_every=64, checkpoint_indices=torch.tensor([[2, 3], [4, 5]], dtype=torch.int32,
                                                                             device=device),
                        errors=errors, use_qk_l2norm_in_kernel=True, **kw)
    # sequence 0 reaches both checkpoints (the second slot past the pool); sequence 1 (70 tokens) only its
    # first, so its second entry (past the pool too) is not looked at
    call = dataclasses.replace(call, checkpoint_indices=torch.tensor([[2, 8], [4, 99]], dtype=torch.int32,
                                                                       device=device))
    run_chunk(call)
    assert errors.tolist() == [kda.ERROR_KEPT_SLOT, 0]


@pytest.mark.parametrize("fn", [kda.chunk_kda, kda.fused_recurrent_kda], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("bad,exc", [(lambda d: torch.zeros(2, dtype=torch.int64, device=d), TypeError),
                                     (lambda d: torch.zeros(3, dtype=torch.int32, device=d), ValueError),
                                     (lambda d: torch.zeros(4, dtype=torch.int32, device=d)[::2], ValueError)],
                         ids=["int64", "wrong N", "strided"])
def test_bad_errors_argument_raises_naming_it(fn, bad, exc, device):
    # built on the device: `.to(device)` of a strided CPU tensor makes a contiguous copy
    q, k, v, g, beta, kw = make_inputs(1, 6, H, HV, K, V, device=device, seed=75)
    out = torch.full_like(v, SENTINEL)
    with pytest.raises(exc, match="errors"):
        fn(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int32, device=device), out=out,
           errors=bad(device), **kw)
    assert bool((out == SENTINEL).all())
