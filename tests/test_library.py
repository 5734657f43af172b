"""`kda.library`: both public functions as `torch.library` custom ops (`kda::chunk_kda`,
`kda::fused_recurrent_kda`), for `torch.compile`.

- `torch.library.opcheck` on both ops, a dense and a paged call each; every opcheck sub-test runs on fresh
  arguments (a fresh pool and `out`), since the ops write the pool in place and opcheck calls them several
  times.
- `torch.compile(fullgraph=True)` of a tiny layer (Linear -> q, k, v; a paged chunked prefill; a paged
  decode step on the same pool) equals the eager layer bit for bit, outputs and pool.
- A plain call never goes through the dispatcher (the ops' real implementations count their runs).
- Speculative verify (`state_indices` `[N, T_max]`, `num_accepted_tokens`): opcheck of
  `kda::fused_recurrent_kda`, and a compiled verify step equal to the eager one.
- Prefix-cache checkpoints (`checkpoint_every`, `checkpoint_indices`): opcheck of `kda::chunk_kda`, and a
  compiled prefill with checkpoints equal to the eager one.
"""

import pytest
import torch
from conftest import DEVICE
from helpers import make_inputs, same_bits

import kda  # TRITON_INTERPRET is set by conftest.py when there is no GPU
from kda import library

K = V = 16
H = HV = 2
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def pool_of(slots, v_first, dtype=torch.float32, seed=3):
    """A pool of finite random planes (opcheck compares results with NaN != NaN, so no poison here)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (slots, HV, V, K) if v_first else (slots, HV, K, V)
    return (0.5 * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


def op_kwargs(fn: str, **given) -> dict:
    """Every argument of the op after (q, k, v, g, beta): the public defaults, then `given`."""
    kw = dict(scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
              lower_bound=None, cu_seqlens=None, cu_seqlens_cpu=None, state_v_first=None, state_cache=None,
              state_indices=None, has_initial_state=None, state_dtype=None, errors=None)
    if fn == "fused_recurrent_kda":
        kw.update(stochastic_rounding=False, seed=0)
    kw.update(given)
    return kw


def dense_case(fn: str):
    """A dense batch B = 2 with a K-first initial state and the final state asked for, the gate in the kernel."""
    T = 1 if fn == "fused_recurrent_kda" else 37
    q, k, v, g, beta, gate = make_inputs(2, T, H, HV, K, V, gate="lower_bound", device=DEVICE, seed=1)
    kw = op_kwargs(fn, initial_state=pool_of(2, False), output_final_state=True, use_qk_l2norm_in_kernel=True,
                   out=torch.empty_like(v), **gate)
    return (q, k, v, g, beta), kw


def paged_case(fn: str):
    """Varlen with an empty sequence and a padding slot into a V-first bf16 pool of 5 slots, host bounds given."""
    bounds = [0, 1, 2, 3] if fn == "fused_recurrent_kda" else [0, 17, 17, 40]
    q, k, v, g, beta, _ = make_inputs(1, bounds[-1], H, HV, K, V, device=DEVICE, seed=2)
    kw = op_kwargs(fn, cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=DEVICE),
                   cu_seqlens_cpu=torch.tensor(bounds), state_v_first=True,
                   state_cache=pool_of(5, True, torch.bfloat16),
                   state_indices=torch.tensor([3, -1, 0], dtype=torch.int32, device=DEVICE),
                   has_initial_state=torch.tensor([True, False, False], device=DEVICE), out=torch.empty_like(v))
    return (q, k, v, g, beta), kw


def verify_case(fn: str):
    """Speculative verify: varlen lengths 3, 1, 2 (host bounds given) into a K-first fp32 pool of 10 slots,
    the last sequence padding, states read from the column of each sequence's last accepted draft."""
    assert fn == "fused_recurrent_kda"
    bounds = [0, 3, 4, 6]
    q, k, v, g, beta, _ = make_inputs(1, bounds[-1], H, HV, K, V, device=DEVICE, seed=4)
    kw = op_kwargs(fn, cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=DEVICE),
                   cu_seqlens_cpu=torch.tensor(bounds), state_v_first=False, state_cache=pool_of(10, False),
                   state_indices=torch.tensor([[0, 1, 2], [3, 4, 5], [-1, 6, 7]], dtype=torch.int32, device=DEVICE),
                   num_accepted_tokens=torch.tensor([2, 3, 1], dtype=torch.int32, device=DEVICE),
                   out=torch.empty_like(v))
    return (q, k, v, g, beta), kw


def checkpoint_case(fn: str):
    """Prefix-cache checkpoints: varlen lengths 70 and 64 (host bounds given) into a K-first fp32 pool of 6
    slots, a checkpoint every 64 tokens (sequence 1 ends at its checkpoint), int64 indices."""
    assert fn == "chunk_kda"
    bounds = [0, 70, 134]
    q, k, v, g, beta, _ = make_inputs(1, bounds[-1], H, HV, K, V, device=DEVICE, seed=5)
    kw = op_kwargs(fn, cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=DEVICE),
                   cu_seqlens_cpu=torch.tensor(bounds), state_v_first=False, state_cache=pool_of(6, False),
                   state_indices=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                   has_initial_state=torch.tensor([True, True], device=DEVICE), out=torch.empty_like(v),
                   checkpoint_every=64, checkpoint_indices=torch.tensor([[2, 5], [3, 4]], device=DEVICE))
    return (q, k, v, g, beta), kw


OPS = {"chunk_kda": library.chunk_kda_op, "fused_recurrent_kda": library.fused_recurrent_kda_op}


@pytest.mark.parametrize("util", OPCHECK_UTILS)
@pytest.mark.parametrize("case", ["dense", "paged"])
@pytest.mark.parametrize("fn", list(OPS))
def test_opcheck(fn, case, util):
    """Each opcheck sub-test on its own fresh arguments (pool and `out`): the ops write the pool in place and
    opcheck runs them several times. Every sub-test passes with in-place pools (opcheck runs each on copies
    it makes itself; all four at once on one set of arguments pass too); one set per sub-test keeps a
    failure from leaking into the next and names the failing sub-test."""
    args, kw = (dense_case if case == "dense" else paged_case)(fn)
    torch.library.opcheck(OPS[fn], args, kw, test_utils=util)


@pytest.mark.parametrize("util", OPCHECK_UTILS)
def test_opcheck_verify(util):
    """The speculative verify form of `kda::fused_recurrent_kda` (2-D state_indices, num_accepted_tokens)."""
    args, kw = verify_case("fused_recurrent_kda")
    torch.library.opcheck(OPS["fused_recurrent_kda"], args, kw, test_utils=util)


def test_compile_fullgraph_verify_step():
    """A compiled verify step (fullgraph, aot_eager) equals the eager one bit for bit, outputs and pool."""
    (q, k, v, g, beta), kw = verify_case("fused_recurrent_kda")

    def step(q, k, v, g, beta, pool, cu, idx, accepted):
        return kda.fused_recurrent_kda(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=[0, 3, 4, 6],
                                       state_cache=pool, state_indices=idx, num_accepted_tokens=accepted,
                                       state_v_first=False)[0]

    pool0 = kw["state_cache"]
    rest = (kw["cu_seqlens"], kw["state_indices"], kw["num_accepted_tokens"])
    with torch.no_grad():
        pool_e = pool0.clone()
        o_e = step(q, k, v, g, beta, pool_e, *rest)
        before = library.calls["fused_recurrent_kda"]
        pool_c = pool0.clone()
        o_c = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, g, beta, pool_c, *rest)
    assert library.calls["fused_recurrent_kda"] == before + 1
    assert same_bits(o_c, o_e) and same_bits(pool_c, pool_e) and not same_bits(pool_e, pool0)
    assert same_bits(pool_e[8:], pool0[8:])  # never named


@pytest.mark.parametrize("util", OPCHECK_UTILS)
def test_opcheck_checkpoints(util):
    """`kda::chunk_kda` with prefix-cache checkpoints (`checkpoint_every`, `checkpoint_indices`)."""
    args, kw = checkpoint_case("chunk_kda")
    torch.library.opcheck(OPS["chunk_kda"], args, kw, test_utils=util)


def test_compile_fullgraph_checkpoint_prefill():
    """A compiled prefill with checkpoints (fullgraph, aot_eager) equals the eager one bit for bit, outputs
    and pool (checkpoint slots included)."""
    (q, k, v, g, beta), kw = checkpoint_case("chunk_kda")

    def step(q, k, v, g, beta, pool, cu, idx, has, ckpt):
        return kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=[0, 70, 134], state_cache=pool,
                             state_indices=idx, has_initial_state=has, state_v_first=False, checkpoint_every=64,
                             checkpoint_indices=ckpt)[0]

    pool0 = kw["state_cache"]
    rest = (kw["cu_seqlens"], kw["state_indices"], kw["has_initial_state"], kw["checkpoint_indices"])
    with torch.no_grad():
        pool_e = pool0.clone()
        o_e = step(q, k, v, g, beta, pool_e, *rest)
        before = library.calls["chunk_kda"]
        pool_c = pool0.clone()
        o_c = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, g, beta, pool_c, *rest)
    assert library.calls["chunk_kda"] == before + 1
    assert same_bits(o_c, o_e) and same_bits(pool_c, pool_e)
    assert not same_bits(pool_e[[2, 3]], pool0[[2, 3]])  # the checkpoints reached
    assert same_bits(pool_e[[4, 5]], pool0[[4, 5]])  # entries past the sequences' ends


def test_fake_final_state_shapes():
    """The fake implementation's final state: [N, *plane] in the right dtype, [0] when paged or not asked."""
    (q, k, v, g, beta), kw = dense_case("chunk_kda")
    with torch._subclasses.FakeTensorMode() as mode:
        fq, fk, fv, fg, fb = (mode.from_tensor(x) for x in (q, k, v, g, beta))
        fkw = {n: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
        s = torch.ops.kda.chunk_kda(fq, fk, fv, fg, fb, **fkw)
        assert s.shape == (2, HV, K, V) and s.dtype == torch.float32
        fkw.update(initial_state=None, state_dtype=torch.bfloat16, state_v_first=True)
        s = torch.ops.kda.chunk_kda(fq, fk, fv, fg, fb, **fkw)
        assert s.shape == (2, HV, V, K) and s.dtype == torch.bfloat16
        fkw.update(output_final_state=False)
        s = torch.ops.kda.chunk_kda(fq, fk, fv, fg, fb, **fkw)
        assert s.shape == (0,) and s.dtype == torch.bfloat16


class TinyLayer(torch.nn.Module):
    """q, k, v from one Linear; a paged chunked prefill (varlen, a padding slot), then one paged decode step
    on the same pool with the next token of each live sequence."""

    def __init__(self, d=24):
        super().__init__()
        self.proj = torch.nn.Linear(d, 3 * H * K, bias=False)

    def qkv(self, x):
        q, k, v = self.proj(x).split(H * K, dim=-1)
        return (t.unflatten(-1, (H, K)) for t in (q, k, v))

    def forward(self, x, g, beta, x1, g1, beta1, pool, cu, slots, has):
        q, k, v = self.qkv(x)
        o, _ = kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=[0, 19, 19, 30],
                             state_cache=pool, state_indices=slots, has_initial_state=has, state_v_first=True,
                             use_qk_l2norm_in_kernel=True)
        q1, k1, v1 = self.qkv(x1)
        o1, _ = kda.fused_recurrent_kda(q1, k1, v1, g1, beta1, state_cache=pool, state_indices=slots,
                                        state_v_first=True, use_qk_l2norm_in_kernel=True)
        return o, o1


def test_compile_fullgraph_tiny_layer():
    """torch.compile(fullgraph=True) traces the layer without a graph break and equals the eager layer bit
    for bit (outputs and pool). backend="aot_eager": it runs Dynamo, the fake implementations and
    functionalization of the mutated `out` and pool (what inductor would consume), without inductor's C++
    compile of the Linear, which costs minutes on 2 loaded CPU cores and tests nothing of kda's (the custom
    ops stay opaque calls under inductor as well). The GPU suite may run inductor."""
    torch.manual_seed(0)
    layer = TinyLayer().to(DEVICE)
    gen = torch.Generator().manual_seed(5)
    T, N = 30, 3
    x = torch.randn(1, T, 24, generator=gen).to(DEVICE)
    g = (-0.5 * torch.rand(1, T, HV, K, generator=gen)).to(DEVICE)
    beta = torch.rand(1, T, HV, generator=gen).to(DEVICE)
    x1 = torch.randn(N, 1, 24, generator=gen).to(DEVICE)
    g1 = (-0.5 * torch.rand(N, 1, HV, K, generator=gen)).to(DEVICE)
    beta1 = torch.rand(N, 1, HV, generator=gen).to(DEVICE)
    cu = torch.tensor([0, 19, 19, 30], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([2, -1, 0], dtype=torch.int32, device=DEVICE)
    has = torch.tensor([True, False, False], device=DEVICE)
    pool0 = pool_of(4, True)

    with torch.no_grad():
        pool_e = pool0.clone()
        o_e, o1_e = layer(x, g, beta, x1, g1, beta1, pool_e, cu, slots, has)
        before = dict(library.calls)
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        pool_c = pool0.clone()
        o_c, o1_c = compiled(x, g, beta, x1, g1, beta1, pool_c, cu, slots, has)
    assert library.calls["chunk_kda"] == before["chunk_kda"] + 1
    assert library.calls["fused_recurrent_kda"] == before["fused_recurrent_kda"] + 1
    assert same_bits(o_c, o_e) and same_bits(o1_c, o1_e) and same_bits(pool_c, pool_e)
    assert not same_bits(pool_e, pool0)  # the pool was written
    assert same_bits(pool_e[1], pool0[1]) and same_bits(pool_e[3], pool0[3])  # unnamed slots untouched


def test_plain_call_bypasses_the_dispatcher():
    """Outside torch.compile, both public functions launch directly: the ops' implementations never run.
    A direct op call gives the plain call's bits."""
    before = dict(library.calls)
    for fn in OPS:
        args, kw = dense_case(fn)
        out = kw.pop("out")
        kw = {n: x for n, x in kw.items() if n not in ("stochastic_rounding", "seed") or fn != "chunk_kda"}
        o, s = getattr(kda, fn)(*args, **kw)
        assert library.calls == before
        s_op = OPS[fn](*args, out=out, **kw)
        assert same_bits(out, o) and same_bits(s_op, s)
        before[fn] += 1
        assert library.calls == before
