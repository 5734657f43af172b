"""The Gluon prepare (`kda/ops/hopper_prepare.py`, `ChunkPlan.prepare == "hopper"`) on a Hopper GPU, in every form the
probe times (`benchmarks/hopper_probe.py`): held to the float64 oracle at tests/test_gpu.py's bounds, and to its `tl`
twin (the same function; the products' rounding order differs, 3e-5 apart at most where measured); dense calls in
one or several sequences, a chunk of one token, varlen with empty, one-token and routed sequences, and the walk
beside the prepare at H = 32 (its counters and the dependent launch). GPU (sm_90) only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_inputs, rel_err, run_planned

import kda
import kda_reference as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="the Gluon kernels are Hopper's (sm_90)"),
]

FORMS = {"v4": {}, "v5": {"num_warps": 8}, "v6": {"num_warps": 8, "maxnreg": 128},
         "v7": {"num_warps": 8, "programs": 132}, "v8": {"form": "v8"}}
TWIN_BOUND = 2e-4  # relative L2 against the twin: an eighth of the bf16 output's rounding floor (1.66e-3)


@pytest.fixture(params=list(FORMS))
def form(request):
    import kda.ops.chunk as C

    C.HOPPER_VARIANT.clear()
    C.HOPPER_VARIANT.update(FORMS[request.param])
    yield request.param
    C.HOPPER_VARIANT.clear()


def _inputs(B, T, H, lengths=None, seed=0):
    q, k, v, g, beta, kw = make_inputs(B, T, H, H, 128, 128, dtype=torch.bfloat16, gate="lower_bound", device="cuda",
                                       seed=seed, normalize_k=False, beta_sigmoid=True)
    kw["use_qk_l2norm_in_kernel"] = True
    N = B
    if lengths is not None:
        N = len(lengths)
        kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                                        device="cuda")
    h0 = 0.1 * torch.randn(N, H, 128, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    return (q, k, v, g, beta), h0, kw


def _both(args, h0, kw):
    """(hopper o, s), (twin o, s)."""
    o_h, s_h, plan = run_planned(kda.chunk_kda, *args, {"prepare": "hopper"}, initial_state=h0,
                                 output_final_state=True, **kw)
    assert plan.prepare == "hopper"
    o_t, s_t, twin = run_planned(kda.chunk_kda, *args, {}, initial_state=h0, output_final_state=True, **kw)
    assert twin.prepare == "fused"
    return (o_h, s_h), (o_t, s_t)


@pytest.mark.parametrize("B,T,lengths", [(1, 1024, None), (2, 1000, None), (1, 65, None),
                                         (1, 2900, [1, 0, 700, 5, 64, 65, 1000, 1, 17, 1047])],
                         ids=["1x1024", "2x1000", "one-token-chunk", "varlen-routed"])
def test_against_float64_and_the_twin(form, B, T, lengths):
    args, h0, kw = _inputs(B, T, 4, lengths, seed=T)
    (o_h, s_h), (o_t, s_t) = _both(args, h0, kw)
    ro, rs = ref.chunk_kda(*args, initial_state=h0.double(), output_final_state=True, allow_float64=True, **kw)
    assert rel_err(o_h, ro) <= 2.5e-3 and rel_err(s_h, rs) <= 1.5e-3
    assert rel_err(o_h, o_t) <= TWIN_BOUND and rel_err(s_h, s_t) <= TWIN_BOUND


def test_beside_the_walk_at_32_heads(form):
    """H = 32: the walk beside the prepare (V blocks of 64, counters the prepare counts into)."""
    args, h0, kw = _inputs(1, 4096, 32, seed=5)
    (o_h, s_h), (o_t, s_t) = _both(args, h0, kw)
    assert rel_err(o_h, o_t) <= TWIN_BOUND and rel_err(s_h, s_t) <= TWIN_BOUND


def test_first_run_workspaces_v8():
    """v8's primitives alone and its workspaces against the twin's, per tensor and (chunk, head) tile
    (benchmarks/hopper_first_run.py: each case in a subprocess with a timeout, so a hang fails one case); its report
    names the first tensor, tile and region that disagrees."""
    root = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "hopper_first_run.py"), "--form", "v8",
                        "--timeout", "240", "--budget", "900"], cwd=root, capture_output=True, text=True, timeout=960)
    print(p.stdout[-30000:], p.stderr[-5000:])
    assert p.returncode == 0, p.stdout[-6000:]
