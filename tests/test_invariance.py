"""Batch invariance: a sequence's output rows and final state are bitwise the same whatever else is in the call
(how many sequences, their lengths, the short ones routed to the recurrent loop, host bounds or not, dense or
varlen), and a sequence prefilled in pieces of multiples of 64 tokens through an fp32 pool equals one call
(docs/contract.md, "Batch invariance"). On the GPU the plans of these calls differ (V blocks, the walk beside
the prepare, grids), at the serving shape; on the CPU the interpreter runs the same kernels at a small one.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from helpers import bounds_of, make_inputs, same_bits

import kda

if DEVICE == "cuda":  # Kimi's serving shape: bf16 inputs, in-kernel gate with a lower bound
    H, K, V, DTYPE, L0 = 32, 128, 128, torch.bfloat16, 3000
    BESIDE = {"64x300": [300] * 64, "5000": [5000], "3x700": [700] * 3, "50x1": [1] * 50,
              "mixed": [0, 7, 1, 300, 16, 17, 64, 0, 2]}
else:
    H, K, V, DTYPE, L0 = 2, 32, 32, torch.float32, 210
    BESIDE = {"3x70": [70] * 3, "5x1": [1] * 5, "mixed": [0, 7, 1, 130, 16, 17, 64, 0, 2], "400": [400]}
KW = dict(use_qk_l2norm_in_kernel=True)


def _tokens(lengths, seed):
    """Inputs of a varlen batch of these lengths (q, k, v, g, beta, gate keywords)."""
    return make_inputs(1, sum(lengths), H, H, K, V, dtype=DTYPE, gate="lower_bound", device=DEVICE, seed=seed,
                       beta_sigmoid=True)


def _batch(first, others, first_at_end=False):
    """`first`'s inputs with `others` (lengths) beside it, in one varlen batch: (inputs, lengths, its rows)."""
    x = _tokens(others, seed=7)
    parts = (x, first) if first_at_end else (first, x)
    inputs = tuple(torch.cat([p[i] for p in parts], 1) for i in range(5))
    lengths = [*others, L0] if first_at_end else [L0, *others]
    start = sum(others) if first_at_end else 0
    return inputs, lengths, slice(start, start + L0), (len(others) if first_at_end else 0)


def _chunk(inputs, gate_kw, lengths, host=True, **extra):
    cu = torch.tensor(bounds_of(lengths), dtype=torch.int32, device=DEVICE)
    return kda.chunk_kda(*inputs, cu_seqlens=cu, cu_seqlens_cpu=bounds_of(lengths) if host else None,
                         output_final_state=True, **gate_kw, **KW, **extra)


@pytest.mark.parametrize("beside", list(BESIDE))
@pytest.mark.parametrize("host", [True, False], ids=["host-bounds", "device-bounds"])
def test_chunk_sequence_bits_ignore_the_batch(beside, host):
    """A sequence of L0 tokens alone (as the dense call it equals) and beside others, first or last, with host
    bounds or not: its output rows and final state have the same bits."""
    first = _tokens([L0], seed=1)
    gate_kw = first[5]
    o_ref, s_ref = kda.chunk_kda(*first[:5], output_final_state=True, **gate_kw, **KW)
    for at_end in (False, True):
        inputs, lengths, rows, n = _batch(first, BESIDE[beside], at_end)
        o, s = _chunk(inputs, gate_kw, lengths, host)
        assert same_bits(o[:, rows], o_ref[0:1]), (beside, at_end)
        assert same_bits(s[n], s_ref[0]), (beside, at_end)


def test_chunk_short_sequence_bits_ignore_the_batch():
    """A short sequence (the recurrent loop's inside `chunk_kda`) alone, in a call of short sequences only, and
    beside a long one, with host bounds or not: the same bits."""
    short = 5
    first = _tokens([short], seed=2)
    gate_kw = first[5]
    o_ref, s_ref = kda.chunk_kda(*first[:5], output_final_state=True, **gate_kw, **KW)
    for others in ([1, 3], [L0], [0, 64, 2]):
        x = _tokens(others, seed=8)
        inputs = tuple(torch.cat([first[i], x[i]], 1) for i in range(5))
        for host in (True, False):
            o, s = _chunk(inputs, gate_kw, [short, *others], host)
            assert same_bits(o[:, :short], o_ref) and same_bits(s[0], s_ref[0]), (others, host)


@pytest.mark.parametrize("pieces", [[64, L0 - 64], [1024, L0 - 1024] if L0 > 1024 else [128, L0 - 128],
                                    [64, 128, L0 - 192]], ids=["64", "big", "three"])
def test_chunk_pieces_through_an_fp32_pool_equal_one_call(pieces):
    """A sequence prefilled in pieces whose lengths (all but the last, which is longer than `ChunkPlan.short_len`)
    are multiples of 64, its state carried in an fp32 pool slot between the calls (with another request's
    tokens beside it in each call), equals one call bitwise."""
    first = _tokens([L0], seed=3)
    gate_kw = first[5]
    o_ref, s_ref = kda.chunk_kda(*first[:5], output_final_state=True, **gate_kw, **KW)
    pool = torch.full((3, H, V, K), float("nan"), dtype=torch.float32, device=DEVICE)
    idx = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    start, outs = 0, []
    for j, n in enumerate(pieces):
        other = _tokens([37], seed=20 + j)
        inputs = tuple(torch.cat([first[i][:, start:start + n], other[i]], 1) for i in range(5))
        has = torch.tensor([j > 0, False], device=DEVICE)
        o, _ = kda.chunk_kda(*inputs, cu_seqlens=torch.tensor([0, n, n + 37], dtype=torch.int32, device=DEVICE),
                             cu_seqlens_cpu=[0, n, n + 37], state_cache=pool, state_indices=idx,
                             has_initial_state=has, state_v_first=True, **gate_kw, **KW)
        outs.append(o[:, :n])
        start += n
    assert same_bits(torch.cat(outs, 1), o_ref)
    assert same_bits(pool[1], s_ref[0].transpose(-1, -2).contiguous())  # the pool is V-first


@pytest.mark.parametrize("v_first", [True], ids=["v-first"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_sequence_bits_ignore_the_batch(v_first, dtype):
    """`fused_recurrent_kda`: a one-token step of a sequence through a V-first pool, in a call of one-token
    sequences with host bounds (the one-token kernel), without them, and beside a sequence of three tokens (the
    loop kernel): its output row and stored state have the same bits. (K-first pools: the one-token kernel's
    held forms sum in another order than the loop kernel's, docs/contract.md, "Batch invariance".)"""
    n_other = 3
    x = _tokens([1] * (n_other + 1), seed=4)
    gate_kw = x[5]
    gen = torch.Generator().manual_seed(5)
    plane = (H, V, K) if v_first else (H, K, V)
    pool0 = torch.randn((n_other + 2, *plane), generator=gen).to(DEVICE, dtype)
    idx = torch.arange(n_other + 1, dtype=torch.int32, device=DEVICE)
    extra = _tokens([2], seed=6)
    runs = []
    for j, host in ((None, True), (None, False), (3, True), (1, False)):  # j: the sequence given two more tokens
        lengths = [1] * (n_other + 1)
        inputs = x[:5]
        if j is not None:
            lengths[j] = 3
            inputs = tuple(torch.cat([x[i][:, :j + 1], extra[i], x[i][:, j + 1:]], 1) for i in range(5))
        pool = pool0.clone()
        cu = torch.tensor(bounds_of(lengths), dtype=torch.int32, device=DEVICE)
        o, _ = kda.fused_recurrent_kda(*inputs, cu_seqlens=cu, cu_seqlens_cpu=bounds_of(lengths) if host else None,
                                       state_cache=pool, state_indices=idx, state_v_first=v_first, **gate_kw, **KW)
        runs.append((o[:, 0], pool[0]))  # sequence 0: one token in every call
    for o, s in runs[1:]:
        assert same_bits(o, runs[0][0]) and same_bits(s, runs[0][1])

