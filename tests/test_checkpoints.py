"""Prefix-cache checkpoints in `kda.chunk_kda`: `checkpoint_every` (a multiple of 64) and
`checkpoint_indices` `[N, C]` store the state after every `checkpoint_every` tokens of each sequence into
pool slots, during the same walk.

Properties: every checkpoint (and output, and final state) matches the float64 oracle, which defines them
(`kda_reference.contract`): 1e-5 with fp32 inputs and pool; with a 16-bit pool the stored value is the
oracle's rounded to the pool's dtype (half an ulp, plus the fp32 error). Every slot not written keeps its
NaN / 1e30 poison bits: those named by no one, by a negative entry, by an entry past its sequence's end, by
a padding sequence, or by a slot outside the pool (the kernel's guard). A checkpoint equals the final state
of a call cut at its offset. Bad arguments
raise naming the argument before anything is written (the argument-level cases are in
tests/test_contract.py's catalog; the value checks, which need sequences long enough to reach a
checkpoint, are here).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE
from helpers import bounds_of, checked_call, make_inputs, poison_pool, poisoned_pool, rel_err, run_chunk, same_bits

import kda  # TRITON_INTERPRET is set by conftest.py when there is no GPU
import kda_reference as ref

FP32_TOL = 1e-5
CUT_TOL = 1e-6
H, HV, K, V = 1, 2, 16, 20  # V = 20: a V block of 32 with masked columns
SLOTS = 24
# sequence:      0     1  2    3    4    5
LENGTHS = [200, 0, 50, 128, 70, 70]
FINAL = [0, 1, 2, 3, -1, 4]  # sequence 4 is padding: no read, no write, no checkpoint
HAS_INIT = [True, True, False, True, True, True]  # slot 2 holds NaN and is not read
# checkpoints every 64 tokens: 0 reaches three (skips its second, keeps 5 and 6); 1 is empty (its entries name
# slots it never writes); 2 is shorter than the first checkpoint; 3 ends exactly at its second (slot 9 equals
# its final state); 4 is padding; 5 reaches one. Entries past a sequence's end are neither checked nor
# written: 99 (outside the pool) and the duplicate 7 among them.
CKPT_64 = [[5, -1, 6, 7], [11, 12, -1, -1], [13, 99, -1, -1], [8, 9, 7, -1], [14, 15, -1, -1], [10, -1, 7, 99]]
WRITTEN_64 = [5, 6, 8, 9, 10]


def _pool(v_first, dtype, seed=5):
    """A poisoned pool (NaN / 1e30; 6e4 in fp16) with random initial states in the final slots."""
    plane = (HV, V, K) if v_first else (HV, K, V)
    pool = poison_pool(SLOTS, plane, dtype, DEVICE, pad=3)
    gen = torch.Generator().manual_seed(seed)
    for s, flag in zip(FINAL, HAS_INIT):
        if s >= 0 and flag:
            pool[s] = (0.5 * torch.randn(plane, generator=gen)).to(DEVICE, dtype)
    return pool


def _args(pool, v_first, every, ckpt, lengths=LENGTHS, final=FINAL, has_init=HAS_INIT, seed=1):
    """(q, k, v, g, beta) and the keywords of a paged varlen call with checkpoints; Kimi's gate and q/k
    normalisation in the kernel (the fused prepare)."""
    bounds = bounds_of(lengths)
    q, k, v, g, beta, kw = make_inputs(1, bounds[-1], H, HV, K, V, gate="lower_bound", device=DEVICE, seed=seed)
    kw.update(use_qk_l2norm_in_kernel=True)
    kw.update(cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=DEVICE), state_cache=pool,
              state_indices=torch.tensor(final, dtype=torch.int32, device=DEVICE),
              has_initial_state=torch.tensor(has_init, device=DEVICE), state_v_first=v_first)
    if every is not None:
        kw.update(checkpoint_every=every, checkpoint_indices=torch.tensor(ckpt, dtype=torch.int32, device=DEVICE))
    return (q, k, v, g, beta), kw


def _oracle(x, kw, pool0):
    """The float64 oracle on a float64 copy of `pool0` (the pool before the call): the exact checkpoints and
    final states (not rounded to the pool's dtype) and the output."""
    exact = dict(kw, state_cache=pool0.double().cpu())
    exact = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in exact.items()}
    o, _ = ref.chunk_kda(*(t.cpu() for t in x), **exact, allow_float64=True)
    return o, exact["state_cache"]


def _unwritten(written):
    return [s for s in range(SLOTS) if s not in set(written)]


@pytest.mark.parametrize("v_first,storage", [(False, torch.float32), (True, torch.float32),
                                             (False, torch.bfloat16), (True, torch.float16)],
                         ids=["k_first-fp32", "v_first-fp32", "k_first-bf16", "v_first-fp16"])
def test_checkpoints_match_the_oracle_and_leave_other_slots(v_first, storage):
    """fp32 inputs, a checkpoint every 64 tokens over varlen sequences (empty, shorter than the first
    checkpoint, ending exactly at one, padding): outputs, final states and checkpoints against the float64
    oracle; every slot not written keeps its poison bits."""
    pool0 = _pool(v_first, storage)
    pool = pool0.clone()
    x, kw = _args(pool, v_first, 64, CKPT_64)
    o, s = kda.chunk_kda(*x, **kw)
    ro, exact = _oracle(x, kw, pool0)
    assert s is None
    assert rel_err(o, ro) < FP32_TOL  # the pool is read once (an exact upcast); 16-bit storage changes nothing
    finals = [f for f in FINAL if f >= 0]
    written = WRITTEN_64 + finals
    if storage == torch.float32:
        assert rel_err(pool[written], exact[written]) < FP32_TOL
    else:
        # round to nearest of an fp32 value within 1e-5 of the exact one: half an ulp plus that error
        got, want = pool[written].double().cpu(), exact[written]
        err = (got - want).abs()
        assert bool((err <= 0.5 * torch.finfo(storage).eps * want.abs() + FP32_TOL * want.abs().max()).all())
    for slot in written:
        assert bool(torch.isfinite(pool[slot]).all()), slot
    assert same_bits(pool[_unwritten(written)], pool0[_unwritten(written)])
    assert same_bits(pool[9], pool[3])  # sequence 3 ends at its second checkpoint: the same state, stored twice
    bounds = bounds_of(LENGTHS)
    assert bool((o[:, bounds[4]:bounds[5]] == 0).all())  # the padding sequence's rows


def test_dense_batch_and_checkpoints_every_128():
    """A dense batch (no cu_seqlens) of 2 x 260 tokens, a checkpoint every 128 (two chunks): two per sequence,
    at 128 and 256; int64 indices."""
    pool0 = _pool(False, torch.float32)
    pool = pool0.clone()
    q, k, v, g, beta, kw = make_inputs(2, 260, H, HV, K, V, device=DEVICE, seed=2)
    ckpt = torch.tensor([[10, 11, 99], [-1, 12, 98]], dtype=torch.int64, device=DEVICE)
    kw.update(state_cache=pool, state_indices=torch.tensor([3, 1], dtype=torch.int32, device=DEVICE),
              has_initial_state=torch.tensor([True, True], device=DEVICE), state_v_first=False,
              checkpoint_every=128, checkpoint_indices=ckpt)
    o, _ = kda.chunk_kda(q, k, v, g, beta, **kw)
    ro, exact = _oracle((q, k, v, g, beta), kw, pool0)
    written = [1, 3, 10, 11, 12]
    assert rel_err(o, ro) < FP32_TOL and rel_err(pool[written], exact[written]) < FP32_TOL
    assert same_bits(pool[_unwritten(written)], pool0[_unwritten(written)])


@pytest.mark.parametrize("every", [64, 128])
def test_checkpoint_equals_the_final_state_of_the_call_cut_there(every):
    """Each checkpoint equals the final state (same pool dtype) of the same sequence cut at its offset, run as
    its own call from the same initial slot: all the cut sequences in one varlen call."""
    v_first = every == 128
    pool0 = _pool(v_first, torch.float32)
    pool = pool0.clone()
    ckpt = CKPT_64 if every == 64 else [[5, 6, -1, -1], [11, -1, -1, -1], [12, -1, -1, -1], [8, -1, -1, -1],
                                        [14, -1, -1, -1], [-1, -1, -1, -1]]
    x, kw = _args(pool, v_first, every, ckpt)
    kda.chunk_kda(*x, **kw)
    bounds = bounds_of(LENGTHS)
    cuts = []  # (sequence, checkpoint slot, offset)
    for n, row in enumerate(ckpt):
        if FINAL[n] < 0:
            continue
        cuts += [(n, slot, (j + 1) * every) for j, slot in enumerate(row[:LENGTHS[n] // every]) if slot >= 0]
    assert len(cuts) == (5 if every == 64 else 2)
    pick = torch.cat([torch.arange(bounds[n], bounds[n] + off) for n, _, off in cuts]).to(DEVICE)
    cut_x = tuple(t[:, pick] for t in x)
    cut_pool = pool0.clone()
    dst = list(range(16, 16 + len(cuts)))  # fresh (poisoned) slots for the cut calls' final states
    for d, (n, _, _) in zip(dst, cuts):
        cut_pool[d] = pool0[FINAL[n]]
    cu = torch.tensor(bounds_of([off for _, _, off in cuts]), dtype=torch.int32, device=DEVICE)
    kda.chunk_kda(*cut_x, cu_seqlens=cu, state_cache=cut_pool, state_v_first=v_first,
                  state_indices=torch.tensor(dst, dtype=torch.int32, device=DEVICE),
                  has_initial_state=torch.tensor([HAS_INIT[n] for n, _, _ in cuts], device=DEVICE),
                  **{n: kw[n] for n in ("use_gate_in_kernel", "A_log", "dt_bias", "lower_bound",
                                       "use_qk_l2norm_in_kernel")})
    for d, (n, slot, off) in zip(dst, cuts):
        assert rel_err(pool[slot], cut_pool[d]) < CUT_TOL, (n, off)


def test_a_slot_outside_the_pool_is_never_written():
    """The kernel's guard: checkpoint slots the checks would refuse (past the pool, negative beyond -1), handed
    to the launch directly (as a device call without KDA_DEBUG would, unchecked), are skipped; the storage
    past the pool keeps its bits."""
    storage, _ = poisoned_pool(SLOTS + 4, (HV, K, V), torch.float32, DEVICE)
    pool = storage[:SLOTS].view(SLOTS, HV, K, V)
    pool[0] = 0.5
    before = storage.clone()
    x, kw = _args(pool, False, 64, [[SLOTS, -7, SLOTS + 2]], lengths=[200], final=[0], has_init=[True])
    call = checked_call(kda.chunk_kda, *x, **dict(kw, checkpoint_indices=torch.full_like(kw["checkpoint_indices"],
                                                                                           -1)))
    call = dataclasses.replace(call, checkpoint_indices=kw["checkpoint_indices"])
    run_chunk(call)
    assert same_bits(storage[1:], before[1:])
    assert bool(torch.isfinite(pool[0]).all()) and not same_bits(storage[0], before[0])


def test_without_checkpoints_nothing_changes():
    """The same call without checkpoints gives the same output and final states bit for bit: the walk goes
    on from the unrounded state whatever it stores."""
    pool_a, pool_b = _pool(True, torch.bfloat16), _pool(True, torch.bfloat16)
    one = dict(lengths=[200], final=[0], has_init=[True])
    x, kw = _args(pool_a, True, 64, [[5, 6, 7]], **one)
    o_a, _ = kda.chunk_kda(*x, **kw)
    _, kw_b = _args(pool_b, True, None, None, **one)
    o_b, _ = kda.chunk_kda(*x, **kw_b)
    assert same_bits(o_a, o_b) and same_bits(pool_a[0], pool_b[0])
    assert not same_bits(pool_a[5:8], pool_b[5:8])


# --- bad values: raise naming checkpoint_indices, write nothing -------------------------------------------

BAD_VALUES = [
    ("slot == slots", [[5, SLOTS, -1, -1]], "checkpoint_indices"),
    ("slot twice", [[5, 6, 5, -1]], "checkpoint_indices"),
    ("slot twice across sequences", [[5, -1, -1, -1], [], [], [5, -1, -1, -1]], "checkpoint_indices"),
    ("a final slot", [[5, 3, -1, -1]], "checkpoint_indices"),
    ("a slot read", [[0, -1, -1, -1]], "checkpoint_indices"),
    ("a final slot not read (has_initial_state false)", [[2, -1, -1, -1]], "checkpoint_indices"),
    ("valid, for contrast", [[5, -1, 6, 7]], None),
]


@pytest.mark.parametrize("debug", [False, True], ids=["cpu", "KDA_DEBUG"])
@pytest.mark.parametrize("name,rows,word", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_checkpoint_slots_raise_and_write_nothing(monkeypatch, name, rows, word, debug):
    """Slot values are checked where the call can read them without a sync (indices on the CPU) and under
    KDA_DEBUG=1; only the checkpoints a sequence reaches count (padding sequence 4 and the entries past each
    length are free)."""
    if debug:
        monkeypatch.setenv("KDA_DEBUG", "1")
    elif DEVICE != "cpu":
        pytest.skip("without KDA_DEBUG the device values are not read")
    full = [r + [-1] * (4 - len(r)) if r else [-1] * 4 for r in rows] + [[-1] * 4] * (len(LENGTHS) - len(rows))
    full[4] = [5, 6, 7, 99]  # the padding sequence: never checked
    pool = _pool(False, torch.float32)
    before = pool.clone()
    x, kw = _args(pool, False, 64, full)
    out = torch.full((1, sum(LENGTHS), HV, V), 7.0, device=DEVICE)
    if word is None:
        kda.chunk_kda(*x, out=out, **kw)
        kept = _unwritten([5, 6] + [f for f in FINAL if f >= 0])
        assert not same_bits(pool[[5, 6]], before[[5, 6]]) and same_bits(pool[kept], before[kept])
        return
    with pytest.raises(ValueError, match=rf"\b{word}\b"):
        kda.chunk_kda(*x, out=out, **kw)
    assert same_bits(pool, before) and bool((out == 7.0).all())


def test_checkpoints_are_chunk_kda_s_only():
    q, k, v, g, beta, _ = make_inputs(1, 4, 1, 1, 8, 8, device=DEVICE)
    with pytest.raises(TypeError, match="checkpoint_every"):
        kda.fused_recurrent_kda(q, k, v, g, beta, checkpoint_every=64)
