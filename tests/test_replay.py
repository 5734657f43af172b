"""Recorded decode launches (`kda.replay`): a call of a kind seen before skips the checks and the argument
assembly, so each test states what that could break. A hit must give the bits the full path gives (new
tensors' addresses, a new seed, a new `out`, untouched slots), must not hit where anything the checks or the
plan read differs, and must still refuse what depends on the addresses (an `out` overlapping an input, an
alignment the compiled kernel was not specialised for)."""

from __future__ import annotations

import inspect

import pytest
import torch
import triton
from conftest import DEVICE
from helpers import make_inputs, poisoned_pool, rel_err, same_bits
from triton.tools.tensor_descriptor import TensorDescriptor

import kda
from kda import api, contract, replay

N, H, K = 6, 2, 64


def test_keys_name_every_parameter():
    """A parameter of `fused_recurrent_kda` (but its seed, filled in per call) or of `chunk_kda` missing from
    its key would let two calls that differ in it share one recording."""
    public = list(inspect.signature(kda.fused_recurrent_kda).parameters)
    assert sorted(public) == sorted(list(inspect.signature(replay.decode_key).parameters) + ["seed"])
    public = list(inspect.signature(kda.chunk_kda).parameters)
    assert sorted(public) == sorted(inspect.signature(replay.chunk_key).parameters)


def test_walk_beside_prepare_replays_on_one_stream():
    """`replay._programmatic`: a recorded walk beside the prepare (fork, the prepare's launch, the walk on the side
    stream, join) replays as the walk then the prepare on the caller's stream, the prepare launched as the walk's
    programmatic dependent (its launcher's pdl flag set, nothing else of its launch changed); the tail form (the
    prepare's first launch before the fork) the same; a launch after the join (the walk's resume) stays after
    both; any other order, or a launcher without that flag, as recorded."""
    side = object()

    def entry(pdl=0):
        return ("run", (0, pdl, None, None), 1, 1, 1, "fn", "packed", ("args",), None, (), ())

    def walked(*main_launches):  # gate (0), [prepare part 1 (3)], fork, prepare (1), walk (2) on the side, join
        return [*((0, i, None) for i in main_launches), (1, (side, None), 0), (0, 1, None), (0, 2, side),
                (1, (None, side), 1)]

    for first in ((0,), (0, 3)):
        launches = [entry(), entry(), entry(), entry()]
        order = replay._programmatic(walked(*first), launches)
        assert order == [*((0, i, None) for i in first), (0, 2, None), (0, 1, None)]
        assert launches[1] == entry(pdl=1) and launches[0] == launches[2] == launches[3] == entry()
    # the walk's resume launch (`kda.ops.overlap`), after the join: after both, as recorded
    launches = [entry() for _ in range(5)]
    order = replay._programmatic([*walked(0), (0, 4, None)], launches)
    assert order == [(0, 0, None), (0, 2, None), (0, 1, None), (0, 4, None)] and launches[4] == entry()
    # the split prepare (two launches between the fork and the walk), a decode (no wait), another launcher
    split = [(0, 0, None), (1, (side, None), 0), (0, 1, None), (0, 3, None), (0, 2, side), (1, (None, side), 1)]
    launches = [entry(), entry(), entry(), entry()]
    assert replay._programmatic(list(split), launches) == split and launches == [entry()] * 4
    assert replay._programmatic([(0, 0, None)], [entry()]) == [(0, 0, None)]
    other = [("run", (), 1, 1, 1, "fn", "packed", (), None, (), ())] * 3
    assert replay._programmatic(walked(0), other) == walked(0)


def test_dependent_launch_replays_with_pdl():
    """`replay._programmatic`: a launch noted as a programmatic dependent (`kda.ops.launch.dependent`: the routed
    short sequences' loop after the walk) replays with its launcher's PDL flag set, nothing else of it or of any
    other launch changed, the order as recorded; not where it is the first launch, follows a stream wait, or runs
    on another stream than the launch before it, nor with a launcher that takes no such flag."""
    side = object()

    def entry(pdl=0):
        return ("run", (0, pdl, None, None), 1, 1, 1, "fn", "packed", ("args",), None, (), ())

    plain = [(0, 0, None), (0, 1, None), (0, 2, None)]  # gate, prepare, walk, then the loop (3)
    launches = [entry() for _ in range(4)]
    order = replay._programmatic([*plain, (0, 3, None)], launches, [3])
    assert order == [*plain, (0, 3, None)]
    assert launches[3] == entry(pdl=1) and launches[:3] == [entry()] * 3
    for bad_order, noted in (([(0, 0, None), (0, 1, None)], [0]),  # the first launch
                             ([(0, 0, None), (1, (side, None), 0), (0, 1, None)], [1]),  # after a wait
                             ([(0, 0, side), (0, 1, None)], [1])):  # after a launch on another stream
        launches = [entry(), entry()]
        assert replay._programmatic(list(bad_order), launches, noted) == bad_order
        assert launches == [entry(), entry()]
    other = [("run", (), 1, 1, 1, "fn", "packed", (), None, (), ())] * 2
    assert replay._programmatic([(0, 0, None), (0, 1, None)], list(other), [1]) == [(0, 0, None), (0, 1, None)]


SANITIZER_PRELOAD = "/opt/cuda/compute-sanitizer/TreeLauncherTargetLdPreloadHelper"


@pytest.mark.parametrize("env,serial", [
    ({}, False), ({"CUDA_LAUNCH_BLOCKING": "0"}, False), ({"CUDA_LAUNCH_BLOCKING": "1"}, True),
    ({"CUDA_LAUNCH_BLOCKING": "TRUE"}, True), ({"CUDA_INJECTION64_PATH": "/opt/tool/libinject.so"}, True),
    ({"LD_PRELOAD": SANITIZER_PRELOAD}, True), ({"LD_PRELOAD": "/usr/lib/libjemalloc.so"}, False),
    ({"NV_SANITIZER_INJECTION_PORT_BASE": "49152"}, True), ({"NV_NSIGHT_INJECTION_PORT_BASE": "49152"}, True),
    ({"NV_SANITIZER_INJECTION_PORT_BASE": ""}, False),
])
def test_serialising_environments_keep_the_recorded_order(env, serial, monkeypatch):
    """Where kernels may run one at a time (launch blocking, an injected CUDA tool) the walk must not be launched
    before the prepare it waits on: `_serialising` says so, and `remember` then keeps the recorded order."""
    for name in ("CUDA_LAUNCH_BLOCKING", "LD_PRELOAD", *replay.TOOL_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert replay._serialising() == serial


def test_key_is_none_off_the_gpu_and_for_uncovered_types():
    q = torch.zeros(1, 1, 1, 16)
    args = dict(q=q, k=q, v=q, g=q, beta=q[..., 0], scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, use_gate_in_kernel=False,
                A_log=None, dt_bias=None, lower_bound=None, cu_seqlens=None, cu_seqlens_cpu=None,
                state_v_first=None, state_cache=None, state_indices=None, has_initial_state=None,
                num_accepted_tokens=None, state_dtype=None, out=None, stochastic_rounding=False, errors=None)
    assert replay.decode_key(**args) is None  # CPU tensors: the interpreter always takes the full path
    if DEVICE != "cuda":
        return
    cuda = {n: (x.cuda() if isinstance(x, torch.Tensor) else x) for n, x in args.items()}
    assert replay.decode_key(**cuda) is not None
    for name, bad in (("scale", torch.tensor(1.0)), ("lower_bound", "x"), ("cu_seqlens_cpu", {0: 1}),
                      ("state_dtype", "float32"), ("A_log", [1.0])):
        assert replay.decode_key(**dict(cuda, **{name: bad})) is None, name


def test_host_bounds_recorded_are_compared_by_value():
    """`cu_seqlens_cpu` decides routing and grids: the key holds its length (and a tensor's dtype), the
    recording its values. Bounds that differ in any value are not the recorded ones; equal values in a new
    list, a tuple, a new tensor or a non-contiguous view are; a list mutated after the recording does not
    change what was recorded."""
    values = [0, 1, 4, 4, 9]
    cu = torch.tensor(values, dtype=torch.int32)
    for given in (values, tuple(values), cu):
        kept = replay._bounds_value(given)
        assert replay._bounds(given) == replay._bounds(type(given)(given) if not torch.is_tensor(given) else cu)
        same = [list(values), tuple(values)] if not torch.is_tensor(given) else [
            cu.clone(), torch.tensor([0, 0, 1, 1, 4, 4, 4, 4, 9, 9], dtype=torch.int32)[::2]]
        for x in same:
            assert replay._bounds(x) == replay._bounds(given) and replay._same_bounds(x, kept)
        other = [0, 1, 4, 5, 9]
        x = other if not torch.is_tensor(given) else torch.tensor(other, dtype=torch.int32)
        assert replay._bounds(x) == replay._bounds(given) and not replay._same_bounds(x, kept)
    for x in ([0, 1, 4, 9], cu[:-1], cu.long()):  # another length or dtype: another kind
        assert replay._bounds(x) not in (replay._bounds(values), replay._bounds(cu))
    mutable = list(values)
    kept = replay._bounds_value(mutable)
    mutable[2] = 5
    assert not replay._same_bounds(mutable, kept) and replay._same_bounds(values, kept)


def test_a_recording_that_fails_never_fails_the_call(monkeypatch):
    """The call has run when its launches are recorded: a recording that finds the kind unrecordable leaves the
    call's result and no entry for its key."""
    monkeypatch.setattr(replay, "recording", lambda: [])
    monkeypatch.setattr(replay, "stop", lambda: None)

    def broken(*args):
        replay.CACHE["kind"] = "half-made"
        raise replay.Unrecordable("cannot record")

    monkeypatch.setattr(replay, "remember", broken)
    monkeypatch.setattr(replay, "CACHE", {})
    result = ("o", None)
    assert api._recorded("kind", (), None, lambda call: result, None) is result
    assert "kind" not in replay.CACHE


def _decode_case(v_first: bool, dtype, form: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta, kw = make_inputs(N, 1, H, H, K, K, dtype=torch.bfloat16, gate="lower_bound", device=DEVICE,
                                       seed=seed, beta_sigmoid=True)
    plane = (H, K, K)
    storage, pool = poisoned_pool(4 * N, plane, dtype, device=DEVICE, pad=8)
    pool[1::4] = torch.randn(N, *plane, generator=gen).to(DEVICE, dtype)
    idx = torch.arange(1, 4 * N, 4, dtype=torch.int32, device=DEVICE)
    idx[2] = -1  # a padding sequence
    call = dict(state_cache=pool, state_indices=idx, state_v_first=v_first, use_qk_l2norm_in_kernel=True, **kw)
    if form == "varlen":
        q, k, v, g, beta = (x.reshape(1, N, *x.shape[2:]) for x in (q, k, v, g, beta))
        call.update(cu_seqlens=torch.arange(N + 1, dtype=torch.int32, device=DEVICE),
                    cu_seqlens_cpu=list(range(N + 1)))
    if form == "verify":
        T = 3
        q, k, v, g, beta = (x.reshape(N // T, T, *x.shape[2:]) for x in (q, k, v, g, beta))
        # sequence 0 starts from slot 1 (its second draft's), sequence 1 from slot 5: both hold random states
        call.update(state_indices=torch.tensor([[2, 1, 3], [5, 6, 7]], dtype=torch.int32, device=DEVICE),
                    num_accepted_tokens=torch.tensor([2, 1], dtype=torch.int32, device=DEVICE))
    return (q, k, v, g, beta), call, storage


def _run(inputs, call, storage, **extra):
    st = storage.clone()
    pool = st[:, :call["state_cache"][0].numel()].view(call["state_cache"].shape)
    o, final = kda.fused_recurrent_kda(*inputs, **dict(call, state_cache=pool, **extra))
    torch.cuda.synchronize()
    assert final is None
    return o.clone(), st


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["dense", "varlen", "verify"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v_first", [True, False])
def test_hit_equals_the_full_path(monkeypatch, v_first, dtype, form):
    """Record a kind, then call it with new tensors (other values, other memory): the hit, which skips
    `check_call`, gives the full path's bits in the output and in every slot of the pool."""
    replay.CACHE.clear()
    first = _decode_case(v_first, dtype, form, seed=1)
    _run(*first)
    assert len(replay.CACHE) == 1
    second = _decode_case(v_first, dtype, form, seed=2)
    with monkeypatch.context() as m:  # the hit may not validate or plan
        m.setattr(api, "check_call", lambda *a, **kw: pytest.fail("a recorded kind took the full path"))
        hit = _run(*second)
    replay.CACHE.clear()
    with monkeypatch.context() as m:
        m.setattr(replay, "CAPACITY", 0)  # nothing recorded: the full path
        m.setattr(replay, "CACHE", {})
        full = _run(*second)
    assert same_bits(hit[0], full[0]) and same_bits(hit[1], full[1])


@pytest.mark.gpu
def test_hit_with_out_final_state_errors_and_seed():
    """A dense final state and `o` allocated anew per hit, the caller's `out` and `errors` written, and each
    call's seed honoured (stochastic rounding into a bf16 final state)."""
    replay.CACHE.clear()
    q, k, v, g, beta, kw = make_inputs(N, 1, H, H, K, K, dtype=torch.bfloat16, gate="lower_bound", device=DEVICE,
                                       beta_sigmoid=True)
    h0 = torch.randn(N, H, K, K, device=DEVICE)
    call = dict(initial_state=h0, output_final_state=True, state_dtype=torch.float32, **kw)
    results = []
    for seed in (3, 4):  # a seed without stochastic rounding changes nothing
        for use_out in (False, True):
            out = torch.full_like(v, float("nan")) if use_out else None
            errors = torch.zeros(N, dtype=torch.int32, device=DEVICE)
            o1, f1 = kda.fused_recurrent_kda(q, k, v, g, beta, out=out, errors=errors, seed=seed, **call)
            o2, f2 = kda.fused_recurrent_kda(q, k, v, g, beta, out=out, errors=errors, seed=seed, **call)  # a hit
            assert (o1 is out) == use_out and f1 is not f2 and o1.data_ptr() != f1.data_ptr()
            results.append((o1.clone(), f1, o2, f2))
    torch.cuda.synchronize()
    for o1, f1, o2, f2 in results:
        assert same_bits(o1, o2) and same_bits(f1, f2)
    # stochastic rounding: the seed reaches the kernel on a hit
    bf = dict(call, initial_state=h0.bfloat16(), state_dtype=torch.bfloat16, stochastic_rounding=True)
    kda.fused_recurrent_kda(q, k, v, g, beta, seed=0, **bf)
    s5 = kda.fused_recurrent_kda(q, k, v, g, beta, seed=5, **bf)[1]
    s6 = kda.fused_recurrent_kda(q, k, v, g, beta, seed=6, **bf)[1]
    replay.CACHE.clear()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(replay, "CAPACITY", 0)
        m.setattr(replay, "CACHE", {})
        f5 = kda.fused_recurrent_kda(q, k, v, g, beta, seed=5, **bf)[1]
        f6 = kda.fused_recurrent_kda(q, k, v, g, beta, seed=6, **bf)[1]
    assert same_bits(s5, f5) and same_bits(s6, f6) and not same_bits(s5, s6)


@pytest.mark.gpu
def test_hit_still_refuses_what_depends_on_addresses():
    """After a kind is recorded: an `out` that overlaps q raises as the full path does, and inputs at an
    address not 16-byte aligned run a binary compiled for that (the aligned one's vector loads would fault)
    and give the aligned call's answer to rounding."""
    replay.CACHE.clear()
    q, k, v, g, beta, kw = make_inputs(N, 1, H, H, K, K, dtype=torch.bfloat16, gate="lower_bound", device=DEVICE,
                                       beta_sigmoid=True)
    buf = torch.zeros(2 * q.numel() + 8, dtype=q.dtype, device=DEVICE)
    out = torch.empty_like(v)
    kda.fused_recurrent_kda(q, k, v, g, beta, out=out, **kw)
    kda.fused_recurrent_kda(q, k, v, g, beta, out=out, **kw)
    assert len(replay.CACHE) == 1
    q_in_buf = buf[:q.numel()].view(q.shape)
    q_in_buf.copy_(q)
    overlapping = buf[q.numel() // 2:q.numel() // 2 + v.numel()].view(v.shape)
    with pytest.raises(ValueError, match="out overlaps q"):
        kda.fused_recurrent_kda(q_in_buf, k, v, g, beta, out=overlapping, **kw)
    # misaligned q, k, v (2 bytes past a 16-byte boundary): the same key, another specialisation
    views = []
    for x in (q, k, v):
        b = torch.zeros(x.numel() + 1, dtype=x.dtype, device=DEVICE)
        b[1:] = x.reshape(-1)
        views.append(b[1:].view(x.shape))
    o_mis = kda.fused_recurrent_kda(*views, g, beta, out=torch.empty_like(v), **kw)[0]
    o_ref = kda.fused_recurrent_kda(q, k, v, g, beta, out=torch.empty_like(v), **kw)[0]
    torch.cuda.synchronize()
    assert rel_err(o_mis, o_ref) < 1e-2


@pytest.mark.gpu
def test_a_changed_property_is_another_kind():
    """Calls that differ only in what the checks read (a dtype, a stride, a flag, host bounds) are not hits
    of a recorded kind: a bad one still raises its ValueError/TypeError."""
    replay.CACHE.clear()
    q, k, v, g, beta, kw = make_inputs(N, 1, H, H, K, K, dtype=torch.bfloat16, device=DEVICE)
    kda.fused_recurrent_kda(q, k, v, g, beta, **kw)
    kda.fused_recurrent_kda(q, k, v, g, beta, **kw)
    with pytest.raises(TypeError, match="k must have q's dtype"):
        kda.fused_recurrent_kda(q, k.float(), v, g, beta, **kw)
    with pytest.raises(ValueError, match="out must be"):
        kda.fused_recurrent_kda(q, k, v, g, beta, out=torch.empty_like(v, dtype=torch.float32), **kw)
    qt = q.transpose(2, 3).contiguous().transpose(2, 3)  # the same shape, last dim strided
    with pytest.raises(ValueError, match="stride 1"):
        kda.fused_recurrent_kda(qt, k, v, g, beta, **kw)
    flat = [x.reshape(1, N, *x.shape[2:]) for x in (q, k, v, g, beta)]
    cu = torch.arange(N + 1, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # recorded, then a hit: host bounds of the same length but other values are not
        kda.fused_recurrent_kda(*flat, cu_seqlens=cu, cu_seqlens_cpu=list(range(N + 1)), **kw)
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):
        kda.fused_recurrent_kda(*flat, cu_seqlens=cu, cu_seqlens_cpu=list(range(N)) + [N + 1], **kw)
    with pytest.raises(TypeError, match="scale"):
        kda.fused_recurrent_kda(q, k, v, g, beta, scale=True, **kw)
    assert contract.debug_enabled() is False


def _prefill_case(form: str, seed: int):
    """(inputs, keywords) of a prefill: dense batch with a dense state in and out; varlen whose short
    sequences go to the recurrent loop inside the call (host bounds); paged with checkpoints; a long sequence
    of few heads."""
    H, K = 2, 64
    if form == "dense":
        B, T = 2, 300
    elif form == "long":
        B, T = 1, 4096
    else:
        B, T = 1, 330
    q, k, v, g, beta, kw = make_inputs(B, T, H, H, K, K, dtype=torch.bfloat16, gate="lower_bound", device=DEVICE,
                                       seed=seed, beta_sigmoid=True)
    kw["use_qk_l2norm_in_kernel"] = True
    gen = torch.Generator().manual_seed(seed)
    if form in ("dense", "long"):
        kw.update(initial_state=torch.randn(B, H, K, K, generator=gen).to(DEVICE), output_final_state=True)
    elif form == "varlen":
        bounds = [0, 1, 5, 200, 200, 330]
        kw.update(cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=DEVICE), cu_seqlens_cpu=bounds,
                  initial_state=torch.randn(5, H, K, K, generator=gen).to(DEVICE), output_final_state=True)
    else:  # paged with checkpoints
        bounds = [0, 130, 330]
        storage, pool = poisoned_pool(8, (H, K, K), torch.bfloat16, device=DEVICE)
        pool[1] = torch.randn(H, K, K, generator=gen).to(DEVICE, torch.bfloat16)
        kw.update(cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=DEVICE), cu_seqlens_cpu=bounds,
                  state_cache=pool, state_v_first=False,
                  state_indices=torch.tensor([1, 4], dtype=torch.int32, device=DEVICE),
                  has_initial_state=torch.tensor([True, False], device=DEVICE), checkpoint_every=64,
                  checkpoint_indices=torch.tensor([[2, -1], [5, 6]], dtype=torch.int32, device=DEVICE))
    return (q, k, v, g, beta), kw


def _holds_tensor(x) -> bool:
    if isinstance(x, (torch.Tensor, TensorDescriptor)):
        return True
    return isinstance(x, (tuple, list)) and any(_holds_tensor(y) for y in x)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["dense", "varlen", "paged", "long"])
def test_prefill_hit_equals_the_full_path(monkeypatch, form):
    """A recorded prefill kind (gate pass, prepare and walk; the recurrent loop beside them; checkpoints;
    a long sequence of few heads), called with new tensors: every workspace from one buffer, every
    descriptor rebuilt over it, and the full path's bits in the output, the final state and the pool."""
    replay.CACHE.clear()
    inputs, kw = _prefill_case(form, seed=1)
    kda.chunk_kda(*inputs, **kw)
    assert len(replay.CACHE) == 1
    entry = next(iter(replay.CACHE.values()))
    assert not _holds_tensor(entry.launches)  # a recording keeps no workspace (or input) alive
    inputs, kw = _prefill_case(form, seed=2)
    kw_full = {n: (x.clone() if n == "state_cache" else x) for n, x in kw.items()}
    if triton.__version__.startswith("3.6"):  # Triton 3.6 encodes descriptors per launch: the replay does once
        assert all(d[5] is not None for launch in entry.launches for d in launch[-1])
    pool0 = kw.get("state_cache")
    pool0 = None if pool0 is None else pool0.clone()
    with monkeypatch.context() as m:
        m.setattr(api, "check_call", lambda *a, **kw: pytest.fail("a recorded kind took the full path"))
        o_hit, s_hit = kda.chunk_kda(*inputs, **kw)
        if pool0 is not None:
            pool1 = kw["state_cache"].clone()
            kw["state_cache"].copy_(pool0)
        # again: the workspace at the address of the call before, its descriptors' encodings reused
        o_hit2, s_hit2 = kda.chunk_kda(*inputs, **kw)
    replay.CACHE.clear()
    with monkeypatch.context() as m:
        m.setattr(replay, "CAPACITY", 0)
        o_full, s_full = kda.chunk_kda(*inputs, **kw_full)
    torch.cuda.synchronize()
    assert same_bits(o_hit, o_full) and same_bits(o_hit2, o_full)
    if form == "paged":
        assert s_hit is None and s_full is None
        assert same_bits(pool1, kw_full["state_cache"]) and same_bits(kw["state_cache"], kw_full["state_cache"])
    else:
        assert same_bits(s_hit, s_full) and same_bits(s_hit2, s_full)


@pytest.mark.gpu
@pytest.mark.hopper_plan
@pytest.mark.parametrize("paged", [False, True])
def test_walk_beside_prepare_hit_equals_the_full_path(monkeypatch, paged):
    """A prefill whose walk runs beside its prepare (gate and prepare on the caller's stream, the walk on the
    side stream awaiting counters in a workspace, waits between the streams) recorded and replayed: the full
    path's bits."""
    T, H, K = 32768, 12, 128

    def case(seed):
        q, k, v, g, beta, kw = make_inputs(1, T, H, H, K, K, dtype=torch.bfloat16, gate="lower_bound", device=DEVICE,
                                           beta_sigmoid=True, seed=seed)
        kw["use_qk_l2norm_in_kernel"] = True
        h0 = torch.randn(1, H, K, K, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        if paged:
            pool = torch.full((3, H, K, K), float("nan"), device=DEVICE)
            pool[1] = h0[0]
            kw.update(state_cache=pool, state_v_first=False, state_indices=torch.tensor([1], dtype=torch.int32,
                      device=DEVICE), has_initial_state=torch.ones(1, dtype=torch.bool, device=DEVICE))
        else:
            kw.update(initial_state=h0, output_final_state=True)
        return (q, k, v, g, beta), kw

    from kda import plan
    inputs, kw = case(1)
    call = contract.check_call("chunk_kda", *inputs, None, kw.get("initial_state"), not paged,
                               require_has_initial_state=True, cu_seqlens=None, cu_seqlens_cpu=None,
                               state_dtype=None, out=None,
                               **{n: kw.get(n) for n in ("use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel",
                                                         "use_gate_in_kernel", "A_log", "dt_bias", "lower_bound",
                                                         "state_v_first", "state_cache", "state_indices",
                                                         "has_initial_state")})
    assert plan.chunk_plan(call).wait_chunks > 0
    replay.CACHE.clear()
    kda.chunk_kda(*inputs, **kw)
    assert len(replay.CACHE) == 1
    inputs, kw = case(2)
    kw_full = {n: (x.clone() if n == "state_cache" else x) for n, x in kw.items()}
    with monkeypatch.context() as m:
        m.setattr(api, "check_call", lambda *a, **kw: pytest.fail("a recorded kind took the full path"))
        o_hit, s_hit = kda.chunk_kda(*inputs, **kw)
    replay.CACHE.clear()
    monkeypatch.setattr(replay, "CAPACITY", 0)
    o_full, s_full = kda.chunk_kda(*inputs, **kw_full)
    torch.cuda.synchronize()
    assert same_bits(o_hit, o_full)
    if paged:
        assert same_bits(kw["state_cache"], kw_full["state_cache"])
    else:
        assert same_bits(s_hit, s_full)


@pytest.mark.gpu
@pytest.mark.parametrize("fn", ["decode", "prefill"])
def test_q_k_v_split_from_one_projection_are_recorded(monkeypatch, fn):
    """q, k and v as views of one [tokens, 3 * H * K] projection (one buffer in three roles, as engines pass
    them) are recorded, and a hit with another such buffer gives the full path's bits."""
    H, K = 2, 64
    T = 1 if fn == "decode" else 200
    B = 5 if fn == "decode" else 1

    def call(seed, **extra):
        gen = torch.Generator().manual_seed(seed)
        proj = torch.randn(B, T, 3 * H * K, generator=gen).to(DEVICE, torch.bfloat16)
        q, k, v = (proj[..., i * H * K:(i + 1) * H * K].view(B, T, H, K) for i in range(3))
        g = torch.randn(B, T, H, K, generator=gen).to(DEVICE)
        beta = torch.randn(B, T, H, generator=gen).to(DEVICE)
        kw = dict(use_gate_in_kernel=True, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True,
                  use_qk_l2norm_in_kernel=True, output_final_state=True,
                  initial_state=torch.randn(B, H, K, K, generator=gen).to(DEVICE), **extra)
        f = kda.fused_recurrent_kda if fn == "decode" else kda.chunk_kda
        return f(q, k, v, g, beta, **kw)

    replay.CACHE.clear()
    call(1)
    assert len(replay.CACHE) == 1
    with monkeypatch.context() as m:
        m.setattr(api, "check_call", lambda *a, **kw: pytest.fail("a recorded kind took the full path"))
        o_hit, s_hit = call(2)
    replay.CACHE.clear()
    monkeypatch.setattr(replay, "CAPACITY", 0)
    o_full, s_full = call(2)
    torch.cuda.synchronize()
    assert same_bits(o_hit, o_full) and same_bits(s_hit, s_full)
