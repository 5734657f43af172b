"""Speculative verify: `state_indices` `[N, T_max]` keeps the state after every token,
`num_accepted_tokens` `[N]` starts each sequence from the state of its last accepted draft.

Properties: the oracle's verify call equals its tokens decoded one oracle call at a time (exactly, float64
pool); `kda.fused_recurrent_kda` equals the oracle (fp32: 1e-5; bf16 pool: a few bf16 ulps); a verify call
followed by a continuation from `num_accepted_tokens` equals decoding the accepted tokens and the
continuation one call at a time; every slot not named keeps its poison bits; bad inputs raise, naming the
argument, before anything is written.
"""

import dataclasses
import functools

import pytest
import torch
from conftest import DEVICE
from helpers import bounds_of, make_inputs, poison_pool, rel_err, run_decode, same_bits

import kda  # TRITON_INTERPRET is set by conftest.py when there is no GPU
import kda_reference as ref

FP32_TOL = 1e-5
# the oracle's exact mode, for its own tests on float64 pools and inputs (which kda refuses)
exact_recurrent = functools.partial(ref.recurrent_kda, allow_float64=True)
exact_chunk = functools.partial(ref.chunk_kda, allow_float64=True)
H, HV, K, V = 1, 2, 16, 16
T_MAX = 4
SLOTS = 24
# verify step: 4 drafts for sequences 0..3, sequence 4 is padding (read slot -1)
VERIFY_SLOTS = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [-1, -1, -1, -1]]
ACCEPTED = [1, 4, 2, 3, 1]  # some 1, some all 4, some in between; 1 for the padding sequence
# continuation: the same rows (vLLM reuses them) except that sequence 0 keeps no state after its second
# token (-1); entries past a sequence's length are not written
CONT_SLOTS = [[0, -1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [-1, -1, -1, -1]]
CONT_LENGTHS = [3, 1, 2, 4, 2]
STARTS = [row[0] for row in VERIFY_SLOTS[:4]]  # where each real sequence's state is before the verify
NAMED = {s for row in VERIFY_SLOTS for s in row if s >= 0}
UNNAMED = [s for s in range(SLOTS) if s not in NAMED]


def _idx(rows):
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def _cu(lengths):
    bounds = bounds_of(lengths)
    return torch.tensor(bounds, dtype=torch.int32, device=DEVICE), bounds


def _pool(v_first, dtype, start_slots, seed=3):
    """A poisoned pool (NaN / 1e30) with random initial states in `start_slots`."""
    plane = (HV, V, K) if v_first else (HV, K, V)
    pool = poison_pool(SLOTS, plane, dtype, DEVICE)
    gen = torch.Generator().manual_seed(seed)
    for s in start_slots:
        pool[s] = (0.5 * torch.randn(plane, generator=gen)).to(DEVICE, dtype)
    return pool


def _inputs(lengths, seed, dtype=torch.float32):
    q, k, v, g, beta, _ = make_inputs(1, sum(lengths), H, HV, K, V, device=DEVICE, seed=seed)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta))


def _token(x, t):
    return tuple(y[:, t:t + 1] for y in x)


def _scenario(fn, pool0, v_first, dtype=torch.float32):
    """A verify call (4 drafts each) and a continuation from ACCEPTED, by `fn` on a copy of `pool0`.
    Returns (inputs 1, inputs 2, bounds 1, bounds 2, o1, o2, pool after the verify, pool at the end)."""
    x1, x2 = _inputs([T_MAX] * 5, seed=1, dtype=dtype), _inputs(CONT_LENGTHS, seed=2, dtype=dtype)
    (cu1, b1), (cu2, b2) = _cu([T_MAX] * 5), _cu(CONT_LENGTHS)
    pool = pool0.clone()
    o1, _ = fn(*x1, cu_seqlens=cu1, state_cache=pool, state_indices=_idx(VERIFY_SLOTS), state_v_first=v_first)
    pool1 = pool.clone()
    o2, _ = fn(*x2, cu_seqlens=cu2, state_cache=pool, state_indices=_idx(CONT_SLOTS),
               num_accepted_tokens=_idx(ACCEPTED), state_v_first=v_first)
    return x1, x2, b1, b2, o1, o2, pool1, pool


def _step_by_step(fn, pool0, slot, tokens, v_first):
    """Decode `tokens` (one-token slices) one call at a time from slot `slot` of a copy of `pool0`, with
    1-D state_indices. Returns (o row of each token, the state after each token)."""
    pool = pool0.clone()
    idx = torch.tensor([slot], dtype=torch.int32, device=DEVICE)
    outs, states = [], []
    for x in tokens:
        o, _ = fn(*x, state_cache=pool, state_indices=idx, state_v_first=v_first)
        outs.append(o[0, 0].clone())
        states.append(pool[slot].clone())
    return outs, states


def _check_step_by_step(fn, pool0, v_first, dtype, same):
    """The scenario by `fn` against `fn` one call per token; `same(a, b)` compares two results. Also: unnamed
    slots keep their poison bits, padding rows are zero, slots a call does not write keep their bits."""
    x1, x2, b1, b2, o1, o2, pool1, pool = _scenario(fn, pool0, v_first, dtype)
    for n in range(4):
        a = ACCEPTED[n]
        tokens = [_token(x1, t) for t in range(b1[n], b1[n + 1])]
        outs, states = _step_by_step(fn, pool0, STARTS[n], tokens, v_first)
        for j in range(T_MAX):  # the verify call: every draft's output and state
            assert same(o1[0, b1[n] + j], outs[j]), (n, j)
            assert same(pool1[VERIFY_SLOTS[n][j]], states[j]), (n, j)
        tokens = tokens[:a] + [_token(x2, t) for t in range(b2[n], b2[n + 1])]
        outs, states = _step_by_step(fn, pool0, STARTS[n], tokens, v_first)
        for j in range(CONT_LENGTHS[n]):  # the continuation from the last accepted draft
            assert same(o2[0, b2[n] + j], outs[a + j]), (n, j)
            slot = CONT_SLOTS[n][j]
            if slot >= 0:
                assert same(pool[slot], states[a + j]), (n, j)
        kept = [s for s in VERIFY_SLOTS[n] if s not in CONT_SLOTS[n][:CONT_LENGTHS[n]]]
        assert same_bits(pool[kept], pool1[kept]), n  # not written by the continuation
    assert torch.all(o1[0, b1[4]:] == 0) and torch.all(o2[0, b2[4]:] == 0)  # the padding sequence
    assert same_bits(pool1[UNNAMED], pool0[UNNAMED]) and same_bits(pool[UNNAMED], pool0[UNNAMED])


# --- the oracle -----------------------------------------------------------------------------------------


def test_oracle_verify_then_continue_equals_step_by_step():
    """Float64 pool: the oracle's verify and continuation equal one oracle call per token, exactly."""
    pool0 = _pool(False, torch.float64, STARTS)
    _check_step_by_step(exact_recurrent, pool0, False, torch.float64, torch.equal)


def test_oracle_has_initial_state_false_reads_nothing():
    """has_initial_state false: zeros, whatever num_accepted_tokens names (a NaN slot here)."""
    x = _inputs([2, 2], seed=4, dtype=torch.float64)
    cu, _ = _cu([2, 2])
    pool = _pool(False, torch.float64, [1])  # slots 0 and 2 stay NaN
    o, _ = exact_recurrent(*x, cu_seqlens=cu, state_cache=pool, state_indices=_idx([[0, 1], [2, 3]]),
                           num_accepted_tokens=_idx([2, 1]),
                           has_initial_state=torch.tensor([True, False], device=DEVICE), state_v_first=False)
    o_zero, _ = exact_recurrent(*(t[:, 2:] for t in x))
    assert torch.isfinite(o).all() and torch.equal(o[:, 2:], o_zero)


def test_oracle_plain_paged_unchanged_and_chunk_refuses_verify():
    """1-D state_indices keeps today's behaviour; chunk_kda has no verify form."""
    x = _inputs([3, 1], seed=5, dtype=torch.float64)
    cu, _ = _cu([3, 1])
    pool = _pool(False, torch.float64, [1, 2])
    p_rec, p_chunk = pool.clone(), pool.clone()
    o_r, _ = exact_recurrent(*x, cu_seqlens=cu, state_cache=p_rec, state_indices=_idx([1, 2]),
                             state_v_first=False)
    o_c, _ = exact_chunk(*x, cu_seqlens=cu, state_cache=p_chunk, state_indices=_idx([1, 2]),
                         has_initial_state=torch.tensor([True, True], device=DEVICE), state_v_first=False)
    assert rel_err(o_r, o_c) < 1e-12 and rel_err(p_rec[1:3], p_chunk[1:3]) < 1e-12
    with pytest.raises(ValueError, match="state_indices"):
        exact_chunk(*x, cu_seqlens=cu, state_cache=pool, state_indices=_idx([[1, 3, 4], [2, 5, 6]]),
                    has_initial_state=torch.tensor([True, True], device=DEVICE), state_v_first=False)
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        exact_recurrent(*x, cu_seqlens=cu, state_cache=pool, state_indices=_idx([1, 2]),
                        num_accepted_tokens=_idx([1, 1]), state_v_first=False)


# --- the kernel -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("v_first", [False, True], ids=["k_first", "v_first"])
def test_kernel_matches_oracle(v_first, dtype):
    """Verify and continuation against the float64 oracle (which rounds the carried state to the pool's
    dtype after each token, as the kernel does): fp32 pool 1e-5; bf16 pool within a few bf16 ulps."""
    pool0 = _pool(v_first, dtype, STARTS)
    _, _, _, _, o1, o2, pool1, pool = _scenario(kda.fused_recurrent_kda, pool0, v_first)
    _, _, _, _, r1, r2, ref1, ref_pool = _scenario(ref.recurrent_kda, pool0, v_first)
    named = sorted(NAMED)
    if dtype == torch.float32:
        assert rel_err(o1, r1) < FP32_TOL and rel_err(o2, r2) < FP32_TOL
        assert rel_err(pool1[named], ref1[named]) < FP32_TOL and rel_err(pool[named], ref_pool[named]) < FP32_TOL
    else:
        # outputs: fp32 arithmetic on the same rounded states; states: round to nearest bf16 of a value the
        # oracle has in float64, so at most 1 ulp apart, and only where fp32 straddles a rounding boundary
        assert rel_err(o1, r1) < 1e-4 and rel_err(o2, r2) < 1e-4
        for got, want in ((pool1[named], ref1[named]), (pool[named], ref_pool[named])):
            ulp = torch.finfo(torch.bfloat16).eps * want.double().abs().clamp_min(1e-30)
            off = (got.double() - want.double()).abs()
            assert bool((off <= ulp).all()) and (off > 0).float().mean().item() < 0.01
    assert same_bits(pool[UNNAMED], pool0[UNNAMED])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("v_first", [False, True], ids=["k_first", "v_first"])
def test_kernel_verify_then_continue_equals_step_by_step(v_first, dtype):
    """A verify call, then a continuation from num_accepted_tokens, equals the accepted tokens and the
    continuation decoded one call at a time. Bit for bit under the interpreter (measured) where the one-token
    kernel rounds as the loop kernel does (V-first pools); the K-first one-token kernel puts the decay on the
    K-vectors (`_one_token_k_held`: S^T (2^g k), not (2^g S)^T k), and on a GPU every one-token call runs another
    binary (`_fused_recurrent_one_token_kernel`), so there this test asks for rounding only (tests/test_gpu.py's
    bound)."""
    pool0 = _pool(v_first, dtype, STARTS)
    ulps = 1e-6 if dtype == torch.float32 else 2 ** -7
    held = not v_first

    def same(a, b):
        if DEVICE == "cpu" and not held:
            return same_bits(a, b)
        return a.dtype == b.dtype and bool(torch.isfinite(a).all()) and rel_err(a, b) <= ulps

    _check_step_by_step(kda.fused_recurrent_kda, pool0, v_first, torch.float32, same)


def test_kernel_has_initial_state_false_reads_nothing():
    """has_initial_state false: zeros without a read, whatever num_accepted_tokens names (a NaN slot)."""
    x = _inputs([2, 2], seed=4)
    cu, _ = _cu([2, 2])
    pool = _pool(False, torch.float32, [1])  # slots 0 and 2 stay NaN
    o, _ = kda.fused_recurrent_kda(*x, cu_seqlens=cu, state_cache=pool, state_indices=_idx([[0, 1], [2, 3]]),
                                   num_accepted_tokens=_idx([2, 1]),
                                   has_initial_state=torch.tensor([True, False], device=DEVICE), state_v_first=False)
    o_zero, s_zero = kda.fused_recurrent_kda(*(t[:, 2:] for t in x), output_final_state=True)
    assert torch.isfinite(o).all()
    if DEVICE == "cpu":
        assert same_bits(o[:, 2:], o_zero) and same_bits(pool[3], s_zero[0])
    else:  # the verify binary and the plain one contract mul+add differently: rounding, not bits
        assert rel_err(o[:, 2:], o_zero) <= 1e-6 and rel_err(pool[3], s_zero[0]) <= 1e-6


def test_kernel_dense_batch_and_empty_sequence():
    """Dense [N, T] with T_max > T, and a varlen empty sequence (no state kept, its read slot untouched)."""
    x = _inputs([3, 3], seed=6)
    pool0 = _pool(True, torch.float32, [0, 5])
    dense = tuple(t.reshape(2, 3, *t.shape[2:]) for t in x)
    idx = _idx([[0, 1, 2, 9], [5, -1, 6, 9]])  # column 3 is past T: never written
    pool, ref_pool = pool0.clone(), pool0.clone()
    o, _ = kda.fused_recurrent_kda(*dense, state_cache=pool, state_indices=idx, state_v_first=True)
    r, _ = ref.recurrent_kda(*dense, state_cache=ref_pool, state_indices=idx, state_v_first=True)
    assert rel_err(o, r) < FP32_TOL and rel_err(pool[[0, 1, 2, 5, 6]], ref_pool[[0, 1, 2, 5, 6]]) < FP32_TOL
    untouched = [s for s in range(SLOTS) if s not in (0, 1, 2, 5, 6)]
    assert same_bits(pool[untouched], pool0[untouched])
    cu, _ = _cu([0, 3])
    pool = pool0.clone()
    kda.fused_recurrent_kda(*(t[:, :3] for t in x), cu_seqlens=cu, state_cache=pool,
                            state_indices=_idx([[0, 1, 2], [5, 6, 7]]), state_v_first=True)
    assert same_bits(pool[[0, 1, 2]], pool0[[0, 1, 2]])  # the empty sequence keeps nothing, reads nothing
    assert not same_bits(pool[7], pool0[7])


# --- bad inputs: the argument is named, nothing is written ---------------------------------------------

BAD = [
    ("state_indices int64", dict(state_indices=[[0, 1, 2], [3, 4, 5]], idx_dtype=torch.int64), TypeError,
     "state_indices"),
    ("state_indices wrong N", dict(state_indices=[[0, 1, 2], [3, 4, 5], [6, 7, 8]]), ValueError, "state_indices"),
    ("state_indices T_max < longest (host bounds)", dict(state_indices=[[0, 1], [3, 4]]), ValueError,
     "state_indices"),
    ("state_indices T_max < longest (device bounds on CPU)", dict(state_indices=[[0, 1], [3, 4]], host=False),
     ValueError, "state_indices"),
    ("state_indices strided along T_max", dict(transposed=True), ValueError, "state_indices"),
    ("state_indices slot out of range", dict(state_indices=[[0, 1, 2], [3, SLOTS, 5]]), ValueError,
     "state_indices"),
    ("state_indices written twice", dict(state_indices=[[0, 1, 2], [1, 4, 5]]), ValueError, "state_indices"),
    ("read slot written by another sequence", dict(state_indices=[[0, 1, 2], [3, 4, 1]], accepted=[1, 3]),
     ValueError, "state_indices"),
    ("num_accepted_tokens int64", dict(accepted=[1, 2], acc_dtype=torch.int64), TypeError, "num_accepted_tokens"),
    ("num_accepted_tokens wrong N", dict(accepted=[1, 2, 1]), ValueError, "num_accepted_tokens"),
    ("num_accepted_tokens 0", dict(accepted=[0, 2]), ValueError, "num_accepted_tokens"),
    ("num_accepted_tokens past T_max", dict(accepted=[1, 4]), ValueError, "num_accepted_tokens"),
    ("unused entries past a sequence's length are not checked", dict(state_indices=[[0, 1, 2], [3, 4, 4]]),
     None, None),
    ("num_accepted_tokens with 1-D state_indices", dict(state_indices=[0, 3], accepted=[1, 1]), ValueError,
     "num_accepted_tokens"),
    ("num_accepted_tokens without a pool", dict(no_pool=True, accepted=[1, 1]), ValueError, "num_accepted_tokens"),
    ("stochastic_rounding", dict(stochastic_rounding=True), ValueError, "stochastic_rounding"),
    ("chunk_kda", dict(chunk=True), ValueError, "state_indices"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_inputs_raise_naming_the_argument(case, monkeypatch):
    """On a GPU the checks of device values (slots, counts, device-only bounds) run under KDA_DEBUG only
    (they read the device back); on CPU always. Without it the kernel guards them: the test below."""
    if DEVICE != "cpu":
        monkeypatch.setenv("KDA_DEBUG", "1")
    _, over, exc, word = case
    x = _inputs([3, 2], seed=7)
    cu, bounds = _cu([3, 2])
    pool = _pool(False, torch.bfloat16, [0, 3])
    before = pool.clone()
    rows = over.get("state_indices", [[0, 1, 2], [3, 4, 5]])
    idx = torch.tensor(rows, dtype=over.get("idx_dtype", torch.int32), device=DEVICE)
    if over.get("transposed"):
        idx = torch.tensor([[0, 3], [1, 4], [2, 5]], dtype=torch.int32, device=DEVICE).t()
    kw = dict(cu_seqlens=cu, state_cache=pool, state_indices=idx, state_v_first=False)
    if over.get("host", True):
        kw["cu_seqlens_cpu"] = bounds
    if "accepted" in over:
        kw["num_accepted_tokens"] = torch.tensor(over["accepted"], dtype=over.get("acc_dtype", torch.int32),
                                                 device=DEVICE)
    if over.get("no_pool"):
        for name in ("state_cache", "state_indices", "state_v_first"):
            kw.pop(name)
    if over.get("stochastic_rounding"):
        kw["stochastic_rounding"] = True
    out = torch.full_like(x[2], 7.0)
    if exc is None:  # a valid call, for contrast
        kda.fused_recurrent_kda(*x, out=out, **kw)
        assert not same_bits(pool, before)
        return
    with pytest.raises(exc, match=rf"\b{word}\b"):
        if over.get("chunk"):
            kda.chunk_kda(*x, out=out, has_initial_state=torch.ones(2, dtype=torch.bool, device=DEVICE), **kw)
        else:
            kda.fused_recurrent_kda(*x, out=out, **kw)
    assert same_bits(pool, before) and bool((out == 7.0).all())


@pytest.mark.parametrize("bad", ["count 0", "count past T_max", "read slot past the pool", "kept slot past the pool",
                                 "row shorter than the sequence"])
def test_device_values_out_of_range_are_guarded_no_ops(bad):
    """Device values the host does not read (no KDA_DEBUG on a GPU): the call is validated with good values,
    which are then overwritten on the device before the kernel runs. A count outside 1..T_max or a read slot
    past the pool makes that sequence a no-op (zero output rows, no state read or written); a kept slot past
    the pool, or a token past a row shorter than its sequence, keeps nothing; the other sequence and every
    other slot are exactly as in the good call."""
    from helpers import checked_call


    x = _inputs([3, 2], seed=7)
    cu, bounds = _cu([3, 2])
    pool0 = _pool(False, torch.float32, [0, 3])

    def run(idx_rows, accepted, mutate=None):
        pool = pool0.clone()
        idx, acc = _idx(idx_rows), _idx(accepted)
        call = checked_call(kda.fused_recurrent_kda, *x, cu_seqlens=cu, cu_seqlens_cpu=bounds, state_cache=pool,
                            state_indices=idx, num_accepted_tokens=acc, state_v_first=False)
        if mutate:
            mutate(idx, acc)
        o, _ = run_decode(call)
        return o, pool

    good_rows = [[0, 1, 2], [3, 4, 5]]
    o_good, pool_good = run(good_rows, [1, 1])
    mutations = {
        "count 0": lambda idx, acc: acc.__setitem__(1, 0),
        "count past T_max": lambda idx, acc: acc.__setitem__(1, 4),
        "read slot past the pool": lambda idx, acc: idx.__setitem__((1, 0), SLOTS + 1000),
        "kept slot past the pool": lambda idx, acc: idx.__setitem__((1, 1), SLOTS),
        "row shorter than the sequence": None,
    }
    if bad == "row shorter than the sequence":
        # sequence 0 holds 3 tokens; a [N, 2] row names slots for 2: the view's third column is out of bounds
        pool = pool0.clone()
        wide = _idx([[0, 1, 9], [3, 4, 8]])
        call = checked_call(kda.fused_recurrent_kda, *x, cu_seqlens=cu, state_cache=pool,
                            state_indices=_idx(good_rows), num_accepted_tokens=_idx([1, 1]), state_v_first=False)
        call = dataclasses.replace(call, state_indices=wide[:, :2])
        o, _ = run_decode(call)
        assert same_bits(o, o_good)
        assert same_bits(pool[[0, 1, 3, 4]], pool_good[[0, 1, 3, 4]])
        untouched = [s for s in range(SLOTS) if s not in (0, 1, 3, 4)]
        assert same_bits(pool[untouched], pool0[untouched])  # slots 8 and 9 past the rows' ends: kept nothing
        return
    o, pool = run(good_rows, [1, 1], mutations[bad])
    assert same_bits(o[:, :3], o_good[:, :3])  # sequence 0 as in the good call
    assert same_bits(pool[[0, 1, 2]], pool_good[[0, 1, 2]])
    if bad == "kept slot past the pool":
        assert same_bits(o[:, 3:], o_good[:, 3:])  # the sequence ran; only the store past the pool was dropped
        assert same_bits(pool[[3, 5]], pool_good[[3, 5]]) and same_bits(pool[4], pool0[4])
    else:
        assert bool((o[:, 3:] == 0).all())  # a no-op sequence: zero output rows
        assert same_bits(pool[[3, 4, 5]], pool0[[3, 4, 5]])
    others = list(range(6, SLOTS))
    assert same_bits(pool[others], pool0[others])
