"""The Gluon prepare (`kda/ops/hopper_prepare.py`, `ChunkPlan.prepare == "hopper"`) on a Hopper GPU: held to the
float64 oracle at tests/test_gpu.py's bounds and to its `tl` twin (the same function; its gate scan and the products'
rounding order differ), in dense calls of one or several sequences, a chunk of one token, varlen
with empty, one-token and routed sequences, and the walk beside the prepare (its counters). The public call takes it
where the plan picks it (`kda.plan.gluon_prepare`: K = V = 128 at every head count) and the twin elsewhere (a
misaligned head stride), bit for bit what the forced plan gives. sm_90 under a Triton release the kernel was
tested with only."""

from __future__ import annotations

import pytest
import torch
from helpers import checked_call, make_inputs, rel_err, run_planned

import kda
import kda_reference as ref
from kda import plan as P

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not P.device_info(0).gluon,
                       reason="the Gluon kernels are Hopper's (sm_90), under Triton releases they were tested with"),
]

TWIN_STATE = 2e-4  # the fp32 final state's relative L2 against the twin (measured 2e-6 to 2e-5)
# the bf16 output's against the twin: the Gluon form scans the raw gate in the thread where the twin takes the gate
# pass's b2, so values a few ulp apart in fp32 round to neighbouring bf16 values in a few percent of the outputs
# (measured 4.6e-4 to 4.8e-4); half the bf16 rounding floor (1.66e-3), and each as near the oracle as the twin
TWIN_OUTPUT = 8.3e-4


def _as_the_twin(o_h, s_h, o_t, s_t, ro=None):
    assert rel_err(o_h, o_t) <= TWIN_OUTPUT and rel_err(s_h, s_t) <= TWIN_STATE
    if ro is not None:
        assert rel_err(o_h, ro) <= 1.02 * rel_err(o_t, ro)


def _inputs(B, T, H, lengths=None, seed=0, pad=0):
    """Kimi's gate, bf16, q and k l2-normalised in the kernel; `pad` > 0: q, k, v views of [.., K + pad] rows."""
    q, k, v, g, beta, kw = make_inputs(B, T, H, H, 128, 128, dtype=torch.bfloat16, gate="lower_bound", device="cuda",
                                       seed=seed, normalize_k=False, beta_sigmoid=True)
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, pad))[..., :128] for x in (q, k, v))
    kw["use_qk_l2norm_in_kernel"] = True
    N = B
    if lengths is not None:
        N = len(lengths)
        kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                                        device="cuda")
    h0 = 0.1 * torch.randn(N, H, 128, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    return (q, k, v, g, beta), h0, kw


def _run(args, h0, kw, prepare):
    # the twin as every other device runs it, after its gate pass; the Gluon form scans the gate itself
    o, s, plan = run_planned(kda.chunk_kda, *args, {"prepare": prepare, "gate_pass": prepare != "hopper"},
                             initial_state=h0, output_final_state=True, **kw)
    assert plan.prepare == prepare
    return o, s


@pytest.mark.parametrize("B,T,lengths", [(1, 1024, None), (2, 1000, None), (1, 65, None),
                                         (1, 2973, [1, 0, 700, 5, 64, 65, 1000, 1, 17, 1047, 73])],
                         ids=["1x1024", "2x1000", "one-token-chunk", "varlen-routed"])
def test_against_float64_and_the_twin(B, T, lengths):
    """Varlen: last chunks of 1, 9, 17, 23, 40 and 60 rows (the prepare's halves and anchors partly past the
    sequence), each sequence held to the oracle on its own so that one sequence's error cannot hide in the call's."""
    args, h0, kw = _inputs(B, T, 4, lengths, seed=T)
    o_h, s_h = _run(args, h0, kw, "hopper")
    o_t, s_t = _run(args, h0, kw, "fused")
    ro, rs = ref.chunk_kda(*args, initial_state=h0.double(), output_final_state=True, allow_float64=True, **kw)
    assert rel_err(o_h, ro) <= 2.5e-3 and rel_err(s_h, rs) <= 1.5e-3
    _as_the_twin(o_h, s_h, o_t, s_t, ro)
    if lengths:
        bounds = kw["cu_seqlens"].tolist()
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            assert rel_err(o_h[:, a:b], ro[:, a:b]) <= 2.5e-3 and rel_err(s_h[i], rs[i]) <= 1.5e-3, (i, lengths[i])


def test_beside_the_walk_at_32_heads():
    """H = 32: the walk beside the prepare (V blocks of 64, counters the prepare counts into)."""
    args, h0, kw = _inputs(1, 4096, 32, seed=5)
    o_h, s_h = _run(args, h0, kw, "hopper")
    o_t, s_t = _run(args, h0, kw, "fused")
    _as_the_twin(o_h, s_h, o_t, s_t)


@pytest.mark.parametrize("H,pad,prepare", [(96, 0, "hopper"), (12, 0, "hopper"), (96, 8, "fused")],
                         ids=["96-heads", "12-heads", "96-heads-misaligned"])
def test_the_public_call_takes_the_planned_prepare(H, pad, prepare):
    """`kda.chunk_kda` runs the prepare `gluon_prepare` picks, bit for bit the forced plan's: the Gluon one at 96
    and at 12 heads (the walk beside it), the twin where a head stride of 136 elements leaves the rows 16-byte
    misaligned for the asynchronous copies; the Gluon one against the oracle too."""
    args, h0, kw = _inputs(1, 1024, H, seed=H + pad, pad=pad)
    assert P.chunk_plan(checked_call(kda.chunk_kda, *args, initial_state=h0, **kw)).prepare == prepare
    o, s = kda.chunk_kda(*args, initial_state=h0.clone(), output_final_state=True, **kw)
    o_p, s_p = _run(args, h0, kw, prepare)
    assert torch.equal(o, o_p) and torch.equal(s, s_p)
    if prepare == "hopper":
        ro, rs = ref.chunk_kda(*args, initial_state=h0.double(), output_final_state=True, allow_float64=True, **kw)
        assert rel_err(o, ro) <= 2.5e-3 and rel_err(s, rs) <= 1.5e-3
