"""GPU-only acceptance checks of `chunk_kda`: bf16 inputs, fp32 state, K = V = 128, H = 4,
lower-bound gate, against the float64 oracle (`kda_reference.chunk_kda` in float64 on the GPU, itself
pinned to `recurrent_kda` to 1e-12 by tests/test_reference.py). The rest of the suite also runs on the
GPU (the `device` fixture), which covers the contracts there."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from helpers import bits, checked_call, make_inputs, rel_err, rounding_floor, run_chunk

import kda
import kda_reference as ref
from kda.accuracy.layouts import reorder_bound

pytestmark = pytest.mark.gpu


@triton.jit
def _sm_ids(out):
    """Each program stores the id of the SM it runs on (`%smid`): how many SMs a stream's kernels reach."""
    i = tl.program_id(0)
    tl.store(out + i, tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [i], dtype=tl.int32, is_pure=False,
                                                pack=1))


def sms_reached(stream) -> int:
    """The distinct SMs 4096 one-thread programs launched on `stream` ran on."""
    out = torch.full((4096,), -1, dtype=torch.int32, device="cuda")
    out.record_stream(stream)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _sm_ids[(4096,)](out, num_warps=1)
    torch.cuda.synchronize()
    return out.unique().numel()


def _inputs(T, H=4, K=128, V=128, seed=0):
    """bf16 q, k, v with Kimi's in-kernel gate (lb = -5), q/k l2norm and beta sigmoid; an fp32 h0."""
    q, k, v, g, beta, kw = make_inputs(1, T, H, H, K, V, dtype=torch.bfloat16, gate="lower_bound", device="cuda",
                                       seed=seed, normalize_k=False, beta_sigmoid=True)
    kw["use_qk_l2norm_in_kernel"] = True
    h0 = 0.1 * torch.randn(1, H, K, V, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    return (q, k, v, g, beta), h0, kw


@pytest.mark.parametrize("T,out_bound,state_bound", [(1024, 2.5e-3, 1.5e-3), (16384, 2.5e-3, 1.5e-3)])
def test_bf16_accuracy_against_float64(T, out_bound, state_bound):
    args, h0, kw = _inputs(T)
    o, s = kda.chunk_kda(*args, initial_state=h0, output_final_state=True, **kw)
    ro, rs = ref.chunk_kda(*args, initial_state=h0.double(), output_final_state=True, allow_float64=True, **kw)
    e_o, e_s, floor = rel_err(o, ro), rel_err(s, rs), rounding_floor(ro, torch.bfloat16)
    print(f"\n[accuracy] T={T}: output rel L2 {e_o:.3e} (bf16 floor {floor:.3e}, fla 4.0e-3 at T=1024), "
          f"final state {e_s:.3e} (fla 2.9e-3)")
    assert e_o <= out_bound and e_s <= state_bound


@pytest.mark.parametrize("storage", [torch.float16, torch.bfloat16])
def test_narrow_storage_error_against_fp32_state(storage):
    args, h0, kw = _inputs(1024, seed=1)
    _, s32 = kda.chunk_kda(*args, initial_state=h0, output_final_state=True, **kw)
    o, s = kda.chunk_kda(*args, initial_state=h0.to(storage), output_final_state=True, **kw)
    assert s.dtype == storage
    e = rel_err(s, s32)
    print(f"\n[storage] {storage}: final state vs fp32-state run {e:.3e}")
    assert e <= 2 * torch.finfo(storage).eps  # one rounding on store, plus the initial state's own


def test_paged_equals_dense_bitwise_on_gpu():
    args, h0, kw = _inputs(300, H=2, seed=2)
    q, k, v, g, beta = args
    cu = torch.tensor([0, 100, 100, 300], dtype=torch.int32, device="cuda")
    plane = (2, 128, 128)
    pool = torch.full((7, 2 * 128 * 128 + 64), float("nan"), device="cuda")[:, : 2 * 128 * 128].view(7, *plane)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    h = torch.randn(3, *plane, device="cuda")
    pool[idx.long()] = h
    before = pool.clone()
    has = torch.ones(3, dtype=torch.bool, device="cuda")
    o, _ = kda.chunk_kda(q, k, v, g, beta, state_cache=pool, state_indices=idx, has_initial_state=has,
                         state_v_first=False, cu_seqlens=cu, **kw)
    od, sd = kda.chunk_kda(q, k, v, g, beta, initial_state=h, output_final_state=True, cu_seqlens=cu, **kw)
    assert torch.equal(bits(o), bits(od))
    assert torch.equal(bits(pool[idx.long()]), bits(sd))
    for slot in (1, 3, 5, 6):
        assert torch.equal(bits(pool[slot]), bits(before[slot]))


DECODE_FLAGS = dict(use_gate_in_kernel=True, lower_bound=-5.0, use_qk_l2norm_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True, state_v_first=True)


def _decode_tokens(N, H, K, V, seed, dt=torch.bfloat16):
    """One decode token per sequence: q, k, v in `dt`, the raw gate and beta logits in fp32 (the gate
    parameters come from DECODE_FLAGS)."""
    return make_inputs(N, 1, H, H, K, V, dtype=dt, gate="lower_bound", device="cuda", seed=seed,
                       normalize_k=False, beta_logits=True)[:5]


def _decode_call(N=8, H=2, K=128, V=128, seed=3):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    args = _decode_tokens(N, H, K, V, seed)
    pool = torch.randn(4 * N, H, V, K, device="cuda", generator=gen)
    idx = torch.randperm(4 * N, device="cuda", generator=gen)[:N].to(torch.int32)
    return args, dict(DECODE_FLAGS, state_cache=pool, state_indices=idx)


@pytest.mark.parametrize("pad", [16, 7])
def test_decode_paged_vs_dense_padded_pool(pad):
    """fused_recurrent_kda (bf16 inputs, fp32 pool of V-first planes, K = V = 128) through a pool whose
    stride(0) is one plane + `pad` elements, against the dense call from the gathered planes. pad = 16 (a
    multiple of 16 elements, like every contiguous pool): paged == dense bit for bit. pad = 7: Triton cannot
    prove the planes 16-byte aligned, loads the state tile with another layout and sums over K in another
    order, so the two agree to rounding only: relative L2 difference <= 2 x unit roundoff of the stored dtype
    + 1e-6 (`reorder_bound`, derived in kda/accuracy/layouts.py). The other slots keep their bits either way."""
    N, H, K, V, slots = 8, 2, 128, 128, 32
    gen = torch.Generator(device="cuda").manual_seed(6)
    dev, dt = "cuda", torch.bfloat16
    q, k, v, g, beta = _decode_tokens(N, H, K, V, 6, dt)
    numel = H * V * K
    pool = torch.randn(slots, numel + pad, device=dev, generator=gen)[:, :numel].view(slots, H, V, K)
    assert pool.stride(0) == numel + pad
    idx = torch.randperm(slots, device=dev, generator=gen)[:N]
    others = torch.tensor([i for i in range(slots) if i not in idx.tolist()], device=dev)
    h = pool[idx].clone()  # the gathered planes, a contiguous dense initial state
    before = pool.clone()
    kw = DECODE_FLAGS
    o_d, s_d = kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=h, output_final_state=True, **kw)
    o_p, _ = kda.fused_recurrent_kda(q, k, v, g, beta, state_cache=pool, state_indices=idx.to(torch.int32), **kw)
    s_p = pool[idx]
    assert o_p.dtype == o_d.dtype == dt and s_p.dtype == s_d.dtype == torch.float32
    assert torch.equal(bits(pool[others]), bits(before[others]))
    if pad % 16 == 0:
        assert torch.equal(bits(o_p), bits(o_d))
        assert torch.equal(bits(s_p), bits(s_d))
    else:
        e_o, e_s = rel_err(o_p, o_d), rel_err(s_p, s_d)
        print(f"\n[paged stride plane + {pad}] paged vs dense: output {e_o:.3e} (bound "
              f"{reorder_bound(dt):.3e}), state {e_s:.3e} (bound {reorder_bound(torch.float32):.3e})")
        assert e_o <= reorder_bound(dt)
        assert e_s <= reorder_bound(torch.float32)


def test_no_call_syncs_the_host():
    """The hot path never reads device memory back: sync debug mode "error" raises on any sync."""
    args, h0, kw = _inputs(200, H=2, seed=4)
    cu = torch.tensor([0, 0, 77, 200], dtype=torch.int32, device="cuda")
    pool = torch.randn(5, 2, 128, 128, device="cuda")
    has = torch.tensor([True, False, True], device="cuda")
    idx = torch.tensor([3, 1, 4], dtype=torch.int32, device="cuda")
    dargs, dkw = _decode_call()
    kda.chunk_kda(*args, cu_seqlens=cu, state_cache=pool, state_indices=idx, has_initial_state=has,
                  state_v_first=False, **kw)
    kda.fused_recurrent_kda(*dargs, **dkw)  # compile first: the first launch may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kda.chunk_kda(*args, cu_seqlens=cu, state_cache=pool, state_indices=idx, has_initial_state=has,
                      state_v_first=False, **kw)
        kda.fused_recurrent_kda(*dargs, **dkw)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_decode_replays_in_a_cuda_graph_bitwise():
    """A captured decode step replays to the same bits as the eager call on the same pool."""
    args, kw = _decode_call(seed=5)
    pool = kw["state_cache"]
    start = pool.clone()
    out = torch.empty(args[2].shape, dtype=args[2].dtype, device="cuda")
    kda.fused_recurrent_kda(*args, out=out, **kw)  # warm up (compile); the pool is reset below
    pool.copy_(start)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kda.fused_recurrent_kda(*args, out=out, **kw)
    torch.cuda.current_stream().wait_stream(s)
    eager_out, eager_pool = out.clone(), pool.clone()
    pool.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kda.fused_recurrent_kda(*args, out=out, **kw)
    pool.copy_(start)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(eager_out))
    assert torch.equal(bits(pool), bits(eager_pool))


@pytest.mark.hopper_plan
def test_walk_beside_prepare_finishes_under_launch_blocking():
    """Under CUDA_LAUNCH_BLOCKING=1 every launch waits for its kernel: a repeated walk-beside call (the replayed
    path) must keep the prepare launched before the walk it feeds (`kda.replay._serialising`), or it never
    returns. Every form of the walk beside the prepare; a subprocess, so that the setting reaches the driver; its
    results equal the one-walk plan's."""
    code = (
        _beside_runs(3) +
        "for args, full, (one_o, one_s) in runs:\n"
        "    for _ in range(3):  # the first call eager, the others replayed\n"
        "        o, s = kda.chunk_kda(*args, **full)\n"
        "        assert torch.equal(bits(o), bits(one_o)) and torch.equal(bits(s), bits(one_s))\n"
        "print('ok')\n"
    )
    _subprocess_ok(code, CUDA_LAUNCH_BLOCKING="1")


@pytest.mark.hopper_plan
@pytest.mark.parametrize("form", ["dense", "varlen", "fp32", "wide", "tail"])
def test_walk_beside_prepare_captured_and_eager_equal_one_walk(form):
    """A one-sequence call with few heads runs its walk beside the prepare (on a side stream, each group of
    chunks awaited: `kda.plan._beside`): eager calls, the replayed graph and a plan of one prepare then one
    walk give the same bits, call after call (an ordering fault would show as a stale tile now and then).
    Varlen with host bounds [0, T] (an engine's lone prefill) runs as the dense form; fp32 inputs have no gate
    pass, so their counters are zeroed by their own launch; a long call with 32 heads (`kda.plan.wide_heads`: the
    walk at V blocks of 64) runs beside it; with 48 heads (too many walk programs to run
    beside all of it) the walk runs beside the prepare's last chunks, the prepare in two launches
    (`ChunkPlan.late_chunks`)."""
    from kda.plan import TUNINGS, chunk_plan

    # a short last group; 48 walk programs at H = 12
    H = {"wide": 32, "tail": 48}.get(form, 12)
    T = (TUNINGS["sm90"].beside_bv64_chunks // H * 64 if form in ("wide", "tail") else 8192) + 320
    args, h0, kw = _inputs(T, H=H)
    if form == "varlen":
        kw.update(cu_seqlens=torch.tensor([0, T], dtype=torch.int32, device="cuda"),
                  cu_seqlens_cpu=torch.tensor([0, T], dtype=torch.int32))
    if form == "fp32":
        args = tuple(x.float() for x in args)
    full = dict(output_final_state=True, initial_state=h0, **kw)
    call = checked_call(kda.chunk_kda, *args, **full)
    plan = chunk_plan(call)
    assert plan.wait_chunks > 0 and plan.walk_BV == (64 if form in ("wide", "tail") else 32)
    assert (plan.late_chunks > 0) == (form == "tail")
    # 128 walk programs (H = 32) would leave a prepare program fewer than half the SMs, and at V blocks of 64
    # a short prepare ends before their walk would pay for its slower programs: not beside it
    wide, wide_h0, wide_kw = _inputs(128, H=32)
    assert chunk_plan(checked_call(kda.chunk_kda, *wide, initial_state=wide_h0, **wide_kw)).wait_chunks == 0
    one_o, one_s = run_chunk(call, wait_chunks=0, wait_in_loop=False, late_chunks=0)
    out = torch.empty_like(one_o)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kda.chunk_kda(*args, out=out, **full)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, graph_s = kda.chunk_kda(*args, out=out, **full)
    for _ in range(5):
        eager_o, eager_s = kda.chunk_kda(*args, **full)
        # copies queued right behind the call on its stream, no sync between: they must see the finished walk
        # (a replayed call ends with the prepare, launched as the walk's programmatic dependent: `kda.replay`)
        next_o, next_s = eager_o.clone(), eager_s.clone()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(eager_o), bits(one_o)) and torch.equal(bits(eager_s), bits(one_s))
        assert torch.equal(bits(next_o), bits(one_o)) and torch.equal(bits(next_s), bits(one_s))
        assert torch.equal(bits(out), bits(one_o)) and torch.equal(bits(graph_s), bits(one_s))


def _beside_runs(n: int, long: bool = False) -> str:
    """Code that builds `runs`: (args, keywords, the one-walk plan's (o, s)) of the first n forms of the walk beside
    the prepare (few heads; 32 heads at V blocks of 64; 48 heads beside the prepare's tail); `long`: then 1x16384
    H=12 (256 chunks, 3072 prepare programs: where the replay hang of b6c1600 showed)."""
    return (
        "import torch, kda, test_gpu as t\n"
        "from helpers import checked_call, bits, run_chunk\n"
        "from kda.plan import TUNINGS, chunk_plan\n"
        "forms = [(8192 + 320, 12), (TUNINGS['sm90'].beside_bv64_chunks // 32 * 64 + 320, 32),\n"
        f"         (TUNINGS['sm90'].beside_bv64_chunks // 48 * 64 + 320, 48)][:{n}]"
        f"{' + [(16384, 12)]' if long else ''}\n"
        "runs = []\n"
        "for T, H in forms:\n"
        "    args, h0, kw = t._inputs(T, H=H)\n"
        "    full = dict(output_final_state=True, initial_state=h0, **kw)\n"
        "    call = checked_call(kda.chunk_kda, *args, **full)\n"
        "    assert chunk_plan(call).wait_chunks > 0\n"
        "    runs.append((args, full, run_chunk(call, wait_chunks=0, wait_in_loop=False, late_chunks=0)))\n"
    )


def _subprocess_ok(code: str, timeout: int = 240, **env_extra) -> None:
    """Run `code` in a fresh Python (tests/ and the repository on its path); it must print 'ok' last. A kernel
    that never finishes shows as the timeout, which kills the process; the failure then shows what the code
    printed so far and, from `faulthandler`, where each of its threads was waiting 10 s before the kill."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=f"{tests}{os.pathsep}{tests.parent}", **env_extra)
    code = f"import faulthandler\nfaulthandler.dump_traceback_later({max(timeout - 10, 1)})\n" + code
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=tests.parent, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        text = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
        pytest.fail(f"no finish within {timeout} s; printed:\n{text[0][-3000:]}\nstderr:\n{text[1][-6000:]}")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-3000:]


@pytest.mark.hopper_plan
def test_the_walks_side_stream_is_none_of_torchs_pooled_streams():
    """The walk's side stream is made by the driver, not drawn from torch's pool: torch hands each pooled stream out
    again every 32 requests at a priority, so a caller's `torch.cuda.Stream()` could otherwise be the walk's stream
    and order the caller's work and the walk one behind the other. Every pooled stream at priorities -2, -1 and 0
    is asked for twice over; none is the side stream of the current stream or of a caller's pooled stream."""
    from kda.ops.overlap import side_stream

    main = torch.cuda.current_stream()
    sides = {side_stream(main.device, main).cuda_stream}
    pooled = {torch.cuda.Stream(priority=p).cuda_stream for p in (-2, -1, 0) for _ in range(64)}
    sides |= {side_stream(main.device, torch.cuda.Stream(priority=p)).cuda_stream for p in (-1, 0)}
    assert len(pooled) >= 32 and not sides & pooled and main.cuda_stream not in sides


@pytest.mark.hopper_plan
@pytest.mark.parametrize("num_sms", [32, 16, 8])
def test_walk_beside_prepare_finishes_on_a_partitioned_gpu(num_sms):
    """On a GPU partitioned into a green context of `num_sms` SMs (the plan still sees the whole device's SM count),
    every form of the walk beside the prepare finishes, eager and replayed, with the bits of the one-walk plan. The
    caller's stream and the walk's side stream reach at most `num_sms` SMs there (more outside it), so the walk and
    the prepare did share the partition; so does the side stream of a caller's stream made in the green context
    while the primary context is current (a stream per partition, as SGLang makes them). Each step prints as it
    ends, so a hang names the form and the step; the kernels are compiled before the partition, and a run inside it
    that takes 45 s prints its stacks and exits."""
    code = (
        _beside_runs(3) + "import kda.replay\n"
        "import ctypes\n"
        "from kda.ops import overlap\n"
        "from kda.ops.overlap import _SIDE_STREAMS, side_stream\n"
        "from torch.cuda.green_contexts import GreenContext\n"
        "say = lambda *a: print(*a, flush=True)\n"
        "for args, full, _ in runs:  # compiled outside the partition, so that inside it only a hang takes long\n"
        "    kda.chunk_kda(*args, **full)\n"
        "_SIDE_STREAMS.clear()  # the walk's side stream made again inside the partition\n"
        "outside = t.sms_reached(torch.cuda.current_stream())\n"
        "say('the forms compiled; outside the partition the current stream reaches SMs:', outside)\n"
        f"assert outside > {num_sms}\n"
        "torch.cuda.synchronize()\n"
        f"ctx = GreenContext.create(num_sms={num_sms})\n"
        "ctx.set_context()\n"
        "faulthandler.dump_traceback_later(45, exit=True)  # a hang: the stacks, then exit, 45 s from here\n"
        "say('inside: SMs reached by the current stream', t.sms_reached(torch.cuda.current_stream()))\n"
        "kda.replay.CACHE.clear()\n"
        "for args, full, (one_o, one_s) in runs:\n"
        "    p = chunk_plan(checked_call(kda.chunk_kda, *args, **full))\n"
        "    for step in ('eager', 'replayed'):\n"
        "        o, s = kda.chunk_kda(*args, **full)\n"
        "        torch.cuda.synchronize()\n"
        "        same = torch.equal(bits(o), bits(one_o)) and torch.equal(bits(s), bits(one_s))\n"
        "        say(f'T={args[0].shape[1]} H={args[0].shape[2]} walk_BV={p.walk_BV} wait={p.wait_chunks} '\n"
        "            f'late={p.late_chunks}: {step} finished, bitwise equal to one walk: {same}')\n"
        "        assert same\n"
        "main = torch.cuda.current_stream()\n"
        "reached = [t.sms_reached(main), t.sms_reached(side_stream(main.device, main))]\n"
        "say('inside: SMs reached by the current and the side stream', reached)\n"
        f"assert max(reached) <= {num_sms}, reached\n"
        "green = overlap._green_context(main.cuda_stream)\n"
        "ctx.pop_context()\n"
        "# a caller's stream made in the green context while the primary context is current (SGLang's pattern)\n"
        "handle = ctypes.c_void_p()\n"
        "assert green and overlap._driver()[1](ctypes.byref(handle), green, 1, 0) == 0\n"
        "caller = torch.cuda.ExternalStream(handle.value)\n"
        "reached = [t.sms_reached(caller), t.sms_reached(side_stream(caller.device, caller))]\n"
        "say('a green stream, the primary context current: SMs reached by it and its side stream', reached)\n"
        f"assert max(reached) <= {num_sms}, reached\n"
        "print('ok')\n"
    )
    _subprocess_ok(code, timeout=150)  # a hang costs one case 150 s of device time, not 240


@pytest.mark.hopper_plan
def test_walk_beside_prepare_never_gives_up_on_the_whole_gpu(monkeypatch):
    """On the whole GPU no wait of the walk beside the prepare gives up (`kda.ops.overlap`: the walk's programs
    take at most half the SMs and a prepare program fits beside each, so every group is counted within its
    budget). A give-up would still give the right bits, through the resume launch, but 20 ms late, so the bitwise
    tests cannot see it: here each form's program flags are read before the resume launch, in three calls (each a
    first call: a recorded call replays its launches without this Python)."""
    import inspect

    import kda.replay
    from kda.ops import chunk
    from kda.plan import TUNINGS, cdiv, chunk_plan

    seen = []
    plain = chunk._plain_walk
    signature = inspect.signature(plain)

    def walk(*a, **kw):
        w = signature.bind(*a, **kw).arguments
        if w.get("resume"):  # the flags of the launch before: one a walk program, after the counters
            programs = cdiv(w["call"].V, w["plan"].walk_BV) * w["call"].HV * w["seqs"]
            seen.append(w["ready"][-programs:].clone())
        return plain(*a, **kw)

    monkeypatch.setattr(chunk, "_plain_walk", walk)
    forms = [(8192 + 320, 12), (TUNINGS["sm90"].beside_bv64_chunks // 32 * 64 + 320, 32),
             (TUNINGS["sm90"].beside_bv64_chunks // 48 * 64 + 320, 48)]
    for T, H in forms:
        args, h0, kw = _inputs(T, H=H)
        full = dict(output_final_state=True, initial_state=h0, **kw)
        assert chunk_plan(checked_call(kda.chunk_kda, *args, **full)).wait_chunks > 0
        for _ in range(3):
            seen.clear()
            kda.replay.CACHE.clear()
            kda.chunk_kda(*args, **full)
            torch.cuda.synchronize()
            assert seen and all(int(f.count_nonzero()) == 0 for f in seen), (T, H, [int(f.count_nonzero())
                                                                                    for f in seen])


@pytest.mark.hopper_plan
def test_walk_beside_prepare_replayed_on_another_stream_finishes():
    """A call recorded on the default stream and replayed on another one (a CUDA graph's warm-up on a side stream,
    an engine's per-layer streams) finishes with the recorded call's bits, for every form of the walk beside the
    prepare and at 1x16384 H=12 (256 chunks, 3072 prepare programs: the case that did not finish on the H200 at
    b6c1600, `2026-12-05-b6c1600-h200-partitioned-carveout-verify-hang.md`: a deadlock among one walk program's
    warps, fixed at 8b5f407). A subprocess: a hang prints its
    stacks and fails the case instead of stopping the suite."""
    code = (
        _beside_runs(3, long=True) + "say = lambda *a: print(*a, flush=True)\n"
        "faulthandler.dump_traceback_later(60, exit=True)\n"
        "for args, full, (one_o, one_s) in runs:\n"
        "    kda.chunk_kda(*args, **full)  # recorded on the default stream\n"
        "    torch.cuda.synchronize()\n"
        "    side = torch.cuda.Stream()\n"
        "    side.wait_stream(torch.cuda.current_stream())\n"
        "    with torch.cuda.stream(side):\n"
        "        o, s = kda.chunk_kda(*args, **full)  # replayed on another stream\n"
        "    torch.cuda.synchronize()\n"
        "    same = torch.equal(bits(o), bits(one_o)) and torch.equal(bits(s), bits(one_s))\n"
        "    say(f'T={args[0].shape[1]} H={args[0].shape[2]}: replayed on another stream: same bits {same}')\n"
        "    assert same\n"
        "print('ok')\n"
    )
    _subprocess_ok(code, timeout=150)


@pytest.mark.hopper_plan
def test_walk_beside_prepare_replays_back_to_back_finish():
    """Replays queued back to back, the host's pace varied (none, then a short sleep between calls), for every form
    of the walk beside the prepare and at 1x16384 H=12: all finish with the one walk's bits. While each warp
    of a walk program read its own copy of the counters `overlap.counted_after` looks at, some such replays left a
    program's warps in loops of different lengths, waiting for each other forever
    (`2026-12-05-c90e592-h100-walk-deadlock-fix-cost-ab.md`); `tests/test_platforms.py` checks the compiled layout
    on the CPU, this runs it."""
    code = (
        _beside_runs(3, long=True) + "import time\n"
        "for args, full, (one_o, one_s) in runs:\n"
        "    kda.chunk_kda(*args, **full)  # recorded\n"
        "    torch.cuda.synchronize()\n"
        "    for pause in (0.0, 2e-4):\n"
        "        outs = []\n"
        "        for _ in range(20):\n"
        "            outs.append(kda.chunk_kda(*args, **full))\n"
        "            time.sleep(pause)\n"
        "        torch.cuda.synchronize()\n"
        "        assert all(torch.equal(bits(o), bits(one_o)) and torch.equal(bits(s), bits(one_s)) for o, s in outs)\n"
        "    print(f'T={args[0].shape[1]} H={args[0].shape[2]}: 40 replays finished, same bits', flush=True)\n"
        "print('ok')\n"
    )
    _subprocess_ok(code, timeout=200)


@pytest.mark.hopper_plan
def test_walks_beside_prepares_on_two_streams_at_once():
    """Two calls whose walks run beside their prepares, issued on two streams with no sync between them (their
    prepares and walks in flight together), both finish with the bits of the one-walk plan, eager and replayed."""
    code = (
        _beside_runs(2) +
        "streams = [torch.cuda.Stream() for _ in runs]\n"
        "for s in streams:\n"
        "    s.wait_stream(torch.cuda.current_stream())\n"
        "for _ in range(3):\n"
        "    outs = []\n"
        "    for s, (args, full, _) in zip(streams, runs):\n"
        "        with torch.cuda.stream(s):\n"
        "            outs.append(kda.chunk_kda(*args, **full))\n"
        "    torch.cuda.synchronize()\n"
        "    for (o, st), (_, _, (one_o, one_s)) in zip(outs, runs):\n"
        "        assert torch.equal(bits(o), bits(one_o)) and torch.equal(bits(st), bits(one_s))\n"
        "print('ok')\n"
    )
    _subprocess_ok(code)


@pytest.mark.hopper_plan
@pytest.mark.parametrize("form", ["wide", "tail"])
def test_walk_applying_the_inverse_bf16_accuracy(form):
    """The forms whose walk applies the inverse by default (`ChunkPlan.fold` off: the BV-64 walk beside the
    prepare, the walk beside the prepare's tail) within the bf16-input bounds of the accuracy checks above,
    against the float64 oracle."""
    from kda.plan import TUNINGS, chunk_plan

    H = {"wide": 32, "tail": 48}[form]
    T = TUNINGS["sm90"].beside_bv64_chunks // H * 64 + 320  # long enough a prepare for the walk beside it or its tail
    args, h0, kw = _inputs(T, H=H)
    plan = chunk_plan(checked_call(kda.chunk_kda, *args, initial_state=h0, output_final_state=True, **kw))
    assert not plan.fold and plan.wait_chunks > 0 and (plan.late_chunks > 0) == (form == "tail")
    o, s = kda.chunk_kda(*args, initial_state=h0, output_final_state=True, **kw)
    ro, rs = ref.chunk_kda(*args, initial_state=h0.double(), output_final_state=True, allow_float64=True, **kw)
    e_o, e_s = rel_err(o, ro), rel_err(s, rs)
    print(f"\n[fold off] {form}: output rel L2 {e_o:.3e} (bf16 floor {rounding_floor(ro, torch.bfloat16):.3e}), "
          f"final state {e_s:.3e}")
    assert e_o <= 2.5e-3 and e_s <= 1.5e-3


def test_prefill_graph_replays_with_new_bounds_bitwise():
    """One captured varlen paged `chunk_kda` call, replayed after writing three different `cu_seqlens` of the
    same total into its bounds tensor (empty sequences, a padding slot), gives the eager call's bits for
    each: chunks map to sequences on the device, so a graph needs no recapture when the bounds move."""
    T, H, K, V = 448, 2, 128, 128
    q, k, v, g, beta, kw = make_inputs(1, T, H, H, K, V, dtype=torch.bfloat16, gate="lower_bound", device="cuda",
                                       seed=8, normalize_k=False, beta_sigmoid=True)
    kw["use_qk_l2norm_in_kernel"] = True
    layouts = [[0, 100, 100, 300, 448], [0, 0, 64, 380, 448], [0, 448, 448, 448, 448]]
    idx = torch.tensor([3, -1, 0, 5], dtype=torch.int32, device="cuda")  # sequence 1 is padding
    has = torch.tensor([True, True, False, True], device="cuda")
    start = 0.1 * torch.randn(8, H, V, K, device="cuda")
    pool = start.clone()
    cu = torch.tensor(layouts[0], dtype=torch.int32, device="cuda")
    out = torch.empty(v.shape, dtype=v.dtype, device="cuda")

    def call():
        kda.chunk_kda(q, k, v, g, beta, state_cache=pool, state_indices=idx, has_initial_state=has,
                      cu_seqlens=cu, state_v_first=True, out=out, **kw)

    eager = []
    for bounds in layouts:
        cu.copy_(torch.tensor(bounds, dtype=torch.int32))
        pool.copy_(start)
        call()
        torch.cuda.synchronize()
        eager.append((out.clone(), pool.clone()))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()  # warm-up on a side stream before capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for bounds, (eager_out, eager_pool) in zip(layouts, eager):
        cu.copy_(torch.tensor(bounds, dtype=torch.int32))
        pool.copy_(start)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(out), bits(eager_out)), bounds
        assert torch.equal(bits(pool), bits(eager_pool)), bounds


@pytest.mark.parametrize("H", [4, 32])
def test_routed_loop_beside_the_walk_replays_bitwise(H):
    """A varlen paged call whose one-token sequences take the recurrent loop (`Route.short`) launches the loop
    after the walk; a recorded call replays it as the walk's programmatic dependent (`kda.ops.chunk`), in the SMs
    the walk leaves. Replayed calls, with copies queued right behind them and no sync between, and a captured
    graph give the first (unrecorded, serial) call's bits, output and pool, call after call: the loop's last
    program holds the kernel open until the walk has finished (an ordering fault would show as a stale row)."""
    from kda.plan import device_info

    lens = [1] * 6 + [1100, 1, 1300, 1, 900]
    T, K, V = sum(lens), 128, 128
    q, k, v, g, beta, kw = make_inputs(1, T, H, H, K, V, dtype=torch.bfloat16, gate="lower_bound", device="cuda",
                                       seed=5, normalize_k=False, beta_sigmoid=True)
    kw["use_qk_l2norm_in_kernel"] = True
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    idx = torch.randperm(2 * len(lens), device="cuda")[:len(lens)].to(torch.int32)
    has = torch.arange(len(lens), device="cuda") % 3 != 1  # some sequences start from zeros
    start = 0.1 * torch.randn(2 * len(lens), H, V, K, device="cuda")
    pool = start.clone()
    out = torch.empty(v.shape, dtype=v.dtype, device="cuda")

    def call():
        kda.chunk_kda(q, k, v, g, beta, state_cache=pool, state_indices=idx, has_initial_state=has, cu_seqlens=cu,
                      state_v_first=True, out=out, **kw)

    kda.replay.CACHE.clear()
    call()
    torch.cuda.synchronize()
    first_o, first_pool = out.clone(), pool.clone()
    (entry,) = kda.replay.CACHE.values()
    loop = entry.order[-1][1]  # the last launch: the loop kernel, after the walk
    # its launcher's PDL flag, set where the device has PDL and kernels may run at once (`kda.replay`)
    assert entry.launches[loop][1][1] == int(device_info(0).pdl and not kda.replay._serialising())
    for _ in range(4):
        pool.copy_(start)
        out.fill_(float("nan"))
        call()
        next_o, next_pool = out.clone(), pool.clone()  # queued behind the replay, no sync between
        torch.cuda.synchronize()
        assert torch.equal(bits(next_o), bits(first_o)) and torch.equal(bits(next_pool), bits(first_pool))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(4):
        pool.copy_(start)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(out), bits(first_o)) and torch.equal(bits(pool), bits(first_pool))


def test_two_streams_on_disjoint_slots_equal_a_serial_run_bitwise():
    """Two streams running different layers (their own inputs) on disjoint slots of one pool, a prefill and
    two decode steps each, concurrently, give the same bits as the same calls one after the other on the
    default stream: no kernel reads or writes another layer's slots or shares scratch with it."""
    H, K, V = 4, 128, 128
    bounds = [0, 150, 150, 400]
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    layers = []
    for layer in range(2):
        args, _, kw = _inputs(bounds[-1], H=H, seed=10 + layer)
        steps = [_inputs(1, H=H, seed=20 + 10 * layer + s) for s in range(2)]  # one token per sequence
        slots = torch.tensor([3 * layer, 3 * layer + 1, 3 * layer + 2], dtype=torch.int32, device="cuda")
        layers.append((args, kw, steps, slots))
    pool0 = torch.randn(6, H, K, V, device="cuda")
    has = torch.ones(3, dtype=torch.bool, device="cuda")

    def run(layer, pool):
        args, kw, steps, slots = layers[layer]
        o, _ = kda.chunk_kda(*args, cu_seqlens=cu, state_cache=pool, state_indices=slots, has_initial_state=has,
                             state_v_first=False, **kw)
        outs = [o]
        for step_args, _, step_kw in steps:
            x = [t.expand(3, *t.shape[1:]).contiguous() for t in step_args]  # the token for each sequence
            o_s, _ = kda.fused_recurrent_kda(*x, state_cache=pool, state_indices=slots, state_v_first=False,
                                             **step_kw)
            outs.append(o_s)
        return outs

    serial_pool = pool0.clone()
    serial = [run(0, serial_pool), run(1, serial_pool)]
    torch.cuda.synchronize()
    pool = pool0.clone()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    start = torch.cuda.Event()
    start.record()
    results = [None, None]
    for layer, stream in enumerate(streams):
        stream.wait_event(start)
        with torch.cuda.stream(stream):
            results[layer] = run(layer, pool)
    torch.cuda.synchronize()
    for layer in range(2):
        for a, b in zip(results[layer], serial[layer]):
            assert torch.equal(bits(a), bits(b))
    assert torch.equal(bits(pool), bits(serial_pool))
