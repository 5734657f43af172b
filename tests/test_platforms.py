"""Plans for GPUs other than the one the suite runs on (docs/platforms.md): built on the CPU from meta tensors for
an A100, an H200, and AMD's MI300X and MI355X, over a grid of calls. No NVIDIA-only feature is chosen where the
target lacks it (TMA, the walk beside the prepare with its PTX spin, PDL, inline PTX on HIP), the dots run at a
precision Triton allows on the target, and every walk's stages fit the target's shared memory."""

from __future__ import annotations

import copy
import itertools
import os
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import checked_call
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend

import kda
from kda import plan as P
from kda.ops.launch import NUMERICS

A100 = P.DeviceInfo(108, (8, 0), 166912)
H200 = P.DeviceInfo(132, (9, 0), 232448)
MI300X = P.DeviceInfo(304, (9, 4), 65536, hip=True)
MI355X = P.DeviceInfo(256, (9, 5), 163840, hip=True)
TARGETS = {"sm_80": (A100, GPUTarget("cuda", 80, 32)), "sm_90": (H200, GPUTarget("cuda", 90, 32)),
           "gfx942": (MI300X, GPUTarget("hip", "gfx942", 64)), "gfx950": (MI355X, GPUTarget("hip", "gfx950", 64))}


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _calls(fn):
    """`fn`'s validated calls (meta tensors) over dense and varlen batches (with host bounds or not), one sequence
    or many, short or long, few heads or many, K = V = 128 or 64, bf16 or fp32 inputs, Kimi's gate or a raw one,
    V-first or K-first pools of fp32 or bf16."""
    decode = fn is kda.fused_recurrent_kda
    shapes = ([(None, 1, n) for n in (1, 64, 512)] + [([1] * 8, None, None), ([1, 3, 2], None, None)] if decode
              else [(None, 1, 4096), (None, 4, 1000), (None, 1, 32768), ([3000], None, None),
                    ([1024] * 8 + [8] * 8, None, None), ([5, 70000], None, None)])
    for (lengths, B, T), H, KV, dtype, gate, v_first, pool, host in itertools.product(
            shapes, (4, 32, 96), (128, 64), (torch.bfloat16, torch.float32), ("kimi", "raw"), (True, False),
            (torch.float32, torch.bfloat16), (True, False)):
        if lengths is None and not host:
            continue
        N = B if lengths is None else len(lengths)
        if lengths is not None:
            B, T = 1, sum(lengths)
        if decode:  # dense decode: [N, 1]
            B, T = N, 1
        shape_qk, shape_v = (B, T, H, KV), (B, T, H, KV)
        kw = dict(state_cache=_meta(N + 1, H, KV, KV, dtype=pool), state_indices=_meta(N, dtype=torch.int32),
                  has_initial_state=_meta(N, dtype=torch.bool),
                  state_v_first=v_first, output_final_state=False)
        if gate == "kimi":
            g = _meta(*shape_qk, dtype=dtype)
            kw.update(A_log=_meta(H, dtype=torch.float32), dt_bias=_meta(H * KV, dtype=torch.float32),
                      lower_bound=-5.0, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True)
        else:
            g = _meta(*shape_qk, dtype=torch.float32)
        if lengths is not None and not decode:
            bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            kw["cu_seqlens"] = bounds.to("meta")
            if host:
                kw["cu_seqlens_cpu"] = bounds
        yield checked_call(fn, _meta(*shape_qk, dtype=dtype), _meta(*shape_qk, dtype=dtype),
                           _meta(*shape_v, dtype=dtype), g, _meta(B, T, H, dtype=dtype), **kw)


def _walk_smem(plan: P.ChunkPlan, K: int, device: P.DeviceInfo) -> int:
    """Shared memory the walk's stages take, as `kda.plan._chunk_plan` counts it: Kd, Qd, M, N in the workspace
    dtype and V at 4 bytes for each chunk in shared memory (stages - 1 for TMA tiles, as Triton's pipeliner holds
    them; a stage's for pointer walks), beside `kda.plan.walk_reserve`."""
    BK = max(16, P.next_power_of_2(K))
    per_stage = (3 * plan.BT * BK + plan.BT * plan.BT) * plan.ws_dtype.itemsize + plan.BT * plan.walk_BV * 4
    chunks = plan.walk_stages - 1 if plan.walk_tma else plan.walk_stages
    reserve = P.walk_reserve(BK, plan.walk_BV, plan.ws_dtype, plan.dot_prec, plan.walk_tma, P.tuning_of(device))
    return reserve + per_stage * chunks


@pytest.fixture(scope="module")
def prefill_calls():
    return list(_calls(kda.chunk_kda))


@pytest.mark.parametrize("name", list(TARGETS))
def test_prefill_plans_use_only_what_the_target_has(name, prefill_calls):
    """On HIP no TMA, no walk beside the prepare (its spin, proxy fence and griddepcontrol are PTX), no PDL, no
    inline PTX in the routed loop kernel; on sm_80 no TMA and no walk beside the prepare (ptxas refuses the
    griddepcontrol and proxy fence before sm_90). On every target the dots' precision is one Triton allows there
    and the walk's stages fit its shared memory. On the H200 the grid reaches TMA and the walk beside the
    prepare, so what the others lack is not absent from the grid by accident."""
    device, target = TARGETS[name]
    allowed = make_backend(target).parse_options(NUMERICS).allowed_dot_input_precisions
    seen = set()
    for call in prefill_calls:
        plan, route = P.prefill_plan(call, device=device)
        seen.update({"tma"} if plan.walk_tma else set(), {"beside"} if plan.wait_chunks else set(),
                    {"tail"} if plan.late_chunks else set())
        assert plan.dot_prec in allowed, (name, plan.dot_prec)
        assert plan.walk_stages == 1 or _walk_smem(plan, call.K, device) <= device.max_smem, (name, plan)
        if device.hip or device.capability < (9, 0):
            assert not plan.walk_tma and plan.wait_chunks == 0 and plan.late_chunks == 0
            assert not plan.wait_in_loop and not plan.spin and not device.pdl
        if device.hip:
            assert route.loop is None or not route.loop.ptx
    if name == "sm_90":
        assert seen == {"tma", "beside", "tail"}
    else:
        assert not seen


@pytest.mark.parametrize("name", list(TARGETS))
def test_decode_plans_use_no_ptx_on_hip(name):
    """The decode kernels' one inline PTX instruction (the packed bf16 pool's paired conversion,
    `DecodePlan.ptx`) is planned on NVIDIA only; where the plan holds words of a bf16 pool elsewhere, the kernel
    converts each half by itself."""
    device, _ = TARGETS[name]
    packed = 0
    for call in _calls(kda.fused_recurrent_kda):
        plan = P.decode_plan(call, device=device)
        assert not plan.ptx or (plan.packed and call.state_dtype == torch.bfloat16 and not device.hip)
        packed += plan.packed and call.state_dtype == torch.bfloat16
        if plan.packed and call.state_dtype == torch.bfloat16:
            assert plan.ptx == (not device.hip)
    assert packed  # the grid reaches the packed bf16 kernel on every target


H200_PROPERTIES = SimpleNamespace(name="NVIDIA H200", multi_processor_count=132, major=9, minor=0,
                                  shared_memory_per_block_optin=232448)


@pytest.fixture
def on_h200(monkeypatch):
    """GPU 0 reads as an H200 (`torch.cuda.get_device_properties` stubbed) and calls are planned as running there
    (`device_of` past the interpreter); `kda.plan.plan_as` is reset before and after."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: H200_PROPERTIES)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(P, "interpreted", lambda: False)
    P.plan_as()
    yield
    P.plan_as()  # before the stubs go: no H200 description stays cached


def _on_gpu(call):
    """`call` with its q standing for a tensor on GPU 0: what `device_of` and the plans read of it."""
    gpu = copy.copy(call)
    q = call.q
    gpu.q = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=q.dtype, data_ptr=q.data_ptr,
                            stride=q.stride)
    return gpu


def test_plan_as_sm80_gives_the_h200_an_a100s_plan(on_h200, prefill_calls):
    """`plan_as((8, 0), 166912)` (the suite's and the benchmark's `--plan-device sm_80`): the H200 is described as
    sm_80 with the A100's 163 KiB and its own 132 SMs, so every prefill and decode plan `device_of` leads to is the
    plan of that device: no TMA, no walk beside the prepare or its tail, no PTX spin, the walk's stages within
    163 KiB, and replay's PDL decision (`kda.replay`, which reads `device_info` too) off; the recorded calls are
    dropped. `plan_as()` gives back the H200's own plans (TMA and the walk beside the prepare among them)."""
    from kda import replay

    own = P.device_info(0)
    assert (own.sm_count, own.capability, own.max_smem) == (132, (9, 0), 232448) and own.pdl
    as_a100 = P.DeviceInfo(132, (8, 0), 166912)
    decode_calls = list(_calls(kda.fused_recurrent_kda))
    replay.CACHE["recorded under the H200's plan"] = None
    P.plan_as(*P.PLAN_DEVICES["sm_80"])
    assert not replay.CACHE
    forced = P.device_info(0)
    assert (forced.sm_count, forced.capability, forced.max_smem, forced.hip) == (132, (8, 0), 166912, False)
    assert not (forced.tma or forced.spin or forced.pdl) and forced.tf32 and forced.ptx
    assert replay.device_info is P.device_info and not replay.device_info(0).pdl
    for call in prefill_calls:
        plan, route = P.prefill_plan(_on_gpu(call))
        assert (plan, route) == P.prefill_plan(call, device=as_a100)
        assert not (plan.walk_tma or plan.wait_chunks or plan.late_chunks or plan.wait_in_loop or plan.spin)
        assert plan.walk_stages == 1 or _walk_smem(plan, call.K, forced) <= 166912
    for call in decode_calls:
        assert P.decode_plan(_on_gpu(call)) == P.decode_plan(call, device=as_a100)
    P.plan_as()
    assert P.device_info(0).capability == (9, 0)
    seen = set()
    for call in prefill_calls:
        plan, route = P.prefill_plan(_on_gpu(call))
        assert (plan, route) == P.prefill_plan(call, device=P.DeviceInfo(132, (9, 0), 232448))
        seen.update({"tma"} if plan.walk_tma else set(), {"beside"} if plan.wait_chunks else set())
    assert seen == {"tma", "beside"}


def test_the_sm80_plan_device_is_the_a100s():
    """`--plan-device sm_80` (the suite's and the benchmark's, one table in `kda.plan`) is the A100's capability
    and opt-in shared memory (163 KiB)."""
    assert P.PLAN_DEVICES["sm_80"] == (A100.capability, A100.max_smem) == ((8, 0), 163 * 1024)


def test_overrides_may_not_ask_for_what_the_device_lacks(prefill_calls):
    """A plan override (tests, benchmarks/kernel_profile.py) that asks an A100 or an MI300X for TMA, the PTX spin or
    a wait inside the walk's loop, or a HIP GPU (or the interpreter) for the decode's PTX or a register cap, is
    refused: forced on a planned-down H200 it would run what the device it stands for cannot (and the in-loop
    wait without the spin reads a counter once: the walk would read chunks not yet stored). The interpreter takes
    the waits (it runs the prepare first)."""
    call = next(c for c in prefill_calls if c.B == 1 and c.T == 4096)
    for device in (A100, MI300X):
        for over in (dict(walk_tma=True), dict(spin=True), dict(wait_chunks=2, wait_in_loop=True)):
            with pytest.raises(ValueError, match="lacks|has no"):
                P.prefill_plan(call, device=device, **over)
        assert P.prefill_plan(call, device=device, wait_chunks=2)[0].wait_chunks == 2  # the outer loop's wait
    assert P.prefill_plan(call, device=P.INTERPRETER, wait_chunks=2, wait_in_loop=True)[0].wait_in_loop
    assert P.prefill_plan(call, device=H200, wait_chunks=2, wait_in_loop=True)[0].spin
    decode = next(c for c in _calls(kda.fused_recurrent_kda) if c.state_dtype == torch.bfloat16)
    with pytest.raises(ValueError, match="no inline PTX"):
        P.decode_plan(decode, device=MI300X, ptx=True)
    assert P.decode_plan(decode, device=A100, ptx=True).ptx
    for device in (MI300X, P.INTERPRETER):  # a register cap is an NVIDIA launch option
        with pytest.raises(ValueError, match="register cap"):
            P.decode_plan(decode, device=device, maxnreg=128)
    assert P.decode_plan(decode, device=A100, maxnreg=96).maxnreg == 96


def test_the_gluon_prepare_only_where_the_plan_measured_and_tested_it(prefill_calls):
    """An H200 under Triton 3.6 (the release the Gluon prepare was tested with) gets it exactly for the calls with
    K = V = 128 (not V = 64) at every head count, with Kimi's bounded gate on bf16 inputs (no gate pass: it forms b2
    itself; fp16 workspaces) and aligned rows; a misaligned head stride, another Triton release, another
    capability, HIP and the interpreter get the twin, and an override asking them for it is refused. The choice
    reads no batch: the same heads and dtypes give the same prepare at every batch shape."""
    h200_36 = P.DeviceInfo(132, (9, 0), 232448, triton=(3, 6))
    others = (P.DeviceInfo(132, (9, 0), 232448, triton=(3, 9)), P.DeviceInfo(148, (10, 0), 232448, triton=(3, 6)),
              P.DeviceInfo(304, (9, 0), 65536, hip=True, triton=(3, 6)), A100, MI300X, P.INTERPRETER)
    picked = set()
    for call in prefill_calls:
        plan = P.chunk_plan(call, device=h200_36)
        kimi = call.use_gate_in_kernel and call.q.dtype == torch.bfloat16
        tested_shape = call.K == call.V == 128 and call.H == call.HV
        assert (plan.prepare == "hopper") == (kimi and tested_shape), (call.HV, call.V)
        if plan.prepare == "hopper":
            picked.add((call.N, call.T))
            assert not plan.gate_pass and plan.ws_dtype == torch.float16 and plan.prepare_BK == 32
        for device in others:
            assert P.chunk_plan(call, device=device).prepare != "hopper"
    assert len(picked) > 3  # dense and varlen, one sequence and many
    wide = next(c for c in prefill_calls if c.HV == 96 and c.V == 128 and c.use_gate_in_kernel
                and c.q.dtype == torch.bfloat16 and c.B == 1 and c.T == 4096)
    m = torch.empty(1, 4096, 96, 136, dtype=torch.bfloat16, device="meta")[..., :128]  # head stride 136
    misaligned = replace(wide, q=m)
    assert P.chunk_plan(misaligned, device=h200_36).prepare == "fused"
    for device in others:
        with pytest.raises(ValueError, match="Gluon prepare"):
            P.prefill_plan(wide, device=device, prepare="hopper")
    with pytest.raises(ValueError, match="forms b2 itself"):  # a gate pass it would never read
        P.prefill_plan(wide, device=h200_36, prepare="hopper", gate_pass=True)
    # shapes its GPU tests do not cover take the twin: 48 q/k heads for 96 value heads, K = V = 256
    for H, HV, KV in ((48, 96, 128), (96, 96, 256)):
        gva = checked_call(kda.chunk_kda, _meta(1, 4096, H, KV), _meta(1, 4096, H, KV), _meta(1, 4096, HV, KV),
                           _meta(1, 4096, HV, KV), _meta(1, 4096, HV), A_log=_meta(HV, dtype=torch.float32),
                           dt_bias=_meta(HV * KV, dtype=torch.float32), lower_bound=-5.0, use_gate_in_kernel=True,
                           use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        assert P.chunk_plan(gva, device=h200_36).prepare == "fused", (H, HV, KV)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU's property")
def test_import_and_a_call_without_a_gpu_never_load_gluon():
    """`import kda` and a `chunk_kda` call planned for this machine (the interpreter) never import
    `kda.ops.hopper_prepare`, the Gluon kernel: it is imported at the first launch a plan picks it for."""
    import subprocess
    import sys

    code = ("import sys, torch, kda\n"
            "from helpers import make_inputs\n"
            "q, k, v, g, beta, kw = make_inputs(1, 70, 2, 2, 32, 32, gate='lower_bound', beta_sigmoid=True)\n"
            "kda.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **kw)\n"
            "assert 'kda.ops.hopper_prepare' not in sys.modules\n"
            "print('ok')\n")
    root = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root.parent, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root.parent}"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-3000:]


def _benchmark_tool(script: str, *args: str, timeout: int = 900):
    """`benchmarks/<script> args` in a process of its own, outside the interpreter (compiles for real targets)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, str(root / "benchmarks" / script), *args], cwd=root,
                          env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True,
                          timeout=timeout)


def test_offline_compile_plan_overrides_reach_the_compile():
    """`offline_compile.py --plan` replaces plan fields before the call is launched: the K-first one-token decode
    compiles at the tile asked (BV 32, not held) instead of the plan's (BV 64, held), and a field no plan has is
    refused by name before anything compiles."""
    run = ["--targets", "sm_90", "--cases", "decode-kfirst-256-h32", "--pools", "fp32"]
    lines = {}
    for plan in ("", "BV=32,packed=false"):
        done = _benchmark_tool("offline_compile.py", *run, "--plan", plan, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        lines[plan] = [x for x in done.stdout.splitlines() if x.startswith("sm_90 ")]
    assert len(lines[""]) == 1 and "BV=64" in lines[""][0] and "PACKED=True" in lines[""][0], lines
    assert len(lines["BV=32,packed=false"]) == 1, lines
    assert "BV=32" in lines["BV=32,packed=false"][0] and "PACKED" not in lines["BV=32,packed=false"][0], lines
    bad = _benchmark_tool("offline_compile.py", *run, "--plan", "BW=32", timeout=600)
    assert bad.returncode != 0 and "--plan: 'BW=32'" in bad.stderr and "sm_90 " not in bad.stdout


def test_no_wgmma_of_the_hopper_prefill_is_serialized():
    """Compiled offline for sm_90 under this Triton, no kernel of the wide-head prefill (the prepare beside the
    walk), the few-head one or a varlen batch has its tensor-core products awaited one by one: ptxas does that to
    a whole kernel (its C7512) when a register budget leaves too few registers for the wgmma pipeline, a silent
    loss of the overlap the prepare's and the walk's products depend on (the Gluon prepare's under Triton 3.6:
    `offline_compile.py` there, docs/platforms.md)."""
    done = _benchmark_tool("offline_compile.py", "--targets", "sm_90", "--cases",
                           "prefill-1x16384-h32,prefill-1x8192-h8,prefill-varlen-64-h32", "--pools", "fp32")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("sm_90 ")]
    assert sum("_chunk_prepare" in r for r in rows) == 3 and sum("_chunk_state_kernel" in r for r in rows) == 3, rows
    assert all("error" not in r.lower() and "serialized" not in r for r in rows), rows


def test_stochastic_rounding_tiles_compile_for_hopper_within_a_few_spilled_words():
    """Compiled offline for sm_90 under this Triton, the one-token decode kernel as planned under stochastic rounding
    (K-first words at 16384 elements a program under the 168-register cap, V-first NSUB 4 blocks of 8 rows) spills
    at most 64 bytes a thread on either 2-byte pool: the bf16 words at a 128-register cap spilled 212 bytes and ran
    15% slower than nearest (the 55da398 H100 file), the fp16 ones 52 bytes at nearest's speed, so rounding that
    holds more registers than the tile leaves shows here, before a GPU times it."""
    done = _benchmark_tool("offline_compile.py", "--targets", "sm_90", "--cases",
                           "decode-sr-kfirst-256-h32,decode-sr-vfirst-256-h32", "--pools", "bf16,fp16")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("sm_90 ")]
    assert len(rows) == 4 and all("SR=" in r for r in rows), rows
    assert sum("BV=128" in r and "PACKED=True" in r and "warps=4" in r for r in rows) == 2, rows
    # launchable (the cell's word "ok", or "spills" within the bound), not "**over**" or "fails"
    assert all(int(r.split(": ")[-1].split(" / ")[1]) <= 64 and (" ok (" in r or " spills (" in r) for r in rows), rows


def test_exact_dot_walks_fit_hopper_shared_memory():
    """fp32 inputs take exact dots, which stage fp32 operands of a chunk's rows in shared memory beside the walk's
    TMA stages (`kda.plan.walk_reserve`): compiled offline for sm_90 at K = V = 64 (where a flat reserve planned 4
    stages and 246-262 KB of the 227 KB an SM has), every kernel of the call fits."""
    done = _benchmark_tool("offline_compile.py", "--targets", "sm_90", "--cases", "prefill-fp32-k64-1x4096-h4",
                           "--pools", "fp32")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("sm_90 ")]
    assert any("_chunk_state_kernel" in r and "TMA=True" in r for r in rows), rows
    assert all("error" not in r.lower() and "**over**" not in r for r in rows), rows


def test_the_prepare_has_the_same_float_ops_dense_and_varlen():
    """`benchmarks/arith_forms.py` under this Triton for sm_90, 32 heads: the prepare of a dense call (beside the
    walk) and of a varlen batch compile to the same float operations, none fused in one form only (a sequence's
    bits would then follow the batch, as the Gluon prepare's did with its gate's product left to the compiler)."""
    done = _benchmark_tool("arith_forms.py", "--heads", "32")
    rows = [line for line in done.stdout.splitlines() if line.startswith("sm_90 H=32 ")]
    assert done.returncode == 0 and rows and all("the same kinds and counts" in r for r in rows), \
        done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.parametrize("case", ["prefill-1x8192-h8", "prefill-1x16384-h32"])
def test_the_walk_beside_the_prepare_compiles_for_hopper(case, tmp_path):
    """The walk beside the prepare waits in PTX that the interpreter never runs (`kda.ops.overlap.spin_zero`: an
    acquire load in a loop bounded by `%globaltimer`, a proxy fence, two results): compiled offline for sm_90 by
    `benchmarks/offline_compile.py` (a process outside the interpreter), at the few-head form (groups in an outer
    loop) and the 32-head one (the wait inside the pipelined TMA loop), ptxas takes it, the kernel fits an SM's
    registers and shared memory, and the bounded spin (setting the program's flag where it gives up) is in its PTX;
    the outer loop's look at the groups counted
    already (`counted_after`) reads them by acquire loads, then a barrier, each by one thread."""
    done = _benchmark_tool("offline_compile.py", "--targets", "sm_90", "--cases", case, "--pools", "fp32", "--out",
                           str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    walks = [line for line in done.stdout.splitlines()
             if line.startswith("sm_90 ") and "_chunk_state_kernel" in line and "SPIN=True" in line]
    assert walks and all("error" not in w.lower() and (" ok (" in w or " spills (" in w) for w in walks), walks
    assert ("WAIT_IN_LOOP=True" in walks[0]) == (case == "prefill-1x16384-h32")
    ptx = [p.read_text() for p in tmp_path.glob("*_chunk_state_kernel.ptx")]
    assert ptx and all("%globaltimer" in p and "ld.acquire.gpu.global.b32" in p and "fence.proxy.async.global" in p
                       and "red.relaxed.gpu.global.or.b32" in p for p in ptx)  # a give-up sets the program's flag
    outer = case == "prefill-1x8192-h8"
    # the predicated acquire load, then (past comments, labels and line notes) the barrier
    look = re.compile(r"@p ld\.acquire\.gpu\.global\.b32 [^;]*; \}\n(?:[ \t]*(?://.*|\.loc.*|\$L__\w+:)?\n)*"
                      r"[ \t]*bar\.sync")
    assert all(bool(look.search(p)) == outer for p in ptx)
    # that look gives every thread the one run: a counter a thread, none read again by another warp (a warp reading
    # its own copy at its own moment may see other counts and walk another length: the others wait forever)
    for ir in tmp_path.glob("*_chunk_state_kernel.ttgir") if outer else ():
        text = ir.read_text()
        asm = r'@p ld\.acquire\.gpu\.global\.b32 [^"]*".* -> tensor<(\d+)xi32, #(\w+)>'
        lanes, layout = re.search(asm, text).groups()
        per_thread, per_warp, warps = re.search(
            rf"^#{layout} = #ttg\.blocked<{{sizePerThread = \[(\d+)\], threadsPerWarp = \[(\d+)\], "
            r"warpsPerCTA = \[(\d+)\]", text, re.M).groups()
        assert int(lanes) >= int(per_thread) * int(per_warp) * int(warps), (lanes, per_thread, per_warp, warps)
