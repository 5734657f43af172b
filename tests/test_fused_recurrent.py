"""`kda.fused_recurrent_kda` (the decode kernel) against the float64 oracle `kda_reference.recurrent_kda`.

Every test states a property that can fail: errors relative to the oracle (fp32: 1e-5 relative L2; narrow
dtypes: against a rounding floor computed here), bit-identity where two paths must agree exactly, and
poisoned memory (NaN, 1e30) that must stay out of the result and must not be written.
"""

import helpers
import pytest
import torch
from conftest import DEVICE
from helpers import checked_call, poisoned_pool, run_planned, same_bits, state_plane
from helpers import rel_err as rel

import kda  # TRITON_INTERPRET is set by conftest.py when there is no GPU
import kda_reference as ref

FP32_TOL = 1e-5


def make_inputs(B, T, H, HV, K, V, *, dtype=torch.float32, gate="none", beta_sigmoid=False, seed=0):
    """helpers.make_inputs on DEVICE with this file's gate (lower bound -2) and raw keys."""
    return helpers.make_inputs(B, T, H, HV, K, V, dtype=dtype, gate=gate, device=DEVICE, seed=seed,
                               normalize_k=False, beta_sigmoid=beta_sigmoid, lower_bound=-2.0)


def random_planes(n, HV, K, V, v_first, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    shape = (n, HV, V, K) if v_first else (n, HV, K, V)
    return (0.5 * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


# --- fp32 against the oracle ---------------------------------------------------------------------------

# (id, B, T, H, HV, K, V, cu_seqlens, gate, l2norm, beta_sigmoid)
FP32_CASES = [
    ("dense-B2T1", 2, 1, 2, 2, 16, 16, None, "none", False, False),
    ("dense-B2T5-softplus-l2-sigmoid", 2, 5, 2, 2, 32, 16, None, "softplus", True, True),
    ("dense-B2T5-lb-gva-K7V48", 2, 5, 1, 2, 7, 48, None, "lower_bound", True, False),
    ("varlen-0113-gva-K48V7", 1, 3, 1, 2, 48, 7, [0, 1, 1, 3], "softplus", False, True),
    ("varlen-002-K32V32", 1, 2, 2, 4, 32, 32, [0, 0, 2], "lower_bound", True, True),
    ("varlen-000", 1, 0, 1, 2, 16, 16, [0, 0, 0], "none", False, False),
    ("dense-B1T3-K256V256", 1, 3, 1, 1, 256, 256, None, "lower_bound", True, False),
    ("dense-B1T2-K1V1", 1, 2, 1, 1, 1, 1, None, "none", False, False),
]


@pytest.mark.parametrize("state", ["none", "k_first", "v_first"])
@pytest.mark.parametrize("case", FP32_CASES, ids=[c[0] for c in FP32_CASES])
def test_fp32_matches_oracle(case, state):
    _, B, T, H, HV, K, V, cu, gate, l2, sig = case
    q, k, v, g, beta, opts = make_inputs(B, T, H, HV, K, V, gate=gate, beta_sigmoid=sig)
    if cu is not None:
        opts["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    N = B if cu is None else len(cu) - 1
    init = None if state == "none" else random_planes(N, HV, K, V, state == "v_first")
    kw = dict(initial_state=init, output_final_state=True, state_v_first=state == "v_first",
              use_qk_l2norm_in_kernel=l2, **opts)
    o, s = kda.fused_recurrent_kda(q, k, v, g, beta, **kw)
    o_ref, s_ref = ref.recurrent_kda(q, k, v, g, beta, **kw)
    assert o.dtype == v.dtype and o.shape == (B, T, HV, V)
    assert s.dtype == torch.float32 and s.shape == s_ref.shape
    assert rel(o, o_ref) <= FP32_TOL
    assert rel(s, s_ref) <= FP32_TOL
    if init is None and T == 0:
        assert torch.equal(s, torch.zeros_like(s))  # empty sequences without a state end at zero
    elif T == 0:
        assert same_bits(s, init)  # empty sequences keep their initial state exactly


def test_strided_inputs_t1_and_out():
    """q, k, v, g, beta as views of fused projections (token and head strides free; T == 1 sliced out
    of a longer buffer, so stride(0) != stride(1)); o written into a strided `out`."""
    B, H, HV, K, V = 3, 2, 4, 16, 16  # T = 1
    gen = torch.Generator().manual_seed(5)
    width = 2 * H * K + HV * V + 5
    proj = torch.randn(B, 4, width, generator=gen).to(DEVICE)[:, 1:2]  # T = 1 of 4: stride(0) = 4 * stride(1)
    q = proj[..., : H * K].unflatten(-1, (H, K))
    k = proj[..., H * K: 2 * H * K].unflatten(-1, (H, K))
    v = proj[..., 2 * H * K: 2 * H * K + HV * V].unflatten(-1, (HV, V))
    gb = torch.randn(B, 2, HV, K + 3, generator=gen).to(DEVICE)[:, :1]
    g = -torch.nn.functional.softplus(gb[..., :K])
    beta = gb[..., K].sigmoid()
    out_buf = torch.full((B, 2, HV, V + 1), float("nan"), device=DEVICE)
    out = out_buf[:, 1:, :, :V]
    init = random_planes(B, HV, K, V, True)
    o, s = kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                   state_v_first=True, use_qk_l2norm_in_kernel=True, out=out)
    o_ref, s_ref = ref.recurrent_kda(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                     state_v_first=True, use_qk_l2norm_in_kernel=True)
    assert o is out
    assert rel(out, o_ref) <= FP32_TOL and rel(s, s_ref) <= FP32_TOL
    assert torch.isnan(out_buf[:, 0]).all() and torch.isnan(out_buf[..., V]).all()  # nothing else written


def test_no_sequences():
    q, k, v, g, beta, _ = make_inputs(1, 0, 1, 1, 16, 16)
    cu = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    o, s = kda.fused_recurrent_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
    assert o.shape == (1, 0, 1, 16) and s.shape == (0, 1, 16, 16)


# --- paged pool ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("v_first", [True, False])
@pytest.mark.parametrize("flags,pad", [("given", 3), ("none", 16)])
def test_paged_pool(v_first, flags, pad):
    H, HV, K, V = 1, 2, 16, 32
    cu_list = [0, 2, 3, 3, 5]  # sequence 2 is empty
    T = cu_list[-1]
    q, k, v, g, beta, opts = make_inputs(1, T, H, HV, K, V, gate="softplus", beta_sigmoid=True, seed=3)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=DEVICE)
    slots = 9
    wide, pool = poisoned_pool(slots, state_plane(HV, K, V, v_first), torch.float32, DEVICE, pad=pad)
    idx = torch.tensor([6, -1, 1, 4], dtype=torch.int32, device=DEVICE)  # permuted, sequence 1 is padding
    read = [True, True, True, False] if flags == "given" else [True] * 4
    for n, slot in enumerate(idx.tolist()):
        if slot >= 0 and read[n]:
            pool[slot] = random_planes(1, HV, K, V, v_first, seed=10 + n)[0]
    # slot 1 (odd) holds NaN: sequence 3 reads it only if flagged; flags "given" leaves it unread
    hist = torch.tensor(read, device=DEVICE) if flags == "given" else None
    if flags == "none":
        pool[4] = random_planes(1, HV, K, V, v_first, seed=20)[0]
    wide_ref = wide.clone()
    pool_ref = wide_ref[:, : HV * K * V].unflatten(1, pool.shape[1:])
    before = wide.clone()
    out = torch.full((1, T, HV, V), float("nan"), device=DEVICE)
    kw = dict(cu_seqlens=cu, state_v_first=v_first, state_indices=idx, has_initial_state=hist,
              use_qk_l2norm_in_kernel=True, **opts)
    o, s = kda.fused_recurrent_kda(q, k, v, g, beta, state_cache=pool, out=out, **kw)
    o_ref, _ = ref.recurrent_kda(q, k, v, g, beta, state_cache=pool_ref, **kw)
    assert s is None and o is out
    assert torch.equal(out[0, 2:3], torch.zeros_like(out[0, 2:3]))  # padding rows are zeros
    assert torch.isfinite(out).all()
    assert rel(out, o_ref) <= FP32_TOL
    used = [s for s in idx.tolist() if s >= 0]
    for slot in used:
        assert torch.isfinite(pool[slot]).all()
        assert rel(pool[slot], pool_ref[slot]) <= FP32_TOL
    untouched = [s for s in range(slots) if s not in used]
    assert same_bits(wide[untouched], before[untouched])  # 1e30 / NaN slots bitwise unchanged
    assert same_bits(wide[used, HV * K * V:], before[used, HV * K * V:])  # the padding between planes too


@pytest.mark.parametrize("v_first", [True, False])
def test_has_initial_state_false_equals_zero_start(v_first):
    """A false flag on a NaN slot gives the bits of a run that reads a slot of zeros (the same compiled
    kernel), and matches the no-state contract to fp32 accuracy (another compiled variant)."""
    H, HV, K, V = 1, 1, 16, 16
    q, k, v, g, beta, _ = make_inputs(2, 2, H, HV, K, V, seed=4)  # sequence 1 is padding
    _, pool = poisoned_pool(2, state_plane(HV, K, V, v_first), torch.float32, DEVICE, pad=16)
    pool[1] = float("nan")  # slot 1 is NaN: never read
    pool[0] = 0.0
    zero_pool = pool.clone()
    kw = dict(state_v_first=v_first)

    def flags(*xs):
        return torch.tensor(xs, device=DEVICE)

    def slots(*xs):
        return torch.tensor(xs, dtype=torch.int32, device=DEVICE)

    o, _ = kda.fused_recurrent_kda(q, k, v, g, beta, state_cache=pool, has_initial_state=flags(False, True),
                                   state_indices=slots(1, -1), **kw)
    o0, _ = kda.fused_recurrent_kda(q, k, v, g, beta, state_cache=zero_pool, has_initial_state=flags(True, True),
                                    state_indices=slots(0, -1), **kw)
    assert same_bits(o, o0) and same_bits(pool[1], zero_pool[0])
    o_none, s_none = kda.fused_recurrent_kda(q, k, v, g, beta, output_final_state=True, **kw)
    assert rel(o[0], o_none[0]) <= FP32_TOL and rel(pool[1], s_none[0]) <= FP32_TOL


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v_first", [True, False])
def test_no_initial_state_equals_zero_planes(v_first, state_dtype, in_dtype):
    """One token a sequence without an initial state gives what a start from planes of zeros gives, whatever
    the inputs' dtype beside the pool's (the kernels pick their form by the state's dtype: a bf16 q standing
    in for an absent fp32 pool once wrote bf16 words into the fp32 final state): the same bits under the
    interpreter; compiled, the two are different specialisations whose fp32 arithmetic may contract apart,
    so at most two units of the stored dtype's roundoff."""
    H, HV, K, V = 1, 2, 32, 32
    q, k, v, g, beta, kw = make_inputs(3, 1, H, HV, K, V, dtype=in_dtype, gate="lower_bound", seed=5)
    kw.update(state_v_first=v_first, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = kda.fused_recurrent_kda(q, k, v, g, beta, state_dtype=state_dtype, **kw)
    zeros = torch.zeros(3, *state_plane(HV, K, V, v_first), dtype=state_dtype, device=DEVICE)
    o0, s0 = kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=zeros, **kw)
    assert s.dtype == state_dtype
    if DEVICE == "cpu":
        assert same_bits(o, o0) and same_bits(s, s0)
    else:
        assert rel(o, o0) <= 2 * torch.finfo(o.dtype).eps and rel(s, s0) <= 2 * torch.finfo(s.dtype).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v_first", [True, False])
def test_paged_equals_dense_bitwise(v_first, dtype):
    H, HV, K, V = 2, 2, 32, 16
    cu_list = [0, 3, 4, 4, 6]
    N, T = len(cu_list) - 1, cu_list[-1]
    q, k, v, g, beta, opts = make_inputs(1, T, H, HV, K, V, gate="lower_bound", seed=6)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=DEVICE)
    idx = torch.tensor([3, 0, 5, 2], dtype=torch.int32, device=DEVICE)
    _, pool = poisoned_pool(6, state_plane(HV, K, V, v_first), dtype, DEVICE, pad=16)
    init = random_planes(N, HV, K, V, v_first, dtype=dtype, seed=7)
    pool[idx.long()] = init
    kw = dict(cu_seqlens=cu, state_v_first=v_first, use_qk_l2norm_in_kernel=True, **opts)
    o_d, s_d = kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=init, output_final_state=True, **kw)
    o_p, _ = kda.fused_recurrent_kda(q, k, v, g, beta, state_cache=pool, state_indices=idx, **kw)
    assert same_bits(o_p, o_d)
    assert same_bits(pool[idx.long()], s_d)


# --- narrow state storage ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("contract", ["dense", "paged", "none"])
def test_narrow_state_rounds_once(dtype, contract):
    """fp32 recurrence, one rounding on store: each element within one storage ulp of the exact value."""
    H, HV, K, V = 1, 2, 16, 16
    B, T = 2, 4
    q, k, v, g, beta, _ = make_inputs(B, T, H, HV, K, V, seed=8)
    init = random_planes(B, HV, K, V, True, dtype=dtype, seed=9)
    kw = dict(state_v_first=True, use_qk_l2norm_in_kernel=True)
    if contract == "dense":
        o, s = kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=init, output_final_state=True, **kw)
    elif contract == "none":
        o, s = kda.fused_recurrent_kda(q, k, v, g, beta, output_final_state=True, state_dtype=dtype, **kw)
        init = torch.zeros_like(init)
    else:
        _, pool = poisoned_pool(3, state_plane(HV, K, V, True), dtype, DEVICE, pad=16)
        idx = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
        pool[idx.long()] = init
        o, _ = kda.fused_recurrent_kda(q, k, v, g, beta, state_cache=pool, state_indices=idx, **kw)
        s = pool[idx.long()]
    # exact answer: the same narrow initial values, kept in float64 throughout
    o_ref, s_exact = ref.recurrent_kda(q, k, v, g, beta, initial_state=init.double(), output_final_state=True,
                                       allow_float64=True, **kw)
    assert s.dtype == dtype
    eps = torch.finfo(dtype).eps
    err = (s.double() - s_exact).abs()
    bound = eps * s_exact.abs() + FP32_TOL * s_exact.pow(2).mean().sqrt()
    assert (err <= bound).all(), (err / bound).max().item()
    assert rel(o, o_ref) <= FP32_TOL  # the output is not affected by the storage dtype (fp32 inside)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_inputs_error_floor(dtype):
    """bf16/fp16 q, k, v: error at most twice the oracle's own output rounded to the input dtype."""
    B, T, H, HV, K, V = 2, 6, 1, 2, 32, 32
    q, k, v, g, beta, opts = make_inputs(B, T, H, HV, K, V, dtype=dtype, gate="lower_bound", beta_sigmoid=True,
                                         seed=11)
    init = random_planes(B, HV, K, V, True, seed=12)
    kw = dict(initial_state=init, output_final_state=True, state_v_first=True, use_qk_l2norm_in_kernel=True,
              **opts)
    o, s = kda.fused_recurrent_kda(q, k, v, g, beta, **kw)
    o_ref, s_ref = ref.recurrent_kda(q, k, v, g, beta, **kw)
    assert o.dtype == dtype
    floor = rel(o_ref.to(dtype), o_ref)
    assert floor > 0
    assert rel(o, o_ref) <= 2 * floor + FP32_TOL
    assert rel(s, s_ref) <= FP32_TOL  # fp32 state: only fp32 arithmetic error


# --- stochastic rounding -------------------------------------------------------------------------------


def _sr_setup(dtype, v_first, one_token=False):
    H, HV, K, V = 1, 2, 16, 32
    cu_list = [0, 1, 2, 3] if one_token else [0, 1, 3, 4]
    T = cu_list[-1]
    q, k, v, g, beta, opts = make_inputs(1, T, H, HV, K, V, gate="softplus", seed=13)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=DEVICE)
    _, pool = poisoned_pool(5, state_plane(HV, K, V, v_first), dtype, DEVICE, pad=16)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    pool[idx.long()] = random_planes(3, HV, K, V, v_first, dtype=dtype, seed=14)
    # an fp32 copy, same alignment
    _, pool32 = poisoned_pool(5, state_plane(HV, K, V, v_first), torch.float32, DEVICE, pad=16)
    pool32.copy_(pool.float())

    def call(p, **extra):
        kw = dict(cu_seqlens=cu, state_cache=p, state_indices=idx, state_v_first=v_first, **opts)
        if one_token:  # host bounds: the one-token kernel (bf16 K-first pools: held as 32-bit words)
            kw["cu_seqlens_cpu"] = cu_list
        return kda.fused_recurrent_kda(q, k, v, g, beta, **kw, **extra)

    return pool, pool32, idx, call


def _floor_ceil(x64: torch.Tensor, dtype):
    """The largest value of `dtype` <= x and the smallest >= x, for float64 x (computed on the host)."""
    x64 = x64.cpu()
    r = x64.to(dtype)
    inf = torch.full_like(r, float("inf"))
    floor = torch.where(r.double() > x64, torch.nextafter(r, -inf), r)
    ceil = torch.where(r.double() < x64, torch.nextafter(r, inf), r)
    return floor.double(), ceil.double()


def check_stochastic(sr: torch.Tensor, x: torch.Tensor, dtype) -> None:
    """sr (stored with stochastic rounding) against x, the fp32 state of the same recurrence computed by
    the fp32-storage kernel. On the GPU that is another compiled variant whose K sums may round in
    another order, so x carries a slack of 1e-6 of its RMS (a few fp32 ulps); in the interpreter the two
    agree bit for bit."""
    x = x.double().cpu()
    v = sr.double().cpu()
    slack = 1e-6 * x.pow(2).mean().sqrt().item()
    lo, _ = _floor_ceil(x - slack, dtype)
    _, hi = _floor_ceil(x + slack, dtype)
    assert ((v >= lo) & (v <= hi)).all()  # one of the two neighbours of x in the storage format
    # unbiased: P(ceil) = (x - floor) / (ceil - floor) =: frac, so in each half of the frac range the share
    # of ceilings matches the mean frac (round to nearest would give 0 and 1; truncation 0 or 1 by sign)
    floor, ceil = _floor_ceil(x, dtype)
    inexact = ceil > floor
    assert inexact.sum() > 1000
    went_up = (v == ceil)[inexact].double()
    frac = ((x - floor) / (ceil - floor))[inexact]
    for part in (frac < 0.5, frac >= 0.5):
        assert abs(went_up[part].mean().item() - frac[part].mean().item()) < 0.06


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v_first", [True, False])
@pytest.mark.parametrize("one_token", [False, True])
def test_stochastic_rounding(dtype, v_first, one_token):
    pool, pool32, idx, call = _sr_setup(dtype, v_first, one_token)
    sel = idx.long()
    o32, _ = call(pool32)  # the fp32 value before the store: the same call on the fp32 copy of the pool
    x = pool32[sel]

    runs, outs = {}, {}
    for name, extra in (("a", dict(stochastic_rounding=True, seed=3)), ("b", dict(stochastic_rounding=True, seed=3)),
                        ("c", dict(stochastic_rounding=True, seed=4)), ("rne", {})):
        p = pool.clone()
        outs[name], _ = call(p, **extra)
        runs[name] = p[sel]
    for name in ("b", "c", "rne"):
        assert same_bits(outs[name], outs["a"])  # the output never depends on how the state is rounded
    assert rel(outs["a"], o32) <= FP32_TOL
    assert same_bits(runs["a"], runs["b"])  # same seed: the same bits
    assert not same_bits(runs["a"], runs["c"])  # another seed: other bits somewhere
    # off by default: round to nearest (x.to(dtype), up to the slack of `check_stochastic`)
    slack = 1e-6 * x.double().pow(2).mean().sqrt().item()
    rne = runs["rne"].double().cpu()
    xd = x.double().cpu()
    assert ((rne >= (xd - slack).to(dtype).double()) & (rne <= (xd + slack).to(dtype).double())).all()
    if DEVICE == "cpu":
        assert same_bits(runs["rne"], x.to(dtype))  # the interpreter runs one code path: exact
    check_stochastic(runs["a"], x, dtype)
    check_stochastic(runs["c"], x, dtype)


def _edge_values(dtype) -> list[tuple[float, bool]]:
    """Values at the edges of `dtype`, each with whether its rounding frequency is measured (not past the largest
    finite, whose upper neighbour is inf, nor an fp32 subnormal, which a GPU may flush): past the largest
    finite, in the subnormals, below the smallest subnormal, and ordinary values."""
    if dtype == torch.float16:
        return [(65510.0, False), (-65530.0, False), (65519.9, False), (3.0e-5 + 2.0**-25, True),
                (-(2.0**-24) * 1.25, True), (2.0**-26, True), (-(2.0**-25) * 1.5, True), (1.0e-9, True),
                (1.0 + 2.0**-11, True), (2049.5, True), (-3.0 - 2.0**-10 * 0.75, True), (1.0 - 2.0**-13, True)]
    big, ulp = torch.finfo(torch.bfloat16).max, 2.0**120
    return [(big + 0.5 * ulp, False), (-(big + 0.25 * ulp), False), (2.0**-135, False), (-(2.0**-140), False),
            (1.0 + 2.0**-9, True), (-(1.0 + 2.0**-8), True), (300.5, True), (2.0**-120 * (1.0 + 2.0**-8), True),
            (1.0 - 2.0**-10, True), (-7.0e-3 - 2.0**-17, True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v_first", [True, False])
@pytest.mark.parametrize("one_token", [False, True])
def test_stochastic_rounding_at_the_format_edges(dtype, v_first, one_token):
    """A zero state, a one-hot key, beta 1 and no decay write v exactly into the state's row of K index 0; with
    stochastic rounding each value is stored as one of its two neighbours in `dtype` (past the largest finite:
    it or inf; below the smallest subnormal: 0 or it), every other element stays 0, and over 64 sequences (64
    planes, 64 independent draws) the upper neighbour comes as often as the value's place between them says
    (within 4.5 standard deviations)."""
    N, K, V = 64, 16, 32
    edges = _edge_values(dtype)
    gen = torch.Generator().manual_seed(21)
    vals = torch.cat([torch.tensor([x for x, _ in edges], dtype=torch.float64),
                      torch.randn(V - len(edges), generator=gen, dtype=torch.float64) * 10])
    v = vals.float().expand(1, N, 1, V).contiguous().to(DEVICE)
    q = torch.randn(1, N, 1, K, generator=gen).to(DEVICE)
    k = torch.zeros(1, N, 1, K, device=DEVICE)
    k[..., 0] = 1.0
    g = torch.zeros(1, N, 1, K, device=DEVICE)
    beta = torch.ones(1, N, 1, device=DEVICE)
    pool = torch.zeros(N, *state_plane(1, K, V, v_first), dtype=dtype, device=DEVICE)
    cu_list = list(range(N + 1))
    extra = dict(cu_seqlens_cpu=cu_list) if one_token else {}
    kda.fused_recurrent_kda(q, k, v, g, beta, cu_seqlens=torch.tensor(cu_list, dtype=torch.int32, device=DEVICE),
                            state_cache=pool, state_indices=torch.arange(N, dtype=torch.int32, device=DEVICE),
                            state_v_first=v_first, stochastic_rounding=True, seed=7, **extra)
    got = (pool[:, 0, :, 0] if v_first else pool[:, 0, 0, :]).double().cpu()  # [N, V]
    rest = pool.clone()
    (rest[:, 0, :, 0] if v_first else rest[:, 0, 0, :]).zero_()
    assert not rest.any()
    x = vals.float().double()  # the fp32 value the kernel rounds
    floor, ceil = _floor_ceil(x, dtype)
    tiny = x.abs() < torch.finfo(torch.float32).tiny  # an fp32 subnormal: a GPU may flush it to zero
    ok = (got == floor) | (got == ceil) | (tiny & (got == 0))
    assert ok.all(), (x[~ok.all(0)], got[:, ~ok.all(0)][0])
    for col, (_, measured) in enumerate(edges):
        if measured:
            share = ((x[col] - floor[col]) / (ceil[col] - floor[col])).item()
            up = (got[:, col] == ceil[col]).double().mean().item()
            assert abs(up - share) <= 4.5 * (share * (1 - share) / N) ** 0.5, (x[col].item(), up, share)


def test_stochastic_rounding_dense_final_state():
    """SR also applies to a dense final state in bf16 (state_dtype), and leaves the output alone."""
    q, k, v, g, beta, _ = make_inputs(2, 3, 1, 1, 32, 32, seed=15)
    o32, s32 = kda.fused_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    o, s = kda.fused_recurrent_kda(q, k, v, g, beta, output_final_state=True, state_dtype=torch.bfloat16,
                                   stochastic_rounding=True, seed=1)
    assert s.dtype == torch.bfloat16 and rel(o, o32) <= FP32_TOL
    check_stochastic(s, s32, torch.bfloat16)


# --- prefill (chunk_kda) then decode through the same slot ---------------------------------------------


@pytest.mark.parametrize("v_first", [True, False])
def test_prefill_then_decode(v_first):
    H, HV, K, V = 1, 2, 16, 16
    prompts, steps = [5, 3], 3
    N = len(prompts)
    total = [p + steps for p in prompts]
    cu_full = [0]
    for n in total:
        cu_full.append(cu_full[-1] + n)
    q, k, v, g, beta, opts = make_inputs(1, cu_full[-1], H, HV, K, V, gate="lower_bound", beta_sigmoid=True,
                                         seed=16)
    kw = dict(state_v_first=v_first, use_qk_l2norm_in_kernel=True, **opts)
    _, pool = poisoned_pool(4, state_plane(HV, K, V, v_first), torch.float32, DEVICE, pad=16)
    idx = torch.tensor([3, 0], dtype=torch.int32, device=DEVICE)
    pool[3] = random_planes(1, HV, K, V, v_first, seed=17)[0]  # sequence 0 continues a state; slot 0 is NaN
    hist = torch.tensor([True, False], device=DEVICE)
    pool_ref = pool.clone()
    o_ref, _ = ref.recurrent_kda(q, k, v, g, beta, cu_seqlens=torch.tensor(cu_full, device=DEVICE),
                                 state_cache=pool_ref, state_indices=idx, has_initial_state=hist, **kw)

    def tokens(x, rows):
        return x[:, rows]

    pre_rows = torch.cat([torch.arange(cu_full[n], cu_full[n] + prompts[n]) for n in range(N)]).to(DEVICE)
    cu_pre = torch.tensor([0, prompts[0], sum(prompts)], dtype=torch.int32, device=DEVICE)
    sub = [tokens(x, pre_rows) for x in (q, k, v, g, beta)]
    o_pre, _ = kda.chunk_kda(*sub, cu_seqlens=cu_pre, state_cache=pool, state_indices=idx,
                             has_initial_state=hist, **kw)
    assert rel(o_pre, o_ref[:, pre_rows]) <= FP32_TOL, "chunk_kda prefill differs from the oracle"
    cu_dec = torch.arange(N + 1, dtype=torch.int32, device=DEVICE)
    for step in range(steps):
        rows = torch.tensor([cu_full[n] + prompts[n] + step for n in range(N)], device=DEVICE)
        o_dec, _ = kda.fused_recurrent_kda(*[tokens(x, rows) for x in (q, k, v, g, beta)], cu_seqlens=cu_dec,
                                           state_cache=pool, state_indices=idx, **kw)
        assert rel(o_dec, o_ref[:, rows]) <= FP32_TOL
    assert rel(pool[idx.long()], pool_ref[idx.long()]) <= FP32_TOL


# --- bad input -----------------------------------------------------------------------------------------


def test_stochastic_rounding_needs_narrow_state():
    q, k, v, g, beta, _ = make_inputs(1, 1, 1, 1, 16, 16)
    _, pool = poisoned_pool(2, state_plane(1, 16, 16, True), torch.float32, DEVICE, pad=16)
    pool[0] = 1.0
    before = pool.clone()
    out = torch.full((1, 1, 1, 16), float("nan"), device=DEVICE)
    idx = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="stochastic_rounding"):
        kda.fused_recurrent_kda(q, k, v, g, beta, state_cache=pool, state_indices=idx, state_v_first=True,
                                stochastic_rounding=True, seed=1, out=out)
    assert same_bits(pool, before) and torch.isnan(out).all()
    with pytest.raises(ValueError, match="stochastic_rounding"):
        kda.fused_recurrent_kda(q, k, v, g, beta, output_final_state=True, stochastic_rounding=True)


@pytest.mark.parametrize("v_first,kc", [(True, 0), (False, 0), (False, 8)])
def test_one_token_heads_fastest_same_bits(v_first, kc):
    """The one-token kernel's grid with value heads before sequences (`DecodePlan.heads_fastest`, K-first
    pools' default) computes every program's work as the (sequence, head) grid does: outputs and written slots
    bit for bit equal; the padding sequence's row zeros, the slots not named keep their poison."""
    N, H, HV, K, V = 5, 1, 3, 24, 40
    q, k, v, g, beta, opts = make_inputs(N, 1, H, HV, K, V, gate="lower_bound", beta_sigmoid=True, seed=4)
    idx = torch.tensor([7, -1, 2, 9, 4], dtype=torch.int32, device=DEVICE)
    kw = dict(state_v_first=v_first, use_qk_l2norm_in_kernel=True, state_indices=idx, **opts)
    runs = []
    for hf in (False, True):
        wide, pool = poisoned_pool(11, state_plane(HV, K, V, v_first), torch.bfloat16, DEVICE, pad=3)
        for slot in (7, 2, 9, 4):
            pool[slot] = random_planes(1, HV, K, V, v_first, seed=50 + slot)[0].to(torch.bfloat16)
        before = wide.clone()
        o, _, plan = run_planned(kda.fused_recurrent_kda, q, k, v, g, beta,
                                 dict(nsub=1, kc=kc, heads_fastest=hf), state_cache=pool, **kw)
        assert plan.heads_fastest == hf
        runs.append((o, wide, before))
    (o0, w0, b0), (o1, w1, b1) = runs
    assert same_bits(o0, o1) and same_bits(w0, w1)
    assert torch.equal(o1[1], torch.zeros_like(o1[1]))
    for slot in (0, 1, 3, 5, 6, 8, 10):  # slots not named: untouched
        assert same_bits(w1[slot], b1[slot])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_token_k_packed(dtype):
    """2-byte K-first pools: the one-token kernel holds the V block as 32-bit words of two columns, read once
    (`DecodePlan.packed`, the default), here with K not a power of two (masked rows), V not a multiple of the
    block (masked words), a padding sequence and an unread NaN slot. (1) Against the row-chunk kernel (the same
    step, the plane read twice; its K sums in another order): outputs within 1e-6, stored values within one
    storage ulp, both against the float64 oracle; the slots not named and the padding between planes keep their
    bits. (2) paged == dense bit for bit. (3) A pool whose slot stride is odd (no 4-byte words) runs the row
    chunks: bit for bit the row-chunk plan."""
    N, H, HV, K, V = 5, 1, 2, 24, 40
    q, k, v, g, beta, opts = make_inputs(N, 1, H, HV, K, V, gate="lower_bound", beta_sigmoid=True, seed=21)
    idx = torch.tensor([7, -1, 2, 9, 4], dtype=torch.int32, device=DEVICE)  # sequence 1 is padding
    keep, used, read = [0, 2, 3, 4], [7, 2, 9, 4], [True, True, True, False, True]  # slot 9: NaN, unread
    kw = dict(state_v_first=False, use_qk_l2norm_in_kernel=True, **opts)
    flags = dict(state_indices=idx, has_initial_state=torch.tensor(read, device=DEVICE))
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11

    def pool_with(pad):
        wide, pool = poisoned_pool(11, state_plane(HV, K, V, False), dtype, DEVICE, pad=pad)
        for n, slot in zip(keep, used):
            if read[n]:
                pool[slot] = random_planes(1, HV, K, V, False, seed=40 + n)[0].to(dtype)
        return wide, pool

    def decode(pool, packed, **more):
        # the row chunks on one warp, as the held form's fallback runs them
        over = dict(nsub=1, kc=8, packed=packed, **({} if packed else dict(num_warps=1)))
        o, s, plan = run_planned(kda.fused_recurrent_kda, q, k, v, g, beta, over, state_cache=pool, **flags, **more,
                                 **kw)
        return o

    wide, pool = pool_with(16)
    before = wide.clone()
    init = pool[used].clone()
    o_p = decode(pool, True)
    s_p, w_p = pool[used].clone(), wide.clone()
    wide.copy_(before)
    o_r = decode(pool, False)
    s_r = pool[used].clone()
    assert rel(o_p[keep], o_r[keep]) <= 1e-6
    assert not same_bits(o_p, o_r)  # the two kernels ran (their K sums round in other orders)
    a, b = s_p.double(), s_r.double()
    assert ((a - b).abs() <= 2 * u * torch.maximum(a.abs(), b.abs()) + 2.0 ** -24).all()
    assert torch.equal(o_p[1], torch.zeros_like(o_p[1]))
    untouched = [s for s in range(11) if s not in used]
    assert same_bits(w_p[untouched], before[untouched])
    assert same_bits(w_p[used, HV * K * V:], before[used, HV * K * V:])
    h0 = torch.where(torch.tensor(read, device=DEVICE)[keep, None, None, None], init, 0).double()
    o_ref, s_ref = ref.recurrent_kda(*(x[keep].double() for x in (q, k, v, g, beta)), initial_state=h0,
                                     output_final_state=True, allow_float64=True, **kw)
    assert rel(o_p[keep], o_ref) <= FP32_TOL
    assert rel(s_p, s_ref) <= u

    # (2) paged == dense: the dense call stores its final state in a fresh (aligned) tensor
    o_d, s_d, plan = run_planned(kda.fused_recurrent_kda, *(x[[0, 2, 4]] for x in (q, k, v, g, beta)),
                                 dict(nsub=1, kc=8), initial_state=init[[0, 1, 3]], output_final_state=True, **kw)
    assert plan.packed and same_bits(o_p[[0, 2, 4]], o_d) and same_bits(s_p[[0, 1, 3]], s_d)

    # (3) an odd slot stride: the row chunks
    wide, pool = pool_with(3)
    before = wide.clone()
    o_f = decode(pool, True)
    s_f = pool[used].clone()
    wide.copy_(before)
    assert same_bits(o_f, decode(pool, False)) and same_bits(s_f, pool[used])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_token_words_need_even_v(dtype):
    """2-byte words (`packed`) need V even: at odd V a head plane after the first starts mid-word and a row
    holds V // 2 words and a half. A plan asking for them at odd V runs the row chunks instead: bit for bit the
    plan without them, within one storage ulp of the oracle, a poisoned padded pool's other slots untouched."""
    N, H, HV, K, V = 3, 1, 3, 16, 23
    q, k, v, g, beta, opts = make_inputs(N, 1, H, HV, K, V, gate="lower_bound", beta_sigmoid=True, seed=13)
    kw = dict(state_v_first=False, use_qk_l2norm_in_kernel=True, **opts)
    idx = torch.tensor([4, 1, -1], dtype=torch.int32, device=DEVICE)
    runs = []
    for packed in (False, True):
        wide, pool = poisoned_pool(6, state_plane(HV, K, V, False), dtype, DEVICE, pad=2)
        for s in (4, 1):
            pool[s] = random_planes(1, HV, K, V, False, seed=90 + s)[0].to(dtype)
        before, init = wide.clone(), pool[[4, 1]].clone()
        o, _, _ = run_planned(kda.fused_recurrent_kda, q, k, v, g, beta, dict(nsub=1, BV=16, kc=8, packed=packed),
                              state_cache=pool, state_indices=idx, **kw)
        runs.append((o, wide))
    (o0, w0), (o1, w1) = runs
    assert same_bits(o1, o0) and same_bits(w1, w0)
    untouched = [0, 2, 3, 5]
    assert same_bits(w1[untouched], before[untouched]) and same_bits(w1[:, HV * K * V:], before[:, HV * K * V:])
    o_ref, s_ref = ref.recurrent_kda(*(x[:2].double() for x in (q, k, v, g, beta)), initial_state=init.double(),
                                     output_final_state=True, allow_float64=True, **kw)
    assert rel(o1[:2], o_ref) <= FP32_TOL
    assert rel(pool[[4, 1]], s_ref) <= (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11)


@pytest.mark.parametrize("nsub,v_first,kc", [(n, vf, 0) for n in (1, 2, 4) for vf in (True, False)] + [(1, False, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_kernel(nsub, dtype, v_first, kc):
    """`_fused_recurrent_one_token_kernel` (dense q [N, 1, ...]: decode; the default for V-first pools, forced
    here for both layouts and every NSUB; K-first also read in row chunks of `kc`, the plane read twice), V
    not a multiple of its NSUB blocks (masked rows), K not a power of two (a masked row chunk), a padding
    sequence.
    (1) A padded pool whose stride is a multiple of 16 elements, every slot read: paged == dense (the
    gathered planes) bit for bit, because the kernel takes `paged` at run time and both contracts run one
    binary (on a GPU too: same flags, same alignment). (2) A poisoned pool (stride plane + 3) with an
    unread NaN slot: the other slots and the padding between planes keep their bits, padding rows are
    zeros, results within rounding of the loop kernel (the same arithmetic in another binary) and within
    1e-5 of the oracle (fp32 pool)."""
    N, H, HV, K, V = 5, 1, 2, 24, 40
    q, k, v, g, beta, opts = make_inputs(N, 1, H, HV, K, V, gate="lower_bound", beta_sigmoid=True, seed=8)
    slots = 11
    idx = torch.tensor([7, -1, 2, 9, 4], dtype=torch.int32, device=DEVICE)  # sequence 1 is padding
    keep, used = [0, 2, 3, 4], [7, 2, 9, 4]
    kw = dict(state_v_first=v_first, use_qk_l2norm_in_kernel=True, **opts)

    def decode(*args, nsub=nsub, **more):
        o, s, plan = run_planned(kda.fused_recurrent_kda, *args, dict(nsub=nsub, kc=kc if nsub else 0), **more,
                                 **kw)
        assert plan.nsub == nsub
        return o, s

    # (1) paged == dense, bit for bit
    wide, pool = poisoned_pool(slots, state_plane(HV, K, V, v_first), dtype, DEVICE, pad=16)
    for n, slot in zip(keep, used):
        pool[slot] = random_planes(1, HV, K, V, v_first, seed=30 + n)[0].to(dtype)
    init = pool[used].clone()
    o_p, _ = decode(q, k, v, g, beta, state_cache=pool, state_indices=idx)
    o_d, s_d = decode(*(x[keep] for x in (q, k, v, g, beta)), initial_state=init, output_final_state=True)
    assert same_bits(o_p[keep], o_d) and same_bits(pool[used], s_d)
    assert torch.equal(o_p[1], torch.zeros_like(o_p[1]))  # padding rows are zeros

    # (2) a poisoned, oddly padded pool with an unread slot, against the loop kernel and the oracle
    read = [True, True, True, False, True]  # slot 9 holds NaN and is not read
    wide, pool = poisoned_pool(slots, state_plane(HV, K, V, v_first), dtype, DEVICE, pad=3)
    for n, slot in zip(keep, used):
        if read[n]:
            pool[slot] = random_planes(1, HV, K, V, v_first, seed=30 + n)[0].to(dtype)
    before = wide.clone()
    flags = dict(state_indices=idx, has_initial_state=torch.tensor(read, device=DEVICE))
    paged = dict(flags, **kw)
    results = {}
    for mode in (0, nsub):
        wide.copy_(before)
        out = torch.full((N, 1, HV, V), float("nan"), device=DEVICE)
        decode(q, k, v, g, beta, state_cache=pool, out=out, nsub=mode, **flags)
        results[mode] = (out.clone(), wide.clone(), pool[used].clone())
    (o0, _w0, s0), (o1, w1, s1) = results[0], results[nsub]
    assert torch.equal(o1[1], torch.zeros_like(o1[1]))
    untouched = [s for s in range(slots) if s not in used]
    assert same_bits(w1[untouched], before[untouched])
    assert same_bits(w1[used, HV * K * V:], before[used, HV * K * V:])
    u = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -8
    assert rel(o1[keep], o0[keep]) <= 2 * 2.0 ** -24 + 1e-6
    assert rel(s1.float(), s0.float()) <= 2 * u + 1e-6
    if dtype == torch.float32:
        pool_ref = before.clone()[:, : HV * K * V].unflatten(1, pool.shape[1:])
        o_ref, _ = ref.recurrent_kda(q, k, v, g, beta, state_cache=pool_ref, **paged)
        assert rel(o1[keep], o_ref[keep]) <= FP32_TOL
        assert rel(s1, pool_ref[used]) <= FP32_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_decode_batch_with_host_bounds(dtype):
    """A varlen decode batch, q [1, N, ...] with cu_seqlens 0, 1, ..., N: with the host copy
    (`cu_seqlens_cpu`) it runs the one-token kernel and equals the dense [N, 1] call bit for bit (same
    binary, same strides), paged pool with a padding index; without the host copy it runs the loop
    kernel, within rounding of it; both within 1e-5 of the oracle (fp32 pool). Host bounds that are not
    0, 1, ..., N (an empty and a two-token sequence, same T) keep the loop kernel and match the oracle."""
    from kda.plan import decode_plan

    chosen = []
    N, H, HV, K, V = 4, 1, 2, 16, 24
    q, k, v, g, beta, opts = make_inputs(N, 1, H, HV, K, V, gate="lower_bound", beta_sigmoid=True, seed=12)
    kw = dict(state_v_first=True, use_qk_l2norm_in_kernel=True, **opts)
    idx = torch.tensor([5, 1, -1, 3], dtype=torch.int32, device=DEVICE)
    used, keep = [5, 1, 3], [0, 1, 3]
    wide, pool = poisoned_pool(7, state_plane(HV, K, V, True), dtype, DEVICE, pad=16)
    pool.copy_(random_planes(7, HV, K, V, True, seed=40).to(dtype))
    start = wide.clone()

    def run(varlen, host):
        wide.copy_(start)
        args = [x.transpose(0, 1) if varlen else x for x in (q, k, v, g, beta)]  # [1, N, ...] views
        extra = {}
        if varlen:
            cu = torch.arange(N + 1, dtype=torch.int32)
            extra = dict(cu_seqlens=cu.to(DEVICE), cu_seqlens_cpu=cu if host else None)
        call_kw = dict(state_cache=pool, state_indices=idx, **extra, **kw)
        chosen.append(decode_plan(checked_call(kda.fused_recurrent_kda, *args, **call_kw)).nsub > 0)
        o, _ = kda.fused_recurrent_kda(*args, **call_kw)
        return (o.transpose(0, 1) if varlen else o).clone(), wide.clone()

    o_d, w_d = run(False, False)
    o_h, w_h = run(True, True)
    o_l, w_l = run(True, False)
    assert chosen == [True, True, False]
    assert same_bits(o_h, o_d) and same_bits(w_h, w_d)
    u = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -8
    assert rel(o_l[keep], o_h[keep]) <= 2 * 2.0 ** -24 + 1e-6
    plane = HV * K * V
    assert rel(w_l[used, :plane].float(), w_h[used, :plane].float()) <= 2 * u + 1e-6
    assert torch.equal(o_h[2], torch.zeros_like(o_h[2]))
    untouched = [s for s in range(7) if s not in used]
    assert same_bits(w_h[untouched], start[untouched]) and same_bits(w_h[used, plane:], start[used, plane:])
    if dtype == torch.float32:
        pool_ref = start.clone()[:, : HV * K * V].unflatten(1, pool.shape[1:])
        o_ref, _ = ref.recurrent_kda(q, k, v, g, beta, state_cache=pool_ref, state_indices=idx, **kw)
        assert rel(o_h[keep], o_ref[keep]) <= FP32_TOL
        assert rel(w_h[used, :plane], pool_ref[used].flatten(1)) <= FP32_TOL

    # host bounds with an empty and a two-token sequence (T = N still): the loop kernel, right answer
    bounds = torch.tensor([0, 1, 1, 3, 4], dtype=torch.int32)
    args = [x.transpose(0, 1) for x in (q, k, v, g, beta)]
    dense_init = random_planes(N, HV, K, V, True, seed=41)
    call_kw = dict(cu_seqlens=bounds.to(DEVICE), cu_seqlens_cpu=bounds, initial_state=dense_init,
                   output_final_state=True, **kw)
    assert decode_plan(checked_call(kda.fused_recurrent_kda, *args, **call_kw)).nsub == 0
    o, s = kda.fused_recurrent_kda(*args, **call_kw)
    o_ref, s_ref = ref.recurrent_kda(*args, cu_seqlens=bounds.to(DEVICE), initial_state=dense_init,
                                     output_final_state=True, **kw)
    assert rel(o, o_ref) <= FP32_TOL and rel(s, s_ref) <= FP32_TOL



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_token_k_words_any_block(dtype):
    """The 2-byte K-first words held at BV 128 (the NVIDIA tile at K = 128: 16384 elements a program) and at BV 64
    and 32 agree: under the interpreter bit for bit (a column's sums over K do not depend on the block around
    it); compiled, each block's layout splits the sums over K between threads and warps in its own order, so
    outputs within 1e-6 and stored values within one storage ulp (the bitwise form failed on an H100). Full tiles
    (V = 256, two blocks of 128) and a masked one (V = 200), against the oracle too."""
    for V in (256, 200):
        N, H, HV, K = 3, 1, 2, 32
        q, k, v, g, beta, opts = make_inputs(N, 1, H, HV, K, V, gate="lower_bound", beta_sigmoid=True, seed=31)
        idx = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
        kw = dict(state_v_first=False, use_qk_l2norm_in_kernel=True, state_indices=idx, **opts)
        wide, pool = poisoned_pool(6, state_plane(HV, K, V, False), dtype, DEVICE, pad=16)
        for slot in (4, 0, 2):
            pool[slot] = random_planes(1, HV, K, V, False, seed=60 + slot)[0].to(dtype)
        before = wide.clone()
        init = pool[[4, 0, 2]].clone()
        runs = []
        for BV in (128, 64, 32):
            wide.copy_(before)
            o, _, plan = run_planned(kda.fused_recurrent_kda, q, k, v, g, beta, dict(BV=BV), state_cache=pool, **kw)
            assert plan.packed and plan.BV == BV
            runs.append((o, wide.clone()))
        u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
        for o, w in runs[1:]:
            if DEVICE == "cpu":
                assert same_bits(o, runs[0][0]) and same_bits(w, runs[0][1])
            else:  # the planes written within one storage ulp (2u of their size), every other bit kept
                w0, plane = runs[0][1], HV * K * V
                a, b = w[[4, 0, 2], :plane].double(), w0[[4, 0, 2], :plane].double()
                assert rel(o, runs[0][0]) <= 1e-6
                assert ((a - b).abs() <= 2 * u * torch.maximum(a.abs(), b.abs()) + 2.0 ** -24).all()
                assert same_bits(w[[1, 3, 5]], w0[[1, 3, 5]]) and same_bits(w[:, plane:], w0[:, plane:])
        o_ref, s_ref = ref.recurrent_kda(*(x.double() for x in (q, k, v, g, beta)), initial_state=init.double(),
                                         output_final_state=True, allow_float64=True,
                                         **{a: b for a, b in kw.items() if a != "state_indices"})
        assert rel(runs[0][0], o_ref) <= FP32_TOL
        assert rel(runs[0][1][[4, 0, 2], :HV * K * V].view(N, HV, K, V), s_ref) <= u
