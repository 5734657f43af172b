"""Speculative verify (issue 14 item 2): `state_indices` `[N, T_max]` keeps the state after every token,
`num_accepted_tokens` `[N]` starts each sequence from the state of its last accepted draft.

Properties: the oracle's verify call equals its tokens decoded one oracle call at a time (exactly, float64
pool); `kda.fused_recurrent_kda` equals the oracle (fp32: 1e-5; bf16 pool: a few bf16 ulps); a verify call
followed by a continuation from `num_accepted_tokens` equals decoding the accepted tokens and the
continuation one call at a time; every slot not named keeps its poison bits; bad inputs raise, naming the
argument, before anything is written.
"""

import pytest
import torch
from conftest import DEVICE
from helpers import make_inputs, poison_pool, rel_err, same_bits

import kda_reference as ref

FP32_TOL = 1e-5
H, HV, K, V = 1, 2, 16, 16
T_MAX = 4
SLOTS = 24
# verify step: 4 drafts for sequences 0..3, sequence 4 is padding (read slot -1)
VERIFY_SLOTS = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [-1, -1, -1, -1]]
ACCEPTED = [1, 4, 2, 3, 1]
# continuation: the same rows (vLLM reuses them), lengths per sequence; sequence 0 keeps no state after
# its second token (-1); entries past a sequence's length are not written
CONT_LENGTHS = [3, 1, 2, 4, 2]
NAMED = {s for row in VERIFY_SLOTS for s in row if s >= 0}


def _idx(rows):
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def _cu(lengths):
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32, device=DEVICE), bounds


def _pool(v_first, dtype, start_slots, seed=3):
    """A poisoned pool with random initial states in `start_slots`."""
    plane = (HV, V, K) if v_first else (HV, K, V)
    pool = poison_pool(SLOTS, plane, dtype, DEVICE)
    gen = torch.Generator().manual_seed(seed)
    for s in start_slots:
        pool[s] = (0.5 * torch.randn(plane, generator=gen)).to(DEVICE, dtype)
    return pool


def _inputs(lengths, seed):
    q, k, v, g, beta, _ = make_inputs(1, sum(lengths), H, HV, K, V, device=DEVICE, seed=seed)
    return q, k, v, g, beta


def _step_by_step(fn, pool0, slot_of_seq, tokens, v_first, **kw):
    """Decode each sequence's tokens one call at a time, the state in slot `slot_of_seq[n]` of a copy of
    `pool0`: returns (o rows per token, state after each token) per sequence. `tokens[n]` is a list of
    (q, k, v, g, beta) one-token slices."""
    pool = pool0.clone()
    outs, states = [], []
    for n, slot in enumerate(slot_of_seq):
        o_n, s_n = [], []
        idx = torch.tensor([slot], dtype=torch.int32, device=DEVICE)
        for x in tokens[n]:
            o, _ = fn(*x, state_cache=pool, state_indices=idx, state_v_first=v_first, **kw)
            o_n.append(o[0, 0].clone())
            s_n.append(pool[slot].clone())
        outs.append(o_n)
        states.append(s_n)
    return outs, states


def _token(x, t):
    return tuple(y[:, t:t + 1] for y in x)


# --- the oracle -----------------------------------------------------------------------------------------


def test_oracle_verify_then_continue_equals_step_by_step():
    """Float64 pool: the oracle's verify and continuation equal one oracle call per token, exactly."""
    v_first = False
    starts = [row[0] for row in VERIFY_SLOTS[:4]]
    pool0 = _pool(v_first, torch.float64, starts)
    x1 = tuple(t.double() for t in _inputs([T_MAX] * 5, seed=1))
    x2 = tuple(t.double() for t in _inputs(CONT_LENGTHS, seed=2))
    cu1, b1 = _cu([T_MAX] * 5)
    cu2, b2 = _cu(CONT_LENGTHS)
    pool = pool0.clone()
    o1, _ = ref.recurrent_kda(*x1, cu_seqlens=cu1, state_cache=pool, state_indices=_idx(VERIFY_SLOTS),
                              state_v_first=v_first)
    o2, _ = ref.recurrent_kda(*x2, cu_seqlens=cu2, state_cache=pool, state_indices=_idx(VERIFY_SLOTS),
                              num_accepted_tokens=_idx(ACCEPTED), state_v_first=v_first)
    for n in range(4):
        tokens = [_token(x1, t) for t in range(b1[n], b1[n] + ACCEPTED[n])]
        tokens += [_token(x2, t) for t in range(b2[n], b2[n + 1])]
        outs, states = _step_by_step(ref.recurrent_kda, pool0, [starts[n]], [tokens], v_first)
        outs, states = outs[0], states[0]
        a = ACCEPTED[n]
        for j in range(a):
            assert torch.equal(o1[0, b1[n] + j], outs[j])
        for j in range(CONT_LENGTHS[n]):
            assert torch.equal(o2[0, b2[n] + j], outs[a + j])
            assert torch.equal(pool[VERIFY_SLOTS[n][j]], states[a + j])
    assert torch.all(o1[0, b1[4]:] == 0) and torch.all(o2[0, b2[4]:] == 0)  # padding rows
    unnamed = [s for s in range(SLOTS) if s not in NAMED]
    assert same_bits(pool[unnamed], pool0[unnamed])


def test_oracle_has_initial_state_false_reads_nothing():
    """has_initial_state false: zeros, whatever num_accepted_tokens names (a NaN slot here)."""
    x = tuple(t.double() for t in _inputs([2, 2], seed=4))
    cu, _ = _cu([2, 2])
    pool = _pool(False, torch.float64, [1])  # slot 0 and 2 stay NaN
    idx = _idx([[0, 1], [2, 3]])
    o, _ = ref.recurrent_kda(*x, cu_seqlens=cu, state_cache=pool, state_indices=idx,
                             num_accepted_tokens=_idx([2, 1]), has_initial_state=torch.tensor([True, False]),
                             state_v_first=False)
    o_zero, _ = ref.recurrent_kda(*(t[:, 2:] for t in x), output_final_state=True)
    assert torch.isfinite(o).all() and torch.equal(o[:, 2:], o_zero)


def test_oracle_plain_paged_unchanged_and_chunk_refuses_verify():
    """1-D state_indices keeps today's behaviour; chunk_kda has no verify form."""
    x = tuple(t.double() for t in _inputs([3, 1], seed=5))
    cu, _ = _cu([3, 1])
    pool = _pool(False, torch.float64, [1, 2])
    p_rec, p_chunk = pool.clone(), pool.clone()
    o_r, _ = ref.recurrent_kda(*x, cu_seqlens=cu, state_cache=p_rec, state_indices=_idx([1, 2]),
                               state_v_first=False)
    o_c, _ = ref.chunk_kda(*x, cu_seqlens=cu, state_cache=p_chunk, state_indices=_idx([1, 2]),
                           has_initial_state=torch.tensor([True, True]), state_v_first=False)
    assert rel_err(o_r, o_c) < 1e-12 and rel_err(p_rec[1:3], p_chunk[1:3]) < 1e-12
    with pytest.raises(ValueError, match="state_indices"):
        ref.chunk_kda(*x, cu_seqlens=cu, state_cache=pool, state_indices=_idx([[1, 3, 4], [2, 5, 6]]),
                      has_initial_state=torch.tensor([True, True]), state_v_first=False)
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        ref.recurrent_kda(*x, cu_seqlens=cu, state_cache=pool, state_indices=_idx([1, 2]),
                          num_accepted_tokens=_idx([1, 1]), state_v_first=False)
