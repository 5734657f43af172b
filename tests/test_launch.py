"""Direct launches (`kda.ops.launch`): a launch that skips Triton's binding must run the binary Triton itself
would pick, or a kernel compiled for 16-byte-aligned pointers (or for an argument equal to 1, or for an i32)
would run on arguments it was not compiled for.

On CPU: the key's classes are Triton's (its native specialisation, run here on every pair of values). On
the GPU: calls through the direct path equal Triton's own launches bit for bit, across alignments and
values that change the specialisation."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
import triton
from conftest import DEVICE
from helpers import make_inputs, same_bits
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

import kda
from kda import replay
from kda.ops import chunk_prepare, chunk_walk, fused_recurrent, launch, overlap
from kda.ops.launch import DirectKernel, specialization

INTS = [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1,
        -2**31 - 16, 2**40, 2**63 - 16, 2**63 - 1, 2**63, 2**64 - 16]


def _tensors():
    base = torch.zeros(64, dtype=torch.float32)
    half = torch.zeros(64, dtype=torch.bfloat16)
    idx = torch.zeros(64, dtype=torch.int32)
    return [base, base[1:], base[4:], half, half[1:], half[8:], idx, idx[2:], idx[4:]]


def _triton(x, fixed: bool):
    return native_specialize_impl(BaseBackend, x, False, not fixed, True)


@pytest.mark.parametrize("fixed", [False, True])
def test_key_classes_are_tritons(fixed):
    """Two arguments share our key exactly when Triton specialises them alike (ints, floats, bools, None and
    tensors of several dtypes and alignments, with and without `do_not_specialize`)."""
    values = INTS + [0.0, 1.0, -2.5, 1e30, True, False, None] + _tensors()
    ours = {i: specialization((x,), (fixed,))[0] for i, x in enumerate(values)}
    theirs = {i: _triton(x, fixed) for i, x in enumerate(values)}
    for i, j in itertools.combinations(range(len(values)), 2):
        assert (ours[i] == ours[j]) == (theirs[i] == theirs[j]), (values[i], values[j], theirs[i], theirs[j])


def test_launcher_arguments_are_the_values_and_addresses():
    t = _tensors()[1]
    key, vals = specialization((t, 17, 2.5, None, True), (False,) * 5)
    assert vals == [t.data_ptr(), 17, 2.5, None, True]
    with pytest.raises(launch._Slow):  # an argument of another type (a TMA descriptor) takes Triton's path
        specialization((object(),), (False,))


class CudaLauncher:
    """Triton 3.6's launcher, as `kda.ops.launch.launcher_entry` reads it: `__call__` allocates scratch (none
    here) and passes the kernel's cooperative-grid and PDL flags to `launch` ahead of the scratch buffers."""

    def __init__(self, scratch: int = 0):
        self.calls = []
        self.launch = lambda *a: self.calls.append(a)
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = "coop"
        self.launch_pdl = "pdl"

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        scratch = "scratch" if self.global_scratch_size else None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    scratch, None, *args)


def test_launcher_entry_launches_as_the_launcher():
    args = (7, 2, 3, "stream", "function")
    rest = ("packed", None, None, None, 11, 12.5, None)
    run = CudaLauncher()
    run(*args, *rest)
    entry, prefix = launch.launcher_entry(run)
    assert entry is run.launch and prefix
    entry(*args, *prefix, *rest)
    assert run.calls[0] == run.calls[1]
    # a kernel with scratch memory, or another launcher, is called as it is
    for other in (CudaLauncher(scratch=64), print):
        assert launch.launcher_entry(other) == (other, ())


def test_every_launched_kernel_takes_the_direct_path():
    """The kernels `kda` launches are wrapped, and their run-time arguments come first in the signature (checked
    from the Python signature, so also under the interpreter: a run-time argument after a constexpr leaves a kernel
    on Triton's own launch path, tens of microseconds a launch, and its calls unrecordable by `kda.replay`)."""
    kernels = [chunk_prepare._chunk_gate_kernel, chunk_prepare._chunk_prepare_kernel,
               chunk_prepare._chunk_intra_kernel, chunk_prepare._chunk_solve_kernel, chunk_walk._chunk_state_kernel,
               overlap._zero_counters_kernel, fused_recurrent._fused_recurrent_kda_kernel,
               fused_recurrent._fused_recurrent_one_token_kernel]
    for kern in kernels:
        assert isinstance(kern, DirectKernel)
    for kern in _all_kernels():  # every wrapped kernel, not only those named above
        params = inspect.signature(kern.fn.fn).parameters.values()  # the Python function under the JIT wrapper
        constexpr = ["constexpr" in str(p.annotation) for p in params]
        assert constexpr == sorted(constexpr), kern.fn.fn.__name__
        if DEVICE == "cuda":
            assert kern._plain is not None, kern.fn


def _all_kernels():
    return [getattr(mod, name) for mod in (chunk_prepare, chunk_walk, overlap, fused_recurrent) for name in dir(mod)
            if isinstance(getattr(mod, name), DirectKernel)]


def _through_triton(monkeypatch):
    """Every launch through Triton's own path: no direct launch, and no recorded call replayed."""
    for kern in _all_kernels():
        monkeypatch.setattr(kern, "_plain", None)
    monkeypatch.setattr(replay, "CACHE", {})
    monkeypatch.setattr(replay, "CAPACITY", 0)


def _decode(inputs, pool, idx, out, **kw):
    q, k, v, g, beta = inputs
    return kda.fused_recurrent_kda(q, k, v, g, beta, state_cache=pool, state_indices=idx, state_v_first=True,
                                   out=out, use_qk_l2norm_in_kernel=True, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1, 8])
def test_direct_decode_equals_tritons_launch(monkeypatch, offset):
    """The same decode through the direct path (twice: the second a cache hit) and through Triton, with q,
    k, v and the output starting `offset` elements into their buffers (offset 1: 2-byte aligned, a
    different binary; 8: 16-byte aligned, the aligned binary again)."""
    N, H, K = 8, 2, 64

    def views(t):
        flat = torch.zeros(t.numel() + offset, dtype=t.dtype, device=DEVICE)
        flat[offset:] = t.reshape(-1)
        return flat[offset:].view(t.shape)

    q, k, v, g, beta, kw = make_inputs(N, 1, H, H, K, K, dtype=torch.bfloat16, gate="lower_bound", device=DEVICE,
                                       seed=offset, beta_sigmoid=True)
    inputs = (views(q), views(k), views(v), g, beta)
    pool0 = torch.randn(3 * N, H, K, K, generator=torch.Generator().manual_seed(offset)).to(DEVICE)
    idx = torch.arange(0, 3 * N, 3, dtype=torch.int32, device=DEVICE)
    results = []
    for path in ("direct", "direct", "triton"):
        if path == "triton":
            _through_triton(monkeypatch)
        pool = pool0.clone()
        out = views(torch.zeros_like(v))
        _decode(inputs, pool, idx, out, **kw)
        torch.cuda.synchronize()
        results.append((out.clone(), pool))
    for o, p in results[:2]:
        assert same_bits(o, results[2][0]) and same_bits(p, results[2][1])


@pytest.mark.gpu
def test_direct_prefill_equals_tritons_launch(monkeypatch):
    """A prefill (gate pass, prepare, walk) and a varlen one with a sequence of one token (T values that
    Triton specialises differently) through both paths, bit for bit."""
    H, K = 2, 64
    runs = []
    for path in ("direct", "direct", "triton"):
        if path == "triton":
            _through_triton(monkeypatch)
        got = []
        for bounds in ([0, 200], [0, 1, 17, 145], [0, 16, 16, 160]):
            T = bounds[-1]
            q, k, v, g, beta, kw = make_inputs(1, T, H, H, K, K, dtype=torch.bfloat16, gate="lower_bound",
                                               device=DEVICE, seed=T, beta_sigmoid=True)
            cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
            o, s = kda.chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                 cu_seqlens=cu, **kw)
            got.append((o, s))
        torch.cuda.synchronize()
        runs.append(got)
    for run in runs[:2]:
        for (o, s), (o_ref, s_ref) in zip(run, runs[2]):
            assert same_bits(o, o_ref) and same_bits(s, s_ref)


@pytest.mark.parametrize("version,tested", [
    ("3.6.0", True), ("3.6.1", True), ("3.9.0", True), ("3.9.0+git1234abcd", True), ("3.9.1rc1", True),
    ("3.5.1", False), ("3.7.0", False), ("3.8.0", False), ("3.10.0", False), ("4.6.0", False), ("2.9.0", False),
    ("", False), ("dev", False),
])
def test_the_fast_path_is_gated_on_the_tested_triton_versions(version, tested):
    """Triton's internals that the direct path reads were read from 3.6 and 3.9 only; any other version launches
    through Triton (`FAST_PATH` false: no direct launch, no recording)."""
    assert launch.fast_path_tested(version) == tested
    assert launch.FAST_PATH == launch.fast_path_tested(triton.__version__)


def test_a_plain_launch_gives_the_bits_of_the_gated_one(monkeypatch):
    """The decode kernel's launch of a real paged call, run again through `DirectKernel(fn, fast_path=False)`
    (Triton's own launch, what an untested Triton version gets) and twice through the kernel as `kda` built it
    (on the GPU the second is a direct launch of a specialisation already compiled): the same bits in every
    tensor it writes. The call runs under KDA_DEBUG so that nothing replays and every launch is noted."""
    monkeypatch.setenv("KDA_DEBUG", "1")
    q, k, v, g, beta, kw = make_inputs(4, 1, 2, 2, 16, 16, dtype=torch.bfloat16, gate="lower_bound", device=DEVICE,
                                       seed=5, beta_sigmoid=True)
    pool = torch.randn(8, 2, 16, 16, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    idx = torch.tensor([6, 1, 3, 0], dtype=torch.int32, device=DEVICE)
    record = launch.RECORD.launches = []
    try:
        _decode((q, k, v, g, beta), pool, idx, None, **kw)
    finally:
        launch.RECORD.launches = None
    launches = [op for op in record if op[0] != "wait"]
    assert launches
    for kernel, grid, args, meta, _ in launches:
        plain = DirectKernel(kernel.fn, fast_path=False)
        assert not plain.direct and plain.compiled(args, meta) is None
        runs = []
        for kern in (plain, kernel, kernel):
            fresh = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            kern[grid](*fresh, **meta)
            runs.append(fresh)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        for run in runs[1:]:
            for a, b in zip(runs[0], run):
                assert not isinstance(a, torch.Tensor) or same_bits(a, b)
