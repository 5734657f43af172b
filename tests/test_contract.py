"""The front door: bad input raises ValueError/TypeError naming the argument, before anything is written."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import DEVICE
from helpers import bits, make_inputs, poison_pool

import kda
from kda import contract

FNS = [kda.chunk_kda, kda.fused_recurrent_kda]


def _to_device(name, x):
    """Tensors of a case go to the test device, except meta tensors (a wrong device is the case) and
    `cu_seqlens_cpu` (a host copy by definition)."""
    if not isinstance(x, torch.Tensor) or x.device.type == "meta" or name == "cu_seqlens_cpu":
        return x
    return x.to(DEVICE)


def _readable(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type != "meta" and x.is_floating_point()


def _call(fn, **over):
    """A valid paged call with `over` replacing arguments; asserts it raises ValueError/TypeError and that
    the default pool and `out`, and any pool or `out` passed in `over`, keep their bits. Returns the
    pytest.raises info."""
    q, k, v, g, beta, _ = make_inputs(1, 6, 1, 2, 8, 8, seed=1, device=DEVICE)
    pool = poison_pool(4, (2, 8, 8), torch.float32, DEVICE)
    out = torch.full((1, 6, 2, 8), 7.0, device=DEVICE)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, state_cache=pool,
                state_indices=torch.tensor([1, 2], dtype=torch.int32, device=DEVICE),
                has_initial_state=torch.tensor([False, False], device=DEVICE),
                cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE), state_v_first=True, out=out)
    args.update({n: _to_device(n, x) for n, x in over.items()})
    watched = [pool, out] + [args[n] for n in ("state_cache", "initial_state", "out") if _readable(args.get(n))]
    before = [bits(x) for x in watched]
    pos = [args.pop(n) for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises((ValueError, TypeError)) as info:
        fn(*pos, **args)
    for x, b in zip(watched, before):
        assert torch.equal(bits(x), b), "a failed call wrote the pool or out"
    return info


def _names(word: str, message: str) -> bool:
    """`word` (an argument's name) appears in `message` as a name, not inside another word."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(word)}(?![A-Za-z0-9_])", message) is not None


BAD = [
    ("initial_state", dict(initial_state=torch.zeros(2, 2, 8, 8)), "initial_state"),
    ("state_indices dtype", dict(state_indices=torch.tensor([1, 2])), "state_indices"),
    ("state_indices shape", dict(state_indices=torch.tensor([1], dtype=torch.int32)), "state_indices"),
    ("has_initial_state dtype", dict(has_initial_state=torch.tensor([1, 0], dtype=torch.int32)), "has_initial_state"),
    ("output_final_state", dict(output_final_state=True), "output_final_state"),
    ("out dtype", dict(out=torch.zeros(1, 6, 2, 8, dtype=torch.float16)), "out"),
    ("A_log without gate", dict(A_log=torch.zeros(2)), "A_log"),
    ("lower_bound positive", dict(use_gate_in_kernel=True, lower_bound=1.0), "lower_bound"),
    ("cu_seqlens dtype", dict(cu_seqlens=torch.tensor([0.0, 2.0, 6.0])), "cu_seqlens"),
    ("cu_seqlens_cpu mismatch", dict(cu_seqlens_cpu=[0, 2, 5]), "cu_seqlens_cpu"),
    ("state layout", dict(state_v_first=False, state_cache=torch.zeros(4, 2, 8, 4)), "state_cache"),
    ("state_dtype mismatch", dict(state_dtype=torch.bfloat16), "state_dtype"),
    ("scale type", dict(scale="x"), "scale"),
    ("q dtype", dict(q=torch.zeros(1, 6, 1, 8, dtype=torch.float64)), "q"),
    ("v shape", dict(v=torch.zeros(6, 2, 8)), "v"),
    ("g shape", dict(g=torch.zeros(1, 6, 2, 7)), "g"),
    ("unknown keyword", dict(use_qk_l2norm=True), "use_qk_l2norm"),
]


@pytest.mark.parametrize("fn", FNS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("name,over,word", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_naming_the_argument_and_writes_nothing(fn, name, over, word):
    info = _call(fn, **over)
    assert _names(word, str(info.value)), str(info.value)


def test_chunk_needs_has_initial_state_with_a_pool():
    info = _call(kda.chunk_kda, has_initial_state=None)
    assert "has_initial_state" in str(info.value)


def test_out_overlapping_an_input_is_refused():
    q, k, v, g, beta, _ = make_inputs(1, 4, 1, 1, 8, 8, seed=2, device=DEVICE)
    for fn in FNS:
        with pytest.raises(ValueError, match="overlaps v"):
            fn(q, k, v, g, beta, out=v)


def test_cpu_tensors_without_the_interpreter_name_both_options(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, g, beta, _ = make_inputs(1, 4, 1, 1, 8, 8, seed=3)
    if q.device.type != "cpu":
        pytest.skip("CPU-only check")
    with pytest.raises(ValueError) as info:
        kda.chunk_kda(q, k, v, g, beta)
    assert "TRITON_INTERPRET=1" in str(info.value) and "kda_reference" in str(info.value)


def test_debug_mode_checks_slot_range_and_uniqueness(monkeypatch):
    monkeypatch.setenv("KDA_DEBUG", "1")
    assert contract.debug_enabled()
    for idx, word in (([1, 9], "slot"), ([2, 2], "twice")):
        info = _call(kda.fused_recurrent_kda, state_indices=torch.tensor(idx, dtype=torch.int32))
        assert word in str(info.value)
    info = _call(kda.chunk_kda, cu_seqlens=torch.tensor([0, 4, 3], dtype=torch.int32))
    assert "cu_seqlens" in str(info.value)


def test_stochastic_rounding_that_would_change_nothing_is_refused():
    q, k, v, g, beta, _ = make_inputs(1, 3, 1, 1, 8, 8, seed=4, device=DEVICE)
    with pytest.raises(ValueError, match="stochastic_rounding"):
        kda.fused_recurrent_kda(q, k, v, g, beta, stochastic_rounding=True, state_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="stochastic_rounding"):
        kda.fused_recurrent_kda(q, k, v, g, beta, stochastic_rounding=True, output_final_state=True)


@pytest.mark.parametrize("fn", FNS, ids=lambda f: f.__name__)
def test_a_pool_needs_its_layout_stated(fn):
    """A square pool plane (K == V) cannot reveal its layout: state_v_first must be given with state_cache."""
    info = _call(fn, state_v_first=None)
    message = str(info.value)
    assert "state_v_first" in message and "[slots, HV, V, K]" in message and "[slots, HV, K, V]" in message
    info = _call(fn, state_v_first=1)
    assert "state_v_first" in str(info.value)


def test_without_a_pool_the_layout_defaults_to_k_first():
    q, k, v, g, beta, _ = make_inputs(1, 3, 1, 1, 4, 6, seed=5, device=DEVICE)
    h0 = torch.randn(1, 1, 4, 6).to(DEVICE)  # K-first [N, HV, K, V]; K != V, so a V-first read would raise
    _, s_default = kda.fused_recurrent_kda(q, k, v, g, beta, None, h0, True)
    _, s_k_first = kda.fused_recurrent_kda(q, k, v, g, beta, None, h0, True, state_v_first=False)
    assert s_default.shape == (1, 1, 4, 6) and torch.equal(bits(s_default), bits(s_k_first))


@pytest.mark.parametrize("value,on", [("", False), ("0", False), ("false", False), ("OFF", False), ("No", False),
                                      ("1", True), ("true", True), ("ON", True), ("Yes", True)])
def test_kda_debug_accepts_the_documented_values(monkeypatch, value, on):
    monkeypatch.setenv("KDA_DEBUG", value)
    assert contract.debug_enabled() is on


def test_kda_debug_unset_is_off(monkeypatch):
    monkeypatch.delenv("KDA_DEBUG", raising=False)
    assert contract.debug_enabled() is False


@pytest.mark.parametrize("value", ["2", "debug", "enable", "tru"])
def test_kda_debug_rejects_any_other_value_at_call_time(monkeypatch, value):
    monkeypatch.setenv("KDA_DEBUG", value)
    for fn in FNS:
        info = _call(fn)
        assert "KDA_DEBUG" in str(info.value)
