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
from helpers import bits, checked_call, make_inputs, poisoned_pool

import kda
from kda.ops.chunk import chunk_kda_fwd
from kda.ops.fused_recurrent import fused_recurrent_kda_fwd
from kda.plan import chunk_plan

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


def _run(fn, bad, walk, device):
    T = BOUNDS[-1]
    q, k, v, g, beta, kw = make_inputs(1, T, H, HV, K, V, gate="lower_bound", device=device, seed=71)
    storage, pool = poisoned_pool(8, (HV, K, V), torch.float32, device, pad=4)
    for n, slot in enumerate(SLOTS):
        pool[slot] = torch.randn(HV, K, V, generator=torch.Generator().manual_seed(80 + n)).to(device)
    extra = dict(has_initial_state=torch.ones(3, dtype=torch.bool, device=device)) if fn is kda.chunk_kda else {}
    out = torch.full_like(v, SENTINEL)
    call = checked_call(fn, q, k, v, g, beta, cu_seqlens=torch.tensor(BOUNDS, dtype=torch.int32, device=device),
                        state_cache=pool, state_indices=torch.tensor(SLOTS, dtype=torch.int32, device=device),
                        state_v_first=False, use_qk_l2norm_in_kernel=True, out=out, **extra, **kw)
    if bad is not None:
        call = dataclasses.replace(call, cu_seqlens=torch.tensor(bad, dtype=torch.int32, device=device))
    if fn is kda.chunk_kda:
        chunk_kda_fwd(call, chunk_plan(call, walk=walk, segment_chunks=1))
    else:
        fused_recurrent_kda_fwd(call)
    return out, storage


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("fn,walk", [(kda.chunk_kda, "plain"), (kda.chunk_kda, "segmented"),
                                     (kda.fused_recurrent_kda, None)], ids=["chunk-plain", "chunk-segmented",
                                                                            "recurrent"])
def test_bounds_out_of_range_make_no_op_sequences(fn, walk, case, device):
    bad, valid = BAD[case]
    o_good, s_good = _run(fn, None, walk, device)
    before, _ = poisoned_pool(8, (HV, K, V), torch.float32, device, pad=4)
    o, s = _run(fn, bad, walk, device)
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
