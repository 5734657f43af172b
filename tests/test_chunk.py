"""`kda.chunk_kda` against the float64 oracle `kda_reference.recurrent_kda`, and its state contracts.

fp32 inputs must match to 1e-5 relative L2 (the kernels keep everything in fp32, the cumulative decay in
fp64); narrow inputs within max(2 x floor, floor + 4 x 2^-11) of the exact output (the rounding floor,
and the 11-bit intermediates: NARROW_STATE_TOL below)."""

from __future__ import annotations

import contextlib
import inspect
import itertools

import pytest
import torch
import triton
import triton.language as tl
from helpers import (
    bits,
    checked_call,
    make_inputs,
    on_cpu,
    poison_pool,
    rel_err,
    rounding_floor,
    run_chunk,
    run_planned,
    same_bits,
)
from triton.tools.tensor_descriptor import TensorDescriptor

import kda
import kda_reference as ref
from kda.accuracy.config import KERNEL_FP32_TERM, KERNEL_NARROW_TERM
from kda.accuracy.prefill import kernel_bound
from kda.ops import overlap
from kda.ops.chunk import _v_tiles
from kda.ops.common import tf32_round
from kda.ops.overlap import counted_after
from kda.plan import chunk_plan

FP32_TOL = 1e-5
# With bf16/fp16 inputs (and q, k normalised in the kernel) the intermediates keep an 11-bit significand:
# the GPU's tf32 dots (kda.plan.dot_precision) and, on every device, the fp16 workspaces
# (kda.plan.workspace_dtype); unit roundoff 2^-11, carried through a few chained products. The
# accuracy harness's kernel bound is this same criterion (kda/accuracy/config.py).
NARROW_STATE_TOL = KERNEL_NARROW_TERM
assert FP32_TOL == KERNEL_FP32_TERM


def _both(kwargs, q, k, v, g, beta):
    """The kernel's answer and the float64 oracle's, for the same call."""
    o, s = kda.chunk_kda(q, k, v, g, beta, **kwargs)
    ro, rs = ref.recurrent_kda(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), **on_cpu(kwargs))
    return o, s, ro, rs


CASES = [
    # B, T, H, HV, K, V, gate, l2norm, beta_sigmoid
    (1, 1, 1, 1, 16, 16, "logdecay", False, False),
    (2, 63, 1, 2, 16, 32, "lower_bound", True, True),
    (1, 65, 2, 2, 7, 48, "softplus", True, False),
    (2, 130, 1, 1, 32, 5, "lower_bound", False, True),
    (1, 70, 1, 3, 48, 16, "logdecay", True, True),
    (1, 20, 1, 1, 256, 256, "lower_bound", True, False),  # the largest head dims of the contract
    (1, 17, 1, 1, 1, 1, "logdecay", False, False),  # and the smallest
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}HV{}K{}V{}-{}-l2{}-bs{}".format(*c))
@pytest.mark.parametrize("state", ["none", "kfirst", "vfirst"])
def test_fp32_matches_oracle(case, state, device):
    B, T, H, HV, K, V, gate, l2, bs = case
    q, k, v, g, beta, kw = make_inputs(B, T, H, HV, K, V, gate=gate, device=device, seed=T + K,
                                       normalize_k=not l2, beta_logits=bs)
    kw.update(use_qk_l2norm_in_kernel=l2, use_beta_sigmoid_in_kernel=bs, output_final_state=True)
    if state != "none":
        vf = state == "vfirst"
        plane = (HV, V, K) if vf else (HV, K, V)
        kw.update(initial_state=torch.randn(B, *plane).to(device), state_v_first=vf)
    o, s, ro, rs = _both(kw, q, k, v, g, beta)
    assert o.dtype == v.dtype and s.dtype == torch.float32
    assert rel_err(o, ro) < FP32_TOL
    assert rel_err(s, rs) < FP32_TOL


@pytest.mark.parametrize("bounds", [[0, 64, 64, 128], [0, 0, 64], [0, 0, 0], [0, 1, 1, 1, 66, 67],
                                    [0, 0, 5, 70, 70]])
def test_varlen_with_empty_sequences(bounds, device):
    T, H, HV, K, V = bounds[-1], 1, 2, 16, 16
    N = len(bounds) - 1
    q, k, v, g, beta, kw = make_inputs(1, T, H, HV, K, V, gate="lower_bound", device=device, seed=N)
    h0 = torch.randn(N, HV, K, V).to(device)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    o, s, ro, rs = _both(dict(kw, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                              cu_seqlens_cpu=torch.tensor(bounds)), q, k, v, g, beta)
    if T:
        assert rel_err(o, ro) < FP32_TOL
    assert rel_err(s, rs) < FP32_TOL
    for n in range(N):
        if bounds[n] == bounds[n + 1]:  # an empty sequence keeps its state bit for bit
            assert torch.equal(bits(s[n]), bits(h0[n]))


def test_strong_decay_and_correlated_keys(device):
    B, T, H, HV, K, V = 1, 100, 1, 1, 32, 8
    q, k, v, g, beta, _ = make_inputs(B, T, H, HV, K, V, device=device, seed=3)
    g = g.clone()
    g[:, ::7, :, ::3] = -1000.0  # a raw log-decay of -1000 on a third of the channels
    o, s, ro, rs = _both(dict(output_final_state=True), q, k, v, g, beta)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, ro) < FP32_TOL and rel_err(s, rs) < FP32_TOL
    # correlated keys, beta near 1, weak decay: (I + A_kk) is ill-conditioned
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(K, generator=gen)
    k = torch.nn.functional.normalize(base + 0.01 * torch.randn(B, T, H, K, generator=gen), dim=-1).to(device)
    g = torch.full((B, T, HV, K), -0.01, device=device)
    beta = torch.full((B, T, HV), 0.99, device=device)
    o, s, ro, rs = _both(dict(output_final_state=True), q, k, v, g, beta)
    assert rel_err(o, ro) < FP32_TOL and rel_err(s, rs) < FP32_TOL


@pytest.mark.parametrize("keys", ["random", "correlated"])
def test_tf32_prepare_against_float64(keys, device):
    """The fused prepare as the GPU runs it for 16-bit inputs (tf32 dots: the inverse's diagonal blocks by their
    series, every merge and fold computed transposed, `chunk_prepare._unit_lower_inverse_t`), forced on fp32
    inputs, against the float64 oracle: within a few tf32 roundings (2^-11 each; a wrong block or merge of the
    inverse errs by O(1)), with random keys and with correlated keys and beta near 1 (an ill-conditioned
    I + A_kk). The interpreter's other tests take the ieee path, whose inverse starts from forward
    substitution."""
    B, T, H, HV, K, V = 1, 150, 1, 1, 32, 16
    q, k, v, g, beta, kw = make_inputs(B, T, H, HV, K, V, gate="lower_bound", device=device, seed=3)
    kw.update(use_qk_l2norm_in_kernel=True)
    if keys == "correlated":
        gen = torch.Generator().manual_seed(4)
        base = torch.randn(K, generator=gen)
        k = torch.nn.functional.normalize(base + 0.01 * torch.randn(B, T, H, K, generator=gen), dim=-1).to(device)
        beta = torch.full((B, T, HV), 0.99, device=device)
    o, s, plan = run_planned(kda.chunk_kda, q, k, v, g, beta, dict(dot_prec="tf32"), output_final_state=True, **kw)
    assert plan.prepare == "fused" and plan.dot_prec == "tf32"
    ro, rs = ref.recurrent_kda(*(x.cpu() for x in (q, k, v, g, beta)), output_final_state=True, **on_cpu(kw))
    bound = 4 * 2.0 ** -11
    assert rel_err(o, ro) < bound and rel_err(s, rs) < bound


@pytest.mark.parametrize("lower_bound", [-5.0, -5.2])
@pytest.mark.parametrize("keys", ["random", "correlated"])
@pytest.mark.parametrize("K", [32, 100])
def test_bounded_gate_prepare_forms(lower_bound, keys, K, device):
    """The lower-bound gate saturated at lb, where each 32-row half of a chunk spans 16 lb log2(e) log2 units
    around its anchor: 115.4 at lb = -5, inside the fused prepare's 2^118, so it is the default; 120 at
    -5.2, past it, so the split prepare (pairwise diagonal) is. Random or correlated keys with beta near 1;
    K = 100 takes two K slices of the fused kernel. Both forms within 1e-5 of the oracle and of each other."""
    B, T, H, HV, V = 1, 90, 1, 1, 8
    q, k, v, g, beta, kw = make_inputs(B, T, H, HV, K, V, gate="lower_bound", device=device, seed=9)
    kw.update(lower_bound=lower_bound, use_qk_l2norm_in_kernel=True, output_final_state=True)
    g = g + 12.0  # sigmoid(a (x + dt_bias)) ~ 1: every token decays by about lb
    if keys == "correlated":
        gen = torch.Generator().manual_seed(10)
        base = torch.randn(K, generator=gen)
        k = (base + 0.01 * torch.randn(B, T, H, K, generator=gen)).to(device)
        beta = torch.full((B, T, HV), 0.99, device=device)
    ro, rs = ref.recurrent_kda(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), **on_cpu(kw))
    runs = {}
    for form in ("fused", "split"):
        o, s, plan = run_planned(kda.chunk_kda, q, k, v, g, beta, dict(prepare=form), **kw)
        default = chunk_plan(checked_call(kda.chunk_kda, q, k, v, g, beta, **kw))
        assert plan.prepare == form
        assert default.prepare == ("fused" if lower_bound == -5.0 else "split")
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
        assert rel_err(o, ro) < FP32_TOL and rel_err(s, rs) < FP32_TOL
        runs[form] = (o, s)
    assert rel_err(runs["fused"][0], runs["split"][0]) < FP32_TOL
    assert rel_err(runs["fused"][1], runs["split"][1]) < FP32_TOL


def test_gate_pass_equals_the_in_kernel_cumsum(device):
    """16-bit inputs: the fused prepare reading b2 from `_chunk_gate_kernel` (anchor rows clamped to the last
    row of a short chunk) against the same prepare taking the fp32 cumsum itself, over varlen sequences with
    partial chunks and an empty one, and the gate pass at two K slicings. They differ only in rounding order:
    within the output's own rounding."""
    bounds = [0, 70, 70, 117, 200]
    q, k, v, g, beta, kw = make_inputs(1, bounds[-1], 2, 2, 64, 32, dtype=torch.bfloat16, gate="lower_bound",
                                       device=device, seed=12)
    kw.update(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, output_final_state=True,
              cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device))
    ro, rs = ref.recurrent_kda(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), **on_cpu(kw))
    o1, s1, p1 = run_planned(kda.chunk_kda, q, k, v, g, beta,
                             dict(cumsum_fp64=False, gate_pass=True, gate_BK=64, gate_warps=2), **kw)
    o2, s2, p2 = run_planned(kda.chunk_kda, q, k, v, g, beta, dict(cumsum_fp64=False, gate_pass=False), **kw)
    # the gate pass over narrower K slices on more warps (its cumsum order may differ on a GPU)
    o3, s3, p3 = run_planned(kda.chunk_kda, q, k, v, g, beta,
                             dict(cumsum_fp64=False, gate_pass=True, gate_BK=16, gate_warps=4), **kw)
    assert p1.prepare == p2.prepare == "fused" and p1.gate_pass and not p2.gate_pass
    floor = rounding_floor(ro, torch.bfloat16)
    assert rel_err(o1, o2) <= floor and rel_err(s1, s2) < NARROW_STATE_TOL / 10
    assert rel_err(o1, o3) <= floor and rel_err(s1, s3) < NARROW_STATE_TOL / 10
    assert rel_err(o1, ro) <= kernel_bound(floor, torch.bfloat16) and rel_err(s1, rs) < NARROW_STATE_TOL


@pytest.mark.parametrize("late", [1, 3, 5])
def test_prepare_in_two_launches_equals_one(late, device):
    """The fused prepare launched as two grids (`ChunkPlan.late_chunks`: the last `late` chunk programs second,
    so that the walk beside it can start after the first) stores the same workspaces: the call's output and
    final state bit for bit those of one launch, dense (B = 1, a partial last chunk) and over varlen chunks
    with an empty sequence; late >= the chunk count leaves one chunk in the first launch."""
    for bounds in (None, [0, 70, 70, 200, 300]):
        T = 300 if bounds is None else bounds[-1]
        q, k, v, g, beta, kw = make_inputs(1, T, 2, 2, 32, 16, dtype=torch.bfloat16, gate="lower_bound",
                                           device=device, seed=13)
        kw.update(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, output_final_state=True)
        if bounds is not None:
            kw["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32, device=device)
        base = dict(cumsum_fp64=False, gate_pass=True, short_len=0)
        o1, s1, p1 = run_planned(kda.chunk_kda, q, k, v, g, beta, base, **kw)
        o2, s2, p2 = run_planned(kda.chunk_kda, q, k, v, g, beta, dict(base, late_chunks=late), **kw)
        assert p1.prepare == p2.prepare == "fused" and p1.late_chunks == 0 and p2.late_chunks == late
        assert torch.equal(bits(o1), bits(o2)) and torch.equal(bits(s1), bits(s2))


@pytest.mark.parametrize("dtype,over,host", [(torch.float32, {}, False), (torch.bfloat16, {}, False),
                                             (torch.bfloat16, dict(cumsum_fp64=False, gate_pass=True), False),
                                             (torch.bfloat16, {}, True)])
def test_one_token_chunks_against_float64(dtype, over, host, device):
    """Chunks of one token (one-token sequences in a varlen batch without host bounds, so that none is routed to
    the recurrent loop; 65-token sequences, whose last chunk holds one token) take the fused prepare's
    dot-free form (`chunk_prepare._one_row_chunk`): every such sequence's output rows and final state
    against the float64 oracle, each on its own (a wrong M, N, scale or decay there errs by O(1)), with fp32
    workspaces (fp32 inputs), fp16 ones (bf16 inputs), b2 from the gate pass, and with host bounds (the
    one-token sequences routed to the recurrent loop, the prepare's grid holding only the others' chunks)."""
    bounds = [0, 1, 2, 67, 68, 68, 133, 134]
    T, H, HV, K, V, N = bounds[-1], 1, 2, 32, 16, len(bounds) - 1
    q, k, v, g, beta, kw = make_inputs(1, T, H, HV, K, V, dtype=dtype, gate="lower_bound", device=device,
                                       seed=31, beta_sigmoid=True)
    h0 = torch.randn(N, HV, K, V, generator=torch.Generator().manual_seed(5)).to(device)
    kw.update(use_qk_l2norm_in_kernel=True, initial_state=h0, output_final_state=True,
              cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device))
    if host:
        kw["cu_seqlens_cpu"] = bounds
    o, s, plan = run_planned(kda.chunk_kda, q, k, v, g, beta, over, **kw)
    assert plan.prepare == "fused" and (plan.gate_pass or not over)  # a GPU takes the gate pass for bf16 anyway
    ro, rs = ref.recurrent_kda(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), **on_cpu(kw))
    for n in range(N):
        lo, hi = bounds[n], bounds[n + 1]
        if dtype == torch.float32:
            o_tol, s_tol = FP32_TOL, FP32_TOL
        else:
            o_tol = kernel_bound(rounding_floor(ro[:, lo:hi], dtype), dtype) if hi > lo else 0.0
            s_tol = NARROW_STATE_TOL
        assert rel_err(o[:, lo:hi], ro[:, lo:hi]) <= o_tol, n
        assert rel_err(s[n], rs[n]) < s_tol, n
    # the tokens alone in their chunk: the last of each 65-token sequence, and the one-token sequences
    for t in (0, 1, 66, 67, 132, 133):
        row_tol = FP32_TOL if dtype == torch.float32 else 8 * 2.0 ** -8
        assert rel_err(o[:, t], ro[:, t]) < row_tol, t


@pytest.mark.parametrize("wait,in_loop", [(0, False), pytest.param(2, True, marks=pytest.mark.hopper_plan)])
def test_walk_applying_the_inverse_against_float64(wait, in_loop, device):
    """`ChunkPlan.fold` off (the prepare stores Xb, A_qk and Kr; the walk forms U = Xb D): bf16 inputs with Kimi's
    gate against the float64 oracle at the bf16 bound, a dense call whose last chunk holds one token (the prepare's
    dot-free form) and a paged call with checkpoints, by the walk after the prepare and beside it (the counters
    awaited inside the walk's loop), against the folded form to the same bound."""
    T, H, HV, K, V = 193, 1, 2, 32, 32
    q, k, v, g, beta, kw = make_inputs(1, T, H, HV, K, V, dtype=torch.bfloat16, gate="lower_bound", device=device,
                                       seed=41, beta_sigmoid=True)
    kw.update(use_qk_l2norm_in_kernel=True)
    h0 = 0.1 * torch.randn(1, HV, K, V, generator=torch.Generator().manual_seed(3)).to(device)
    ro, rs = ref.recurrent_kda(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), initial_state=h0.cpu(),
                               output_final_state=True, **on_cpu(kw))
    o_tol = kernel_bound(rounding_floor(ro, torch.bfloat16), torch.bfloat16)
    runs = {}
    for fold in (True, False):
        over = dict(fold=fold, wait_chunks=wait, wait_in_loop=in_loop, gate_pass=True)
        o, s, plan = run_planned(kda.chunk_kda, q, k, v, g, beta, over, initial_state=h0, output_final_state=True,
                                 **kw)
        assert plan.fold == fold and plan.ws_dtype == torch.float16
        assert rel_err(o, ro) <= o_tol and rel_err(s, rs) < NARROW_STATE_TOL, fold
        pool = poison_pool(5, (HV, K, V), torch.float32, device)
        pool[1] = h0[0]
        before = pool.clone()
        o_p, _, _ = run_planned(kda.chunk_kda, q, k, v, g, beta, over, state_cache=pool,
                                state_indices=torch.tensor([1], dtype=torch.int32, device=device),
                                has_initial_state=torch.tensor([True], device=device), state_v_first=False,
                                checkpoint_every=128, checkpoint_indices=torch.tensor([[3]], dtype=torch.int32,
                                                                                      device=device), **kw)
        assert torch.equal(bits(o_p), bits(o)) and torch.equal(bits(pool[1]), bits(s[0]))
        for other in (0, 2, 4):
            assert torch.equal(bits(pool[other]), bits(before[other]))
        _, cs = ref.recurrent_kda(q[:, :128].cpu(), k[:, :128].cpu(), v[:, :128].cpu(), g[:, :128].cpu(),
                                  beta[:, :128].cpu(), initial_state=h0.cpu(), output_final_state=True, **on_cpu(kw))
        assert rel_err(pool[3], cs[0]) < NARROW_STATE_TOL
        runs[fold] = (o, s)
    assert rel_err(runs[False][0], runs[True][0]) <= o_tol
    assert rel_err(runs[False][1], runs[True][1]) < NARROW_STATE_TOL


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16])
def test_paged_equals_dense_and_leaves_other_slots(v_first, storage, device):
    """Paged equals dense bit for bit in the chunk kernels at a slot stride that is no multiple of 16 (every
    sequence longer than the recurrent loop's: docs/contract.md, "State storage")."""
    bounds = [0, 20, 20, 90, 110]
    T, H, HV, K, V = bounds[-1], 1, 2, 16, 32
    N, slots = len(bounds) - 1, 9
    q, k, v, g, beta, kw = make_inputs(1, T, H, HV, K, V, gate="lower_bound", device=device, seed=7)
    plane = (HV, V, K) if v_first else (HV, K, V)
    pool = poison_pool(slots, plane, storage, device, pad=5)
    assert pool.stride(0) > pool[0].numel()
    idx = torch.tensor([6, 2, -1, 3], dtype=torch.int32, device=device)  # sequence 2 is padding
    has = torch.tensor([True, False, True, True], device=device)  # slot 2 holds NaN and is not read
    live = [0, 3]
    init = torch.randn(len(live), *plane).to(storage).to(device)
    for j, n in enumerate(live):
        pool[idx[n]] = init[j]
    before = pool.clone()
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    out = torch.full((1, T, HV, V), float("nan"), device=device)
    o, s = kda.chunk_kda(q, k, v, g, beta, state_cache=pool, state_indices=idx, has_initial_state=has,
                         cu_seqlens=cu, state_v_first=v_first, out=out, **kw)
    assert s is None and o.data_ptr() == out.data_ptr()
    # the same call through the dense contract, slot rows gathered by hand
    dense_init = torch.zeros(N, *plane, dtype=storage, device=device)
    for n in live:
        dense_init[n] = before[idx[n]]
    od, sd = kda.chunk_kda(q, k, v, g, beta, initial_state=dense_init, output_final_state=True,
                           cu_seqlens=cu, state_v_first=v_first, **kw)
    pad_rows = slice(bounds[2], bounds[3])
    assert torch.equal(o[:, pad_rows], torch.zeros_like(o[:, pad_rows]))  # padding: zero output rows
    real = torch.cat([torch.arange(bounds[0], bounds[2]), torch.arange(bounds[3], bounds[4])])
    assert torch.equal(bits(o[:, real]), bits(od[:, real]))
    for n in (0, 1, 3):
        assert torch.equal(bits(pool[idx[n]]), bits(sd[n]))
    touched = {int(idx[n]) for n in (0, 1, 3)}
    for slot in range(slots):
        if slot not in touched:
            assert torch.equal(bits(pool[slot]), bits(before[slot]))
    # and against the oracle (padding sequence removed)
    ro, rs = ref.recurrent_kda(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(),
                               initial_state=dense_init.cpu().double(), allow_float64=True,
                               output_final_state=True, cu_seqlens=cu.cpu(), state_v_first=v_first,
                               **on_cpu(kw))
    assert rel_err(o[:, real], ro[:, real]) < FP32_TOL
    for n in (0, 1, 3):
        tol = FP32_TOL if storage == torch.float32 else torch.finfo(storage).eps
        assert rel_err(pool[idx[n]], rs[n]) < tol


@pytest.mark.parametrize("storage", [torch.float16, torch.bfloat16])
def test_narrow_state_rounds_once_on_store(storage, device):
    B, T, H, HV, K, V = 2, 40, 1, 1, 16, 16
    q, k, v, g, beta, kw = make_inputs(B, T, H, HV, K, V, gate="lower_bound", device=device, seed=11)
    h0 = torch.randn(B, HV, K, V).to(storage).to(device)
    o, s = kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    assert s.dtype == storage
    ro, rs = ref.recurrent_kda(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(),
                               initial_state=h0.cpu().double(), output_final_state=True, allow_float64=True,
                               **on_cpu(kw))
    assert rel_err(o, ro) < FP32_TOL  # the state is read once (exact upcast) and accumulated in fp32
    # the stored state is the fp32 result rounded to nearest: within half an ulp plus the fp32 error
    eps = torch.finfo(storage).eps
    err = (s.double().cpu() - rs).abs()
    assert (err <= 0.5 * eps * rs.abs() + 1e-5 * rs.abs().max()).all()
    # a call with no initial state but state_dtype gives the same dtype
    _, s2 = kda.chunk_kda(q, k, v, g, beta, output_final_state=True, state_dtype=storage, **kw)
    assert s2.dtype == storage


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])  # the fused prepare, the split one
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_inputs_within_rounding_floor(dtype, gate, device):
    B, T, H, HV, K, V = 1, 96, 2, 2, 32, 32
    q, k, v, g, beta, kw = make_inputs(B, T, H, HV, K, V, dtype=dtype, gate=gate, device=device, seed=5)
    kw.update(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    o, s, ro, rs = _both(dict(kw, output_final_state=True), q, k, v, g, beta)
    floor = rounding_floor(ro, dtype)
    assert o.dtype == dtype
    # The output's own rounding (the floor) on top of the 11-bit intermediates (the state's tolerance): the
    # harness's kernel bound, max(2 floor, floor + NARROW_STATE_TOL); for fp16 the two are of one size
    # (measured on the H200: 1.2e-3 against a floor of 2.1e-4), for bf16 the floor dominates.
    assert rel_err(o, ro) <= kernel_bound(floor, dtype)
    assert rel_err(s, rs) < NARROW_STATE_TOL  # the fp32 state: no rounding of its own beyond the dots


@pytest.mark.parametrize("regime", ["state_dominates", "values_dominate", "ill_conditioned", "small_inverse"])
def test_fp16_walk_scales_u_within_range(regime, device):
    """With 16-bit inputs and in-kernel l2norm the walk's dots take fp16 operands, D = V - Kd S scaled by a
    power of two from a bound (max|V| + sqrt(K) times S's bound), not from D itself, and M = Xb^T Kr,
    N = A_qk Xb stored times a power of two per chunk (Xb = X diag(beta) is unbounded): if a term of D's
    bound were missing or short, or M, N unscaled, a scaled operand would pass fp16's 65504 and turn inf.
    Four regimes at extreme magnitudes (a large initial state with tiny values, so D is -Kd S; huge values
    with no state, so D is V; correlated keys with beta near 1, so the inverse, and M and N, are large;
    beta near 1e-6, so M and N lie below fp16's normal range and keep their significand only scaled: stored
    unscaled, the output's error was 0.66); every output and state finite and within the narrow-input bound
    of the oracle."""
    B, T, H, HV, K, V = 1, 192, 1, 1, 32, 32
    q, k, v, g, beta, kw = make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16, gate="lower_bound",
                                       device=device, seed=31)
    kw.update(use_qk_l2norm_in_kernel=True)
    gen = torch.Generator().manual_seed(32)
    h0 = torch.randn(B, HV, K, V, generator=gen)
    if regime == "state_dominates":
        h0, v = 3e4 * h0, (v.float() * 1e-3).to(v.dtype)
    elif regime == "values_dominate":
        h0, v = 0 * h0, (v.float() * 3e4).to(v.dtype)
    elif regime == "ill_conditioned":
        base = torch.randn(K, generator=gen)
        k = (base + 0.01 * torch.randn(B, T, H, K, generator=gen)).to(device, k.dtype)
        beta = torch.full((B, T, HV), 0.99, device=device)
        v = (v.float() * 100).to(v.dtype)
    else:
        h0, beta = 0 * h0, beta * 1e-6
    o, s, ro, rs = _both(dict(kw, initial_state=h0.to(device), output_final_state=True), q, k, v, g, beta)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, ro) <= kernel_bound(rounding_floor(ro, torch.bfloat16), torch.bfloat16)
    assert rel_err(s, rs) < NARROW_STATE_TOL


@pytest.mark.parametrize("prepare", ["fused", "split"])
def test_max_v_of_every_v_slice_bounds_d(prepare, device):
    """max|V| per chunk, the term of D's fp16 scale that either prepare form reduces from V in column slices
    (`chunk_prepare._store_folded`; V = 48: a second slice of 32 columns masked past V): one value at 3e4
    in V's last column, the rest near 1, no initial state. A slice or column left out of the maximum would
    scale D for values near 1 and turn that entry inf."""
    B, T, H, HV, K, V = 1, 130, 1, 1, 64, 48
    q, k, v, g, beta, kw = make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16, gate="lower_bound",
                                       device=device, seed=33)
    kw.update(use_qk_l2norm_in_kernel=True, output_final_state=True)
    v = v.clone()
    v[0, 70, 0, V - 1] = 3e4  # in the second chunk
    ro, rs = ref.recurrent_kda(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), **on_cpu(kw))
    o, s, plan = run_planned(kda.chunk_kda, q, k, v, g, beta, dict(prepare=prepare), **kw)
    assert plan.prepare == prepare and plan.ws_dtype == torch.float16
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, ro) <= kernel_bound(rounding_floor(ro, torch.bfloat16), torch.bfloat16)
    assert rel_err(s, rs) < NARROW_STATE_TOL


def test_out_is_written_in_place_and_equals_fresh_output(device):
    q, k, v, g, beta, kw = make_inputs(2, 33, 1, 1, 16, 16, device=device, seed=2)
    o1, _ = kda.chunk_kda(q, k, v, g, beta, **kw)
    out = torch.full_like(o1, float("nan"))
    o2, _ = kda.chunk_kda(q, k, v, g, beta, out=out, **kw)
    assert o2.data_ptr() == out.data_ptr()
    assert torch.equal(bits(o1), bits(out))


def test_strided_inputs_from_a_fused_projection(device):
    """q, k, v as views into one [B, T, 3, H, D] projection: used in place, no copy."""
    B, T, H, D = 2, 20, 2, 16
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(B, T, 3, H, D, generator=gen).to(device)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    g = (-torch.rand(B, T, H, D, generator=gen) * 0.3).to(device)
    beta = torch.rand(B, T, H, 2, generator=gen).to(device)[..., 0]  # strided beta
    o, s, ro, rs = _both(dict(output_final_state=True, use_qk_l2norm_in_kernel=True), q, k, v, g, beta)
    assert rel_err(o, ro) < FP32_TOL and rel_err(s, rs) < FP32_TOL


def test_single_token_batch_sliced_from_a_longer_buffer(device):
    """B > 1, T == 1: stride(1) is free (a [B, 1, ...] slice); the token axis strides by stride(0)."""
    gen = torch.Generator().manual_seed(12)
    B, H, K, V = 3, 1, 16, 16
    buf = torch.randn(B, 5, 3, H, K, generator=gen).to(device)
    q, k, v = buf[:, 2:3, 0], buf[:, 2:3, 1], buf[:, 2:3, 2]
    g = (-torch.rand(B, 4, H, K, generator=gen) * 0.5).to(device)[:, 1:2]
    beta = torch.rand(B, 4, H, generator=gen).to(device)[:, 3:4]
    h0 = torch.randn(B, H, K, V, generator=gen).to(device)
    o, s, ro, rs = _both(dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True),
                         q, k, v, g, beta)
    assert rel_err(o, ro) < FP32_TOL and rel_err(s, rs) < FP32_TOL


def test_prepare_with_varlen_gva_and_odd_sizes(device):
    """Empty and one-token sequences, GVA (HV = 2H), K and V not powers of two, raw beta and k."""
    bounds = [0, 0, 64, 65, 150]
    q, k, v, g, beta, kw = make_inputs(1, 150, 2, 4, 48, 40, gate="lower_bound", device=device, seed=21,
                                       normalize_k=False, beta_logits=True)
    kw.update(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, output_final_state=True,
              cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device),
              initial_state=torch.randn(4, 4, 48, 40).to(device))
    o, s, ro, rs = _both(kw, q, k, v, g, beta)
    assert rel_err(o, ro) < FP32_TOL and rel_err(s, rs) < FP32_TOL


def test_a_slot_past_the_pool_makes_a_no_op_sequence(device):
    """The kernels' guard for what the host does not read without KDA_DEBUG: the call is validated with good
    slots, then sequence 1's slot is overwritten with one past the pool before the launch. That sequence
    becomes a no-op (zero output rows, no state read or written, the storage past the pool keeps its bits);
    sequence 0 and its slot are exactly as in the good call."""
    import dataclasses


    H, HV, K, V = 1, 2, 16, 16
    bounds = [0, 150, 300]
    q, k, v, g, beta, kw = make_inputs(1, 300, H, HV, K, V, gate="lower_bound", device=device, seed=41)
    storage = poison_pool(6, (HV, K, V), torch.float32, device)
    for s in (0, 1):
        storage[s] = torch.randn(HV, K, V).to(device)
    pool = storage[:4]
    kw.update(cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device), state_cache=pool,
              state_indices=torch.tensor([0, 1], dtype=torch.int32, device=device), state_v_first=False,
              has_initial_state=torch.ones(2, dtype=torch.bool, device=device), use_qk_l2norm_in_kernel=True)
    runs = {}
    for bad in (False, True):
        before = storage.clone()
        call = checked_call(kda.chunk_kda, q, k, v, g, beta, **kw)
        if bad:
            call = dataclasses.replace(call, state_indices=torch.tensor([0, 5], dtype=torch.int32, device=device))
        o, _ = run_chunk(call)
        runs[bad] = (o, storage.clone())
        storage.copy_(before)
    (o_good, s_good), (o_bad, s_bad) = runs[False], runs[True]
    assert bits(o_bad[:, :150]).equal(bits(o_good[:, :150])) and bits(s_bad[0]).equal(bits(s_good[0]))
    assert bool((o_bad[:, 150:] == 0).all())
    assert bits(s_bad[1:]).equal(bits(storage[1:]))  # slot 1 unread and unwritten; slots 4, 5 past the pool


@pytest.mark.parametrize("fn", [kda.chunk_kda, kda.fused_recurrent_kda], ids=["chunk", "recurrent"])
def test_gate_parameter_forms(fn, device):
    """dt_bias as [HV, K] equals [HV * K]; A_log and dt_bias left out mean exp(A_log) = 1 and no bias."""
    q, k, v, g, beta, kw = make_inputs(1, 40, 1, 2, 16, 16, gate="lower_bound", device=device, seed=41)
    o_flat, _ = fn(q, k, v, g, beta, **kw)
    o_2d, _ = fn(q, k, v, g, beta, **dict(kw, dt_bias=kw["dt_bias"].view(2, 16)))
    assert torch.equal(bits(o_flat), bits(o_2d))
    for gate_kw in (dict(use_gate_in_kernel=True), dict(use_gate_in_kernel=True, lower_bound=-3.0)):
        o, _ = fn(q, k, v, g, beta, **gate_kw)
        ro, _ = ref.recurrent_kda(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), **gate_kw)
        assert rel_err(o, ro) < FP32_TOL


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, PREC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tf32_round(tl.load(x_ptr + offs, mask=m), PREC), mask=m)


def test_tf32_round_is_round_to_nearest(device):
    """`kda.ops.common.tf32_round`, through which every fp32 operand of a tf32 dot goes on the GPU: the value
    rounded to 11 significant bits (tf32's 10 stored and the implicit one), ties away from zero, against a
    float64 reference; values on exact ties and just beside them included. Under "ieee" it is the identity."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(1000, generator=gen) * torch.exp2(torch.randint(-60, 60, (1000,), generator=gen).float())
    ulp = torch.exp2(torch.floor(torch.log2(base.abs())) - 10)  # tf32's last place at each value
    tie = (torch.round(base / ulp) + 0.5) * ulp  # exactly half way between two tf32 values
    x = torch.cat([base, tie, torch.nextafter(tie, torch.zeros_like(tie)), torch.tensor([0.0, -0.0, 1.0])])
    x = x.float()
    mant, expo = torch.frexp(x.double())
    ref = torch.copysign(torch.ldexp(torch.floor(mant.abs() * 2048 + 0.5) / 2048, expo), x.double()).float()
    for prec, want in (("tf32", ref), ("ieee", x)):
        y = torch.full_like(x, float("nan"), device=device)
        _round_kernel[(1,)](x.to(device), y, x.numel(), PREC=prec, BLOCK=triton.next_power_of_2(x.numel()))
        assert torch.equal(bits(y), bits(want))


@pytest.mark.parametrize("gate", ["lower_bound", "logdecay"])  # the fused prepare, the split one
def test_mixed_batch_routes_short_sequences_through_the_recurrent_loop(gate, device):
    """A serving step in one call: decodes (1 token), short continuations (3, 16) and longer chunks (17, 70),
    an empty sequence and a padding slot, host bounds given. Sequences of 1..`short_len` tokens go through
    the recurrent loop kernel (`kda.plan.Route`), the rest through the chunk kernels: against the
    oracle, against the same call with nothing routed, slots not named untouched, no error bit."""
    bounds = [0, 1, 71, 71, 74, 75, 91, 108, 109]
    # lengths 1, 70, 0, 3, 1, 16, 17, 1
    T, H, HV, K, V, N = bounds[-1], 1, 2, 16, 16, len(bounds) - 1
    q, k, v, g, beta, kw = make_inputs(1, T, H, HV, K, V, gate=gate, device=device, seed=41)
    pool0 = poison_pool(12, (HV, K, V), torch.float32, device)
    idx = torch.tensor([3, 1, 0, -1, 7, 5, 2, 9], dtype=torch.int32, device=device)  # sequence 3: padding
    has = torch.tensor([True, False, True, True, True, True, False, True], device=device)
    for n in range(N):
        if idx[n] >= 0 and has[n]:
            pool0[idx[n]] = torch.randn(HV, K, V, generator=torch.Generator().manual_seed(n)).to(device)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    args = dict(cu_seqlens=cu, cu_seqlens_cpu=bounds, state_indices=idx, has_initial_state=has,
                state_v_first=False, **kw)
    call = checked_call(kda.chunk_kda, q, k, v, g, beta, state_cache=pool0, **args)
    plan = chunk_plan(call)
    # 70, 0 and 17 tokens kept: 2 + 0 + 1 chunks
    assert kda.plan.route(call, plan)[:3] == (plan.short_len, 3, 3) and plan.short_len >= 16
    results = {}
    for short_len in (plan.short_len, 0):
        pool = pool0.clone()
        errors = torch.zeros(N, dtype=torch.int32, device=device)
        o, _, _ = run_planned(kda.chunk_kda, q, k, v, g, beta, dict(short_len=short_len), state_cache=pool,
                              errors=errors, **args)
        assert not errors.any()
        results[short_len] = (o, pool)
    (o, pool), (o_off, pool_off) = results[plan.short_len], results[0]
    real = [t for n in range(N) if idx[n] >= 0 for t in range(bounds[n], bounds[n + 1])]
    assert rel_err(o[:, real], o_off[:, real]) < FP32_TOL
    assert torch.equal(o[:, bounds[3]:bounds[4]], torch.zeros_like(o[:, bounds[3]:bounds[4]]))
    init = torch.stack([pool0[idx[n]] if (idx[n] >= 0 and has[n]) else torch.zeros_like(pool0[0])
                        for n in range(N)])
    ro, rs = ref.recurrent_kda(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), initial_state=init.cpu().double(),
                               output_final_state=True, cu_seqlens=cu.cpu(), allow_float64=True, **on_cpu(kw))
    assert rel_err(o[:, real], ro[:, real]) < FP32_TOL
    for n in range(N):
        if idx[n] >= 0:
            assert rel_err(pool[idx[n]], rs[n]) < FP32_TOL and rel_err(pool_off[idx[n]], rs[n]) < FP32_TOL
    named = {int(s) for s in idx if s >= 0}
    for slot in range(pool0.shape[0]):
        if slot not in named:
            assert torch.equal(bits(pool[slot]), bits(pool0[slot]))


@pytest.mark.parametrize("bounds,host,expect", [  # (routed, kept sequences, their chunks; None: the full grid)
    ([0, 1, 2, 3], True, (True, 0, 0)),        # a decode batch: the recurrent loop alone
    ([0, 1, 2, 3], False, (True, 3, None)),    # no host bounds: routed on the device over the full grids
    ([0, 100, 200], True, (False, 2, None)),   # long sequences only
    ([0, 100, 200], False, (True, 2, None)),
    ([0, 0, 100], True, (False, 2, None)),     # an empty one and a long one
    ([0, 0, 5], True, (True, 1, 0)),           # an empty one stays the walk's (it copies its state)
    ([0, 5, 100], True, (True, 1, 2)),
])
def test_short_route_decisions(bounds, host, expect, device):
    T = bounds[-1]
    q, k, v, g, beta, kw = make_inputs(1, T, 1, 1, 16, 16, device=device, seed=3)
    call = checked_call(kda.chunk_kda, q, k, v, g, beta, cu_seqlens=torch.tensor(bounds, dtype=torch.int32,
                        device=device), cu_seqlens_cpu=bounds if host else None, **kw)
    plan = chunk_plan(call)
    short, kept, kept_chunks = kda.plan.route(call, plan)[:3]
    assert (short > 0, kept, kept_chunks) == expect
    o, _ = kda.chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device),
                         cu_seqlens_cpu=bounds if host else None, **kw)
    ro, _ = ref.recurrent_kda(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(),
                              cu_seqlens=torch.tensor(bounds), **on_cpu(kw))
    assert rel_err(o, ro) < FP32_TOL


def test_routing_scans_past_the_first_thousand_sequences(device):
    """1030 one-token sequences, then a 70-token one, then five more: the walk's and the prepare's device
    scans for the sequences not routed (windows of 1024 bounds) must cross into the second window. int64
    bounds: the scan's loop-carried counts stay int32 whatever the bounds' dtype (a compile error on the GPU
    once)."""
    lens = [1] * 1030 + [70] + [1] * 5
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    q, k, v, g, beta, kw = make_inputs(1, bounds[-1], 1, 1, 16, 16, gate="lower_bound", device=device, seed=43)
    cu = torch.tensor(bounds, dtype=torch.int64, device=device)
    h0 = torch.randn(len(lens), 1, 16, 16).to(device)
    o, s = kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                         cu_seqlens_cpu=bounds, **kw)
    ro, rs = ref.recurrent_kda(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), initial_state=h0.cpu().double(),
                               output_final_state=True, cu_seqlens=cu.cpu(), allow_float64=True, **on_cpu(kw))
    assert rel_err(o, ro) < FP32_TOL and rel_err(s, rs) < FP32_TOL
    assert rel_err(o[:, 1030:1100], ro[:, 1030:1100]) < FP32_TOL  # the long sequence itself


def test_walk_v_block_of_64_equals_32(device):
    """The walk with V blocks of 64 (`kda.plan.wide_heads`: on a GPU, for heads too many to walk beside the prepare)
    against blocks of 32: 16-bit inputs with fp16 workspaces (S and U scaled per tile, so the two differ by
    rounding), V = 96 (a half-masked block of 64), varlen with an empty sequence, paged V-first pool. Both
    within the bf16 output's rounding of each other and of the oracle; the pool's other slots untouched."""
    bounds = [0, 70, 70, 200]
    T, H, HV, K, V, N = bounds[-1], 1, 2, 32, 96, 3
    q, k, v, g, beta, kw = make_inputs(1, T, H, HV, K, V, dtype=torch.bfloat16, gate="lower_bound",
                                       device=device, seed=21)
    kw.update(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device), cu_seqlens_cpu=bounds)
    pool0 = poison_pool(6, (HV, V, K), torch.float32, device)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device=device)
    has = torch.tensor([True, False, True], device=device)
    for n in (0, 2):
        pool0[idx[n]] = 0.1 * torch.randn(HV, V, K, generator=torch.Generator().manual_seed(n)).to(device)
    runs = {}
    for bv in (32, 64):
        pool = pool0.clone()
        o, _, plan = run_planned(kda.chunk_kda, q, k, v, g, beta, dict(walk_BV=bv), state_cache=pool,
                                 state_indices=idx, has_initial_state=has, state_v_first=True, **kw)
        assert plan.walk_BV == bv and plan.ws_dtype == torch.float16
        runs[bv] = (o, pool)
    init = torch.stack([pool0[idx[n]] if has[n] else torch.zeros_like(pool0[0]) for n in range(N)])
    ro, rs = ref.recurrent_kda(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(),
                               initial_state=init.cpu().double().transpose(-1, -2).contiguous(),
                               output_final_state=True, allow_float64=True,
                               **on_cpu({key: val for key, val in kw.items() if key != "cu_seqlens_cpu"}))
    floor = rounding_floor(ro, torch.bfloat16)
    assert rel_err(runs[64][0], runs[32][0]) <= floor
    for o, pool in runs.values():
        assert rel_err(o, ro) <= kernel_bound(floor, torch.bfloat16)
        assert rel_err(pool[idx.long()].transpose(-1, -2), rs) < NARROW_STATE_TOL
        for slot in (1, 3, 5):
            assert torch.equal(bits(pool[slot]), bits(pool0[slot]))


@pytest.mark.hopper_plan
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_walk_tma_loads_equal_pointer_loads(dtype, device):
    """The plain walk's chunk tiles by TMA (ragged descriptors: rows past a sequence read as zeros, the
    default where the device has TMA and K, V are multiples of 8) against masked pointer loads: the same
    arithmetic on the same values, so the same bits. Varlen with partial chunks, an empty sequence and a
    one-chunk one; V = 40 (a V block past V, zero-filled by the descriptor's bound); fp32 (fp32 workspaces)
    and bf16 inputs (fp16 workspaces); checkpoints on, paged K-first pool. V itself by TMA where its strides
    allow (`chunk._v_tiles`): also a v whose token stride is not its own (a slice of a wider projection, still
    by TMA) and a v off 16-byte alignment (by pointers inside the TMA walk), each with the same bits."""
    bounds = [0, 70, 70, 100, 230]
    T, H, HV, K, V, N = bounds[-1], 1, 2, 32, 40, 4
    q, k, v, g, beta, kw = make_inputs(1, T, H, HV, K, V, dtype=dtype, gate="lower_bound", device=device,
                                       seed=23)
    kw.update(use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device))
    pool0 = poison_pool(8, (HV, K, V), torch.float32, device)
    idx = torch.tensor([1, 3, 5, 7], dtype=torch.int32, device=device)
    ckpt = torch.tensor([[0], [-1], [-1], [2]], dtype=torch.int32, device=device)
    has = torch.tensor([True, True, False, True], device=device)
    for n in range(N):
        pool0[idx[n]] = 0.1 * torch.randn(HV, K, V, generator=torch.Generator().manual_seed(n)).to(device)
    wide = torch.zeros(1, T, HV, V + 8, dtype=v.dtype, device=device)
    v_wide = wide[..., 8:]  # token stride V + 8: a projection's slice
    v_wide.copy_(v)
    flat = torch.zeros(v.numel() + 1, dtype=v.dtype, device=device)
    v_off = flat[1:].view(v.shape)  # 2 or 4 bytes past 16-byte alignment
    v_off.copy_(v)
    assert all(isinstance(_v_tiles(x, 64, 32), TensorDescriptor) for x in (v, v_wide))
    assert _v_tiles(v_off, 64, 32) is v_off
    runs = {}
    for name, tma, vv in (("tma", True, v), ("pointers", False, v), ("wide v", True, v_wide), ("v off", True, v_off)):
        pool = pool0.clone()
        o, _, plan = run_planned(kda.chunk_kda, q, k, vv, g, beta, dict(walk_tma=tma),
                                 state_cache=pool, state_indices=idx, has_initial_state=has, state_v_first=False,
                                 checkpoint_every=64, checkpoint_indices=ckpt, **kw)
        assert plan.walk_tma == tma
        runs[name] = (o, pool)
    for name in ("wide v", "v off"):
        assert torch.equal(bits(runs[name][0]), bits(runs["tma"][0]))
        assert torch.equal(bits(runs[name][1]), bits(runs["tma"][1]))
    if device == "cpu":  # the interpreter emulates TMA: the CPU suite runs the default path
        assert chunk_plan(checked_call(kda.chunk_kda, q, k, v, g, beta, state_cache=pool0, state_indices=idx,
                                       has_initial_state=has, state_v_first=False, **kw)).walk_tma
    assert torch.equal(bits(runs["tma"][0]), bits(runs["pointers"][0]))
    assert torch.equal(bits(runs["tma"][1]), bits(runs["pointers"][1]))


@pytest.mark.hopper_plan
@pytest.mark.parametrize("contract,dtype,gate_pass", [
    ("dense", torch.float32, False), ("dense", torch.bfloat16, True), ("dense2", torch.float32, False),
    ("paged", torch.float32, True), ("paged_padding", torch.float32, False), ("varlen_paged", torch.bfloat16, False),
    ("split", torch.float32, False)])
def test_walk_beside_prepare_equals_one_walk(contract, dtype, gate_pass, device):
    """The walk beside the prepare (`ChunkPlan.wait_chunks`: on a GPU for few heads, the walk on a side stream awaiting
    each group of chunks, by an outer loop or inside its pipelined loop; the interpreter launches one after another,
    so this checks the arithmetic and the counters' placement) against one prepare then one walk: the same bits,
    with T not a multiple of the groups (a short last group) and checkpoints stored by the waiting walk. The
    counters are zeroed by the gate pass (forced here: the interpreter's ieee dots plan none), by their own launch,
    or counted by the split prepare's solve (an unbounded gate). Dense B = 1 and 2; a paged pool (the other slots
    untouched); a padding sequence (no slot read or written, zero output, error word clear); varlen with bounds
    [0, T] given on the host too (an engine's lone prefill, run as the dense form)."""
    T, H, HV, K, V = 300, 1, 2, 32, 32
    B = 2 if contract == "dense2" else 1
    gate = "logdecay" if contract == "split" else "lower_bound"
    q, k, v, g, beta, kw = make_inputs(B, T, H, HV, K, V, dtype=dtype, gate=gate, device=device, seed=25)
    kw.update(use_qk_l2norm_in_kernel=True)
    if contract == "varlen_paged":
        kw.update(cu_seqlens=torch.tensor([0, T], dtype=torch.int32, device=device),
                  cu_seqlens_cpu=torch.tensor([0, T], dtype=torch.int32))
    runs = {}
    for wait, in_loop in ((0, False), (2, False), (2, True)):
        errors = torch.zeros(B, dtype=torch.int32, device=device)
        over = dict(wait_chunks=wait, wait_in_loop=in_loop, gate_pass=gate_pass)
        if contract.startswith("dense") or contract == "split":
            h0 = 0.1 * torch.randn(B, HV, K, V, generator=torch.Generator().manual_seed(1)).to(device)
            o, s, plan = run_planned(kda.chunk_kda, q, k, v, g, beta, over, initial_state=h0,
                                     output_final_state=True, errors=errors, **kw)
            runs[wait, in_loop] = (o, s)
        else:
            pool = poison_pool(6, (HV, K, V), torch.float32, device)
            pool[2] = 0.1 * torch.randn(HV, K, V, generator=torch.Generator().manual_seed(2)).to(device)
            before = pool.clone()
            slot = -1 if contract == "paged_padding" else 2
            o, _, plan = run_planned(kda.chunk_kda, q, k, v, g, beta, over, state_cache=pool,
                                     state_indices=torch.tensor([slot], dtype=torch.int32, device=device),
                                     has_initial_state=torch.tensor([True], device=device), state_v_first=False,
                                     checkpoint_every=128, errors=errors,
                                     checkpoint_indices=torch.tensor([[4, 1]], dtype=torch.int32, device=device),
                                     **kw)
            for other in (0, 3, 5) if slot == 2 else (0, 2, 3, 5):
                assert torch.equal(bits(pool[other]), bits(before[other]))
            runs[wait, in_loop] = (o, pool)
        assert plan.wait_chunks == wait and plan.gate_pass == gate_pass and not errors.any()
        assert plan.prepare == ("split" if contract == "split" else "fused")
    for form in ((2, False), (2, True)):
        assert torch.equal(bits(runs[form][0]), bits(runs[0, False][0]))
        assert torch.equal(bits(runs[form][1]), bits(runs[0, False][1]))
    if contract == "paged_padding":
        assert torch.equal(runs[2, True][0], torch.zeros_like(runs[2, True][0]))
    elif contract.startswith("dense"):
        ro, rs = ref.recurrent_kda(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), initial_state=h0.cpu().double(),
                                   output_final_state=True, allow_float64=True, **on_cpu(kw))
        if dtype == torch.float32:
            assert rel_err(runs[2, True][0], ro) < FP32_TOL and rel_err(runs[2, True][1], rs) < FP32_TOL
        else:
            assert rel_err(runs[2, True][0], ro) <= kernel_bound(rounding_floor(ro, dtype), dtype)
            assert rel_err(runs[2, True][1], rs) < NARROW_STATE_TOL


@pytest.mark.hopper_plan
@pytest.mark.parametrize("in_loop", [False, True], ids=["outer", "in_loop"])
@pytest.mark.parametrize("contract,ready_groups,hole", [("dense", 0, False), ("dense", 2, False), ("dense", 99, False),
                                                        ("paged", 1, False), ("paged", 3, False), ("dense", 1, True)])
def test_a_walk_whose_wait_gives_up_is_walked_again(contract, ready_groups, hole, in_loop, device, monkeypatch):
    """Liveness of the walk beside the prepare without any assumption on the SMs: a wait that reaches its budget gives
    up (`kda.ops.overlap.spin_zero`; the interpreter's budget is one read), the program writes no final state and
    flags itself, and the resume launch after the prepare walks the flagged programs again. Emulated by taking back
    the prepare's counts from group `ready_groups` on (as if the prepare had not reached them; `hole`: of that group
    alone, the groups after it counted, which a walk by groups must not go on to from the group before; restored
    before the resume launch, as the finished prepare's), then watching the first launch and the resume launch: the
    first flags every program exactly when a group was taken back and leaves the final state (a pool's slot)
    untouched; waiting by groups (outer) it stores nothing past the counted groups (poisoned `out=` rows and
    checkpoint slots stay), inside the pipelined loop it may store rows it walked after giving up (the resume launch
    rewrites them); every row stored before has the one walk's bits; the call ends with the bits of the walk after
    the prepare (outputs, final state, checkpoints, every other slot). On a GPU the first launch's waits give up
    after their 20 ms there."""
    import kda.ops.chunk as kc

    T, H, HV, K, V = 300, 1, 2, 32, 32  # 5 chunks; groups of 2 chunks: 3 groups (99: every group counted)
    W, BT = 2, 64
    q, k, v, g, beta, kw = make_inputs(1, T, H, HV, K, V, dtype=torch.float32, gate="lower_bound", device=device,
                                       seed=26)
    kw.update(use_qk_l2norm_in_kernel=True)
    n_groups = -(-T // (W * BT))
    taken_back = ready_groups < n_groups
    seen = {}
    real_prepare, real_walk = kc._prepare, kc._plain_walk

    if device != "cpu" and 0 < ready_groups < n_groups:
        pytest.skip("on a GPU the walk runs beside the prepare: only none or all of its counts can be taken back")

    def prepare(call, plan, inputs, ws, T_, grid_chunks, short, varlen, ready=None, after_gate=None):
        seen["ready"] = ready
        if ready is not None:  # the flags as a workspace reused from another call may hold them: the walk clears them
            ready[n_groups * HV:] = 1
        if ready is None or not taken_back:
            real_prepare(call, plan, inputs, ws, T_, grid_chunks, short, varlen, ready, after_gate)
        elif ready.is_cuda:  # the walk beside counts on zeros: the prepare counts elsewhere
            ready.zero_()
            seen["counts"] = torch.zeros_like(ready)
            real_prepare(call, plan, inputs, ws, T_, grid_chunks, short, varlen, seen["counts"], after_gate)
        else:  # the interpreter runs the walk after the prepare: counters [1, groups, HV] taken back from a group on
            real_prepare(call, plan, inputs, ws, T_, grid_chunks, short, varlen, ready, after_gate)
            seen["counts"] = ready.clone()
            ready[:n_groups * HV].view(n_groups, HV)[ready_groups:ready_groups + 1 if hole else n_groups] = 0

    walk_signature = inspect.signature(real_walk)

    def walk(*a, **kw_):
        if walk_signature.bind(*a, **kw_).arguments.get("resume"):
            # after the first launch: what it left; then the prepare's counts, all stored by now
            o, st = a[2], a[3]
            seen["o"] = o.clone()
            seen["pool"] = (st.final_state if contract == "dense" else kw_pool).clone()
            seen["flags"] = seen["ready"][n_groups * HV:].clone()
            if taken_back:
                seen["ready"][:n_groups * HV] = seen["counts"][:n_groups * HV]
        real_walk(*a, **kw_)

    def run(wait, out, pool_or_h0):
        errors = torch.zeros(1, dtype=torch.int32, device=device)
        over = dict(wait_chunks=wait, wait_in_loop=in_loop and wait > 0, gate_pass=True)
        if contract == "dense":
            o, s, plan = run_planned(kda.chunk_kda, q, k, v, g, beta, over, initial_state=pool_or_h0,
                                     output_final_state=True, errors=errors, out=out, **kw)
        else:
            o, s, plan = run_planned(kda.chunk_kda, q, k, v, g, beta, over, state_cache=pool_or_h0,
                                     state_indices=torch.tensor([2], dtype=torch.int32, device=device),
                                     has_initial_state=torch.tensor([True], device=device), state_v_first=False,
                                     checkpoint_every=128, errors=errors, out=out,
                                     checkpoint_indices=torch.tensor([[4, 1]], dtype=torch.int32, device=device),
                                     **kw)
            s = pool_or_h0
        assert plan.wait_chunks == wait and not errors.any()
        return o, s

    def fresh():
        if contract == "dense":
            return 0.1 * torch.randn(1, HV, K, V, generator=torch.Generator().manual_seed(1)).to(device)
        pool = poison_pool(6, (HV, K, V), torch.float32, device)
        pool[2] = 0.1 * torch.randn(HV, K, V, generator=torch.Generator().manual_seed(2)).to(device)
        return pool

    poisoned = torch.full((1, T, HV, V), float("nan"), dtype=torch.float32, device=device)
    o1, s1 = run(0, poisoned.clone(), fresh())
    start = fresh()
    kw_pool = start
    monkeypatch.setattr(kc, "_prepare", prepare)
    monkeypatch.setattr(kc, "_plain_walk", walk)
    o2, s2 = run(W, poisoned.clone(), start)
    assert same_bits(o2, o1) and same_bits(s2, s1)
    assert torch.equal(seen["flags"].cpu(), torch.full_like(seen["flags"].cpu(), int(taken_back)))
    assert seen["flags"].numel() == HV * (V // 32)  # one flag a walk program (V blocks of 32)
    # rows of the counted groups (inside the pipelined loop it gives up a chunk early, at the wait for the next
    # chunk's gt): stored with the one walk's bits; past them, by groups, nothing stored
    stored = min(ready_groups, n_groups) * W * BT
    before = max(stored - BT * in_loop, 0)
    assert same_bits(seen["o"][:, :before], o1[:, :before])
    if not in_loop:
        assert torch.isnan(seen["o"][:, stored:]).all()
    if contract == "dense":  # the final state (a fresh tensor): written by the first launch where no wait gave up
        if not taken_back:
            assert same_bits(seen["pool"], s1)
    else:
        first = fresh()
        assert same_bits(seen["pool"][2], s1[2] if not taken_back else first[2])
        for j, slot in enumerate((4, 1)):  # checkpoints at 128 and 256 tokens: the ends of groups 0 and 1
            if (j + 1) * 128 <= before:
                assert same_bits(seen["pool"][slot], s1[slot])
            elif not in_loop:
                assert same_bits(seen["pool"][slot], first[slot])
        for other in (0, 3, 5):
            assert same_bits(s2[other], first[other])


@triton.jit
def _counted_after_kernel(ready, out, t, t_begin, t_end, HV: tl.constexpr, BT: tl.constexpr, W: tl.constexpr,
                          G: tl.constexpr):
    t_run, z = counted_after(ready + 1 + 1, t, t_begin, t_end, HV, BT, W, False, tl.zeros([], dtype=tl.int32), G)
    tl.store(out, t_run + z)


@pytest.mark.parametrize("counted,t_group,G,run", [
    ("all", 1, 8, 6),  # every group from 1 on counted: to the end (the last group holds 2 of its 5 chunks)
    ("all", 1, 4, 4),  # at most G groups a look
    ("hole 3", 1, 8, 2),  # group 3 short of its count: the run stops before it, though 4 and 5 are counted
    ("hole 1", 1, 8, 0),  # the first group looked at not counted: no run
    ("short last", 4, 8, 3),  # to the end: the last group's counter holds its 2 chunks, as many as it needs
    ("over", 7, 8, 0),  # from the walk's end: the end
])
def test_counted_after_finds_the_run_of_counted_groups(counted, t_group, G, run, device):
    """`kda.ops.overlap.counted_after`, through which a walk by groups goes on without restarting its loop: the run
    of groups counted already, from the group at a token on, stops at the first group short of its chunks (never
    past it to counted groups behind), at the walk's end (a short last group needs only its own chunks), and after
    G groups. Here a walk from token 64 * 3 over 32 chunks of 64 tokens in 7 groups of 5 chunks, the counters of
    head 1 of 2 (a group's HV apart) after one word; that word and head 0's hold counts high enough for any group."""
    HV, BT, W, n_groups = 2, 64, 5, 7
    t_begin = 3 * BT
    t_end = t_begin + (6 * W + 2) * BT  # 32 chunks: six groups of 5 and one of 2
    need = [min(W, (t_end - (t_begin + j * W * BT)) // BT) for j in range(n_groups)]
    counts = torch.full((n_groups, HV), 99, dtype=torch.int32)
    counts[:, 1] = torch.tensor(need, dtype=torch.int32)
    if counted.startswith("hole"):
        counts[int(counted.split()[1]), 1] -= 1
    ready = torch.cat([torch.tensor([99], dtype=torch.int32), counts.flatten()]).to(device)
    out = torch.zeros(1, dtype=torch.int32, device=device)
    t = t_begin + t_group * W * BT
    _counted_after_kernel[(1,)](ready, out, t, t_begin, t_end, HV=HV, BT=BT, W=W, G=G)
    assert out.item() == min(t + run * W * BT, t_end)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lone_varlen_prefill_with_host_bounds_runs_as_dense(dtype, device):
    """A varlen call of one sequence with host bounds [0, T] (an engine's lone prefill) runs the dense
    kernels: the same bits as the dense call into the same paged K-first pool, checkpoints included, and
    every other slot untouched; the varlen kernels (no host bounds) agree to rounding."""
    T, H, HV, K, V = 300, 1, 2, 32, 32
    q, k, v, g, beta, kw = make_inputs(1, T, H, HV, K, V, dtype=dtype, gate="lower_bound", device=device, seed=31)
    kw.update(use_qk_l2norm_in_kernel=True, state_v_first=False, checkpoint_every=128,
              checkpoint_indices=torch.tensor([[4, 1]], dtype=torch.int32, device=device),
              state_indices=torch.tensor([2], dtype=torch.int32, device=device),
              has_initial_state=torch.tensor([True], device=device))
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    forms = {"dense": {}, "host": dict(cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, T], dtype=torch.int32)),
             "device": dict(cu_seqlens=cu)}
    runs = {}
    for name, extra in forms.items():
        pool = poison_pool(6, (HV, K, V), torch.float32, device)
        pool[2] = 0.1 * torch.randn(HV, K, V, generator=torch.Generator().manual_seed(2)).to(device)
        before = pool.clone()
        o, _ = kda.chunk_kda(q, k, v, g, beta, state_cache=pool, **kw, **extra)
        for other in (0, 3, 5):
            assert torch.equal(bits(pool[other]), bits(before[other]))
        runs[name] = (o, pool)
    assert torch.equal(bits(runs["host"][0]), bits(runs["dense"][0]))
    assert torch.equal(bits(runs["host"][1]), bits(runs["dense"][1]))
    tol = FP32_TOL if dtype == torch.float32 else NARROW_STATE_TOL
    for slot in (1, 2, 4):
        assert rel_err(runs["device"][1][slot], runs["dense"][1][slot].double()) < tol
    assert rel_err(runs["device"][0], runs["dense"][0].double()) < tol


def test_one_whole_sequence_needs_the_bounds_on_the_host(device):
    """Only a call whose one sequence covers all T tokens, known without reading the device, may run in
    parts as a dense call: dense B = 1, or varlen with host bounds [0, T]; not two sequences, nor bounds
    the host lacks."""
    from kda.plan import one_whole_sequence

    T = 200
    q, k, v, g, beta, kw = make_inputs(2, T, 1, 1, 16, 16, gate="lower_bound", device=device, seed=3)
    one = dict(q=q[:1], k=k[:1], v=v[:1], g=g[:1], beta=beta[:1])

    def call(inputs, **extra):
        return checked_call(kda.chunk_kda, *inputs.values(), **kw, **extra)

    def bounds(*b):
        return dict(cu_seqlens=torch.tensor(b, dtype=torch.int32, device=device))

    assert one_whole_sequence(call(one))
    assert not one_whole_sequence(checked_call(kda.chunk_kda, q, k, v, g, beta, **kw))
    assert one_whole_sequence(call(one, **bounds(0, T), cu_seqlens_cpu=torch.tensor([0, T], dtype=torch.int32)))
    assert not one_whole_sequence(call(one, **bounds(0, T)))
    assert not one_whole_sequence(call(one, **bounds(0, 90, T), cu_seqlens_cpu=torch.tensor([0, 90, T])))


@pytest.mark.parametrize("sms", [132, 78, 16])
def test_walk_beside_prepare_leaves_half_the_sms(sms):
    """Liveness of the walk beside the prepare: its programs spin until the prepare's have run, so the plan
    may put it there only where the walk's programs (at the V block it runs beside the prepare with) take at
    most half the SMs, only for one whole sequence per row (dense, or varlen with host bounds [0, T]), never
    for an empty call, and at V blocks of 64 only where K fits them (K <= 128). Checked on
    the planner's decisions over a grid of shapes as a GPU of `sms` SMs would see them."""
    from types import SimpleNamespace

    from kda import plan as P

    gpu = P.DeviceInfo(sms, (9, 0), 227 * 1024)
    dev = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
    beside_seen = set()
    for B in (1, 2, 4):
        for HV in (1, 4, 8, 12, 16, 24, 32, 48, 96):
            for K, V in ((128, 128), (64, 64), (256, 128), (128, 256), (32, 32)):
                for T in (0, 64, 1000, 4096, 16384, 65536):
                    for varlen in (False, True):
                        call = SimpleNamespace(q=dev, B=1 if varlen else B, T=T * B if varlen else T, HV=HV,
                                               K=K, V=V, N=B, cu_seqlens=object() if varlen else None,
                                               host_bounds=(0, T) if varlen and B == 1 else None)
                        bv = P._walk_bv(call, P.wide_heads(call, gpu))
                        if not P._beside(call, bv, gpu, P.tuning_of(gpu)):
                            continue
                        beside_seen.add(bv)
                        assert 2 * call.N * HV * P.cdiv(V, bv) <= sms
                        assert T > 0
                        assert not varlen or call.N == 1
                        assert bv != 64 or K <= 128
    assert beside_seen >= {32, 64} or sms < 64  # both forms planned somewhere on the grid


# the plan's fields that change a sequence's arithmetic (the others place work, never change a bit)
ARITHMETIC = ("prepare", "dot_prec", "ws_dtype", "BT", "BC", "prepare_BK", "cumsum_fp64", "gate_pass", "gate_BK",
              "gate_warps", "short_len", "fold", "walk_BV")


def _tensor_stand_in(dtype):
    """What the planner reads of q, k and v (device, dtype, address and strides), with 16-byte aligned ones."""
    from types import SimpleNamespace

    return SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0), dtype=dtype, data_ptr=lambda: 1 << 20,
                           stride=lambda dim: 4096)


# the Triton releases a Hopper is planned under: 3.6 also plans the Gluon prepare (kda.plan.GLUON_TRITON)
HOPPER_TRITONS = [(3, 6), (3, 9)]


@pytest.mark.parametrize("triton", HOPPER_TRITONS)
@pytest.mark.parametrize("sms", [132, 78, 16])
def test_arithmetic_choices_ignore_the_batch(sms, triton):
    """Batch invariance at the planner: over every batch a GPU of `sms` SMs could be handed at one model shape
    (heads, K, V, input dtype, flags), dense or varlen, with host bounds or not, one sequence or many, short or
    long, the fields that change the arithmetic are the same; only the placement fields (V blocks, stages, the
    walk beside the prepare, grids) may differ."""
    from types import SimpleNamespace

    from kda import plan as P

    gpu = P.DeviceInfo(sms, (9, 0), 227 * 1024, triton=triton)
    prepares = set()
    for dtype in (torch.bfloat16, torch.float32):
        for HV, K, V in ((4, 128, 128), (12, 128, 128), (32, 128, 128), (96, 128, 128), (8, 64, 256)):
            dev = _tensor_stand_in(dtype)
            seen = set()
            for lengths in ((3000,), (3000,) + (300,) * 64, (3000, 5000), (3000,) + (1,) * 50, (16384,), (64,) * 4,
                            (65536,), (4096,) * 4, (0, 3000)):
                for dense, host in ((False, True), (False, False), (True, True)):
                    if dense and len(set(lengths)) > 1:
                        continue
                    N, T = len(lengths), (lengths[0] if dense else sum(lengths))
                    bounds = tuple(itertools.accumulate((0,) + lengths))
                    call = SimpleNamespace(q=dev, k=dev, v=dev, B=N if dense else 1, T=T, HV=HV, H=HV, K=K, V=V, N=N,
                                           cu_seqlens=None if dense else object(),
                                           host_bounds=bounds if host and not dense else None,
                                           use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0,
                                           state_v_first=True, state_dtype=torch.float32)
                    plan = P.chunk_plan(call, gpu)
                    seen.add(tuple(getattr(plan, f) for f in ARITHMETIC))
                    prepares.add(plan.prepare)
            assert len(seen) == 1, (dtype, HV, K, V, seen)
    assert ("hopper" in prepares) == (triton in P.GLUON_TRITON)  # both planners were exercised


@pytest.mark.parametrize("triton", HOPPER_TRITONS)
@pytest.mark.parametrize("sms", [132, 78, 16])
def test_walk_at_the_prepares_tail_leaves_prepare_slots(sms, triton):
    """The walk beside the prepare's last chunks (`ChunkPlan.late_chunks`, for walks too wide to run beside all
    of it): its programs wait until those chunks are stored, so the plan puts it there only where they run two an
    SM at V blocks of 64 and leave at least a quarter of the prepare's slots (then some SM holds at most one walk
    program, and a prepare program fits beside it: no wait reaches its budget on the whole GPU), for one whole
    sequence with the fused prepare after its gate pass (or the Gluon one), never beside the whole prepare as
    well; the late chunks are fewer than the chunks."""
    from types import SimpleNamespace

    from kda import plan as P

    gpu = P.DeviceInfo(sms, (9, 0), 227 * 1024, triton=triton)
    dev = _tensor_stand_in(torch.bfloat16)
    seen = 0
    for B in (1, 2):
        for HV in (1, 8, 16, 24, 32, 48, 64, 96, 128):
            for K, V in ((128, 128), (64, 64), (256, 128), (128, 256)):
                for T in (0, 64, 4096, 16384):
                    call = SimpleNamespace(q=dev, k=dev, v=dev, B=B, T=T, HV=HV, H=HV, K=K, V=V, N=B, cu_seqlens=None,
                                           host_bounds=None, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                           lower_bound=-5.0, A_log=None, g=None, state_v_first=True,
                                           state_dtype=torch.float32)
                    plan = P.chunk_plan(call, gpu)
                    if not plan.late_chunks:
                        continue
                    seen += 1
                    programs = HV * P.cdiv(V, 64)
                    assert plan.wait_chunks > 0 and B == 1 and T > 0 and K <= 128
                    assert plan.gate_pass or plan.prepare == "hopper"  # the Gluon prepare forms b2 itself
                    assert not P._beside(call, plan.walk_BV, gpu, P.tuning_of(gpu))  # beside all of it: from the start
                    assert 4 * (2 * sms - programs) >= 2 * sms and plan.walk_BV == 64
                    assert 0 < plan.late_chunks < P.cdiv(T, P.CHUNK) or P.cdiv(T, P.CHUNK) == 1
    assert seen


def test_the_interpreter_warns_of_no_overflow(device):
    """The fused prepare's off-diagonal quadrants overflow by design and are dropped by a select; under the
    interpreter that arithmetic is numpy's, which must not warn a user of it (any other warning stays an error)."""
    import warnings

    q, k, v, g, beta, kw = make_inputs(1, 200, 2, 2, 32, 32, dtype=torch.bfloat16, gate="lower_bound", device=device,
                                       seed=3, beta_sigmoid=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # not arithmetic: Triton 3.6's interpreter reads loaded scalars as one-element arrays (NumPy deprecates it)
        warnings.filterwarnings("ignore", message="Conversion of an array with ndim > 0 to a scalar",
                                category=DeprecationWarning)
        o, s = kda.chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
    assert torch.isfinite(o.float()).all() and torch.isfinite(s).all()


def test_the_side_stream_is_made_in_the_callers_green_context(monkeypatch):
    """Where the caller's stream runs in a green context (the driver's answer), the walk's side stream is made in
    that green context, non-blocking, above the default priority, once per (stream, green context): a handle the
    driver places in another green context later gets another stream. A stream in no green context gets a stream
    made by the driver in the device's context (never one of torch's pooled streams, which torch hands out again);
    without green contexts in the driver, the same; without a driver, a torch stream; a failed creation raises.
    (The GPU tests run it on real green contexts and against torch's pool.)"""
    places = {7: 70, 9: 90}
    made = []

    def get(stream, out):  # cuStreamGetGreenCtx
        out._obj.value = places.get(stream)
        return 0

    def make(out, green, flags, priority):  # cuGreenCtxStreamCreate
        made.append((green, flags, priority))
        out._obj.value = 1000 + len(made)
        return 0 if green != 99 else 1

    def plain(out, flags, priority):  # cuStreamCreateWithPriority
        made.append(("plain", flags, priority))
        out._obj.value = 2000 + len(made)
        return 0 if priority == -1 and not places.get("fail") else 2

    monkeypatch.setattr(overlap, "_DRIVER", [(get, make, plain)])
    monkeypatch.setattr(overlap, "_SIDE_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device: ("driver", handle, device.index))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device, priority: ("torch", priority, device.index))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())

    class Main:
        def __init__(self, handle):
            self.cuda_stream = handle

    dev = torch.device("cuda", 0)
    assert overlap.side_stream(dev, Main(7)) == ("driver", 1001, 0)
    assert overlap.side_stream(dev, Main(7)) == ("driver", 1001, 0) and len(made) == 1
    assert overlap.side_stream(dev, Main(9)) == ("driver", 1002, 0)
    assert made == [(70, 1, -1), (90, 1, -1)]
    assert overlap.side_stream(dev, Main(5)) == ("driver", 2003, 0) and made[-1] == ("plain", 1, -1)
    assert overlap.side_stream(dev, Main(5)) == ("driver", 2003, 0) and len(made) == 3
    places[7] = 71
    assert overlap.side_stream(dev, Main(7)) == ("driver", 1004, 0) and made[-1][0] == 71
    places[8] = 99
    with pytest.raises(RuntimeError, match="cuGreenCtxStreamCreate"):
        overlap.side_stream(dev, Main(8))
    places["fail"] = True
    with pytest.raises(RuntimeError, match="cuStreamCreateWithPriority"):
        overlap.side_stream(dev, Main(6))
    # a driver without green contexts: every caller's stream gets a driver-made stream in the device's context
    monkeypatch.setattr(overlap, "_DRIVER", [(None, None, plain)])
    monkeypatch.setattr(overlap, "_SIDE_STREAMS", {})
    del places["fail"]
    assert overlap.side_stream(dev, Main(7)) == ("driver", 2000 + len(made), 0) and made[-1] == ("plain", 1, -1)
    # no driver to ask (ROCm): torch's stream, as before
    monkeypatch.setattr(overlap, "_DRIVER", [None])
    monkeypatch.setattr(overlap, "_SIDE_STREAMS", {})
    assert overlap.side_stream(dev, Main(7)) == ("torch", -1, 0)
