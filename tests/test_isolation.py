"""Isolation: a NaN or Inf in one sequence's inputs or initial state never reaches another sequence's output,
state or pool slot. Each case runs one varlen paged call twice, clean and with sequence 1 poisoned, and asserts
that every other sequence's output rows and slots are bitwise those of the clean call (chunks and decode
programs never mix sequences), and that the pool's unnamed slots and padding keep their bits."""

from __future__ import annotations

import pytest
import torch
from helpers import bits, make_inputs, poisoned_pool

import kda

BOUNDS = [0, 70, 75, 75, 140]  # sequence 1 is poisoned; sequence 2 is empty
SLOTS = [4, 1, 6, 2]
H, HV, K, V = 1, 2, 16, 16


def _call(fn, poison: str | None, device):
    T = BOUNDS[-1]
    q, k, v, g, beta, kw = make_inputs(1, T, H, HV, K, V, gate="lower_bound", device=device, seed=51)
    wide, pool = poisoned_pool(8, (HV, V, K), torch.float32, device, pad=4)
    for n, slot in enumerate(SLOTS):
        pool[slot] = torch.randn(HV, V, K, generator=torch.Generator().manual_seed(60 + n)).to(device)
    s0, s1 = BOUNDS[1], BOUNDS[2]
    if poison == "input_nan":
        v = v.clone()
        v[0, s0 + 2, 0, 3] = float("nan")
    elif poison == "input_inf":
        k = k.clone()
        k[0, s1 - 1, 0, 5] = float("inf")
    elif poison == "state_nan":
        pool[SLOTS[1]][0, 2, 2] = float("nan")
    elif poison == "state_inf":
        pool[SLOTS[1]][1, 0, 0] = float("-inf")
    idx = torch.tensor(SLOTS, dtype=torch.int32, device=device)
    cu = torch.tensor(BOUNDS, dtype=torch.int32, device=device)
    extra = dict(has_initial_state=torch.ones(4, dtype=torch.bool, device=device)) if fn is kda.chunk_kda else {}
    o, _ = fn(q, k, v, g, beta, cu_seqlens=cu, state_cache=pool, state_indices=idx, state_v_first=True,
              use_qk_l2norm_in_kernel=True, **extra, **kw)
    return o, wide


# the poisoned sequence's own arithmetic is inf - inf and inf / inf by design (numpy says so under the interpreter)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("fn", [kda.chunk_kda, kda.fused_recurrent_kda], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("poison", ["input_nan", "input_inf", "state_nan", "state_inf"])
def test_a_poisoned_sequence_stays_in_its_sequence(fn, poison, device):
    o_clean, pool_clean = _call(fn, None, device)
    o, pool = _call(fn, poison, device)
    others = torch.cat([torch.arange(BOUNDS[0], BOUNDS[1]), torch.arange(BOUNDS[3], BOUNDS[4])])
    assert torch.isfinite(o_clean).all()
    assert torch.equal(bits(o[:, others]), bits(o_clean[:, others]))
    for n in (0, 2, 3):  # every other sequence's slot, the empty one's included
        assert torch.equal(bits(pool[SLOTS[n]]), bits(pool_clean[SLOTS[n]]))
    unnamed = [s for s in range(8) if s not in SLOTS]
    assert torch.equal(bits(pool[unnamed]), bits(pool_clean[unnamed]))
    assert torch.equal(bits(pool[:, HV * V * K:]), bits(pool_clean[:, HV * V * K:]))  # the padding
    # and the poison did reach its own sequence (the test would pass vacuously otherwise)
    own = slice(BOUNDS[1], BOUNDS[2])
    assert not torch.isfinite(o[:, own]).all() or not torch.isfinite(pool[SLOTS[1]]).all()
