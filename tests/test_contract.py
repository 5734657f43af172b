"""The front door: bad input raises ValueError/TypeError naming the argument, before anything is written."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import DEVICE
from helpers import bits, make_inputs, on_cpu, poison_pool

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


def case_args(**over) -> tuple[dict, list]:
    """The catalogs' base call, valid: varlen sequences of 2 and 4 tokens (T = 6) in slots 1 and 2 of a
    poisoned V-first fp32 pool, `has_initial_state` false, `out` filled with 7; `over` replaces arguments.
    Returns (every argument by name, [the default pool, the default out])."""
    q, k, v, g, beta, _ = make_inputs(1, 6, 1, 2, 8, 8, seed=1, device=DEVICE)
    pool = poison_pool(4, (2, 8, 8), torch.float32, DEVICE)
    out = torch.full((1, 6, 2, 8), 7.0, device=DEVICE)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, state_cache=pool,
                state_indices=torch.tensor([1, 2], dtype=torch.int32, device=DEVICE),
                has_initial_state=torch.tensor([False, False], device=DEVICE),
                cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE), state_v_first=True, out=out)
    args.update({n: _to_device(n, x) for n, x in over.items()})
    return args, [pool, out]


def call_with(fn, args: dict):
    """`fn` called with `case_args`' arguments (q, k, v, g, beta positional)."""
    args = dict(args)
    pos = [args.pop(n) for n in ("q", "k", "v", "g", "beta")]
    return fn(*pos, **args)


def _call(fn, **over):
    """A valid paged call with `over` replacing arguments; asserts it raises ValueError/TypeError and that
    the default pool and `out`, and any pool or `out` passed in `over`, keep their bits. Returns the
    pytest.raises info."""
    args, defaults = case_args(**over)
    watched = defaults + [args[n] for n in ("state_cache", "initial_state", "out") if _readable(args.get(n))]
    before = [bits(x) for x in watched]
    with pytest.raises((ValueError, TypeError)) as info:
        call_with(fn, args)
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


# The catalog of bad inputs beyond BAD. Each case is a factory, so its tensors are built on the test
# device when the case runs (views, aliases and strides must survive; `.to` would copy them).


def _z(*shape, dtype=torch.float32, device=None):
    return torch.zeros(*shape, dtype=dtype, device=device or DEVICE)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _flags(n):
    return torch.zeros(n, dtype=torch.bool, device=DEVICE)


def _dense(**over):
    """No pool: the dense contract (or none) in place of `_call`'s paged one."""
    return dict(state_cache=None, state_indices=None, has_initial_state=None, **over)


def _batch2(**over):
    """A dense batch B = 2, T = 3 (no cu_seqlens) over the same pool; `over` replaces what it names."""
    q, k, v, g, beta, _ = make_inputs(2, 3, 1, 2, 8, 8, seed=6, device=DEVICE)
    return {**dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=None, out=_z(2, 3, 2, 8)), **over}


def _three_seqs(**over):
    """Three sequences (bounds 0, 2, 4, 6) in slots 1, 2, 3; `over` replaces what it names."""
    return {**dict(cu_seqlens=_i32(0, 2, 4, 6), state_indices=_i32(1, 2, 3), has_initial_state=_flags(3)), **over}


def _out_is_v():
    t = torch.randn(1, 6, 2, 8, device=DEVICE)
    return dict(v=t, out=t)


def _out_is_g():
    t = -torch.rand(1, 6, 2, 8, device=DEVICE)
    return dict(g=t, out=t)


def _out_overlaps_q():
    buf = torch.randn(120, device=DEVICE)
    return dict(q=buf[:48].view(1, 6, 1, 8), out=buf[24:120].view(1, 6, 2, 8))


def _out_in_the_pool():
    pool = poison_pool(4, (2, 8, 8), torch.float32, DEVICE)
    return dict(state_cache=pool, out=pool.view(-1)[128:224].view(1, 6, 2, 8))


GATE = dict(use_gate_in_kernel=True)

CATALOG = [
    # shapes
    ("q not 4-D", lambda: dict(q=_z(6, 1, 8)), "q"),
    ("k shape differs from q", lambda: dict(k=_z(1, 6, 1, 4)), "k"),
    ("beta shape", lambda: dict(beta=_z(1, 6, 1)), "beta"),
    ("HV not a multiple of H", lambda: dict(q=_z(1, 6, 3, 8), k=_z(1, 6, 3, 8)), "v.shape[2]"),
    ("B > 1 with cu_seqlens", lambda: _batch2(cu_seqlens=_i32(0, 1, 3)), "cu_seqlens"),
    ("cu_seqlens 2-D", lambda: dict(cu_seqlens=_i32(0, 2, 6).view(1, 3)), "cu_seqlens"),
    ("cu_seqlens empty", lambda: dict(cu_seqlens=_z(0, dtype=torch.int32)), "cu_seqlens"),
    ("state_cache 3-D", lambda: dict(state_cache=_z(4, 2, 64)), "state_cache"),
    ("initial_state with the wrong N", lambda: _dense(initial_state=_z(3, 2, 8, 8)), "initial_state"),
    # dtypes
    ("k dtype differs from q", lambda: dict(k=_z(1, 6, 1, 8, dtype=torch.float16)), "k"),
    ("v dtype differs from q", lambda: dict(v=_z(1, 6, 2, 8, dtype=torch.bfloat16)), "v"),
    ("g float64", lambda: dict(g=_z(1, 6, 2, 8, dtype=torch.float64)), "g"),
    ("beta integer", lambda: dict(beta=_z(1, 6, 2, dtype=torch.int32)), "beta"),
    ("state_cache float64", lambda: dict(state_cache=_z(4, 2, 8, 8, dtype=torch.float64)), "state_cache"),
    ("state_dtype unsupported", lambda: _dense(state_dtype=torch.float64), "state_dtype"),
    # devices (meta: another device on any machine)
    ("k on another device", lambda: dict(k=_z(1, 6, 1, 8, device="meta")), "k"),
    ("state_cache on another device", lambda: dict(state_cache=_z(4, 2, 8, 8, device="meta")), "state_cache"),
    ("state_indices on another device",
     lambda: dict(state_indices=_z(2, dtype=torch.int32, device="meta")), "state_indices"),
    ("cu_seqlens on another device", lambda: dict(cu_seqlens=_z(3, dtype=torch.int32, device="meta")), "cu_seqlens"),
    ("out on another device", lambda: dict(out=_z(1, 6, 2, 8, device="meta")), "out"),
    ("cu_seqlens_cpu not on the host",
     lambda: dict(cu_seqlens_cpu=_z(3, dtype=torch.int32, device="meta")), "cu_seqlens_cpu"),
    # strides
    ("q strided last dim", lambda: dict(q=_z(1, 6, 1, 16)[..., ::2]), "q"),
    ("v strided last dim", lambda: dict(v=_z(1, 6, 2, 16)[..., ::2]), "v"),
    ("q batch stride != T * token stride", lambda: _batch2(q=_z(2, 4, 1, 8)[:, :3]), "q"),
    ("beta batch stride != T * token stride", lambda: _batch2(beta=_z(2, 4, 2)[:, :3]), "beta"),
    ("out strided last dim", lambda: dict(out=_z(1, 6, 2, 16)[..., ::2]), "out"),
    ("state_cache planes not dense", lambda: dict(state_cache=_z(4, 2, 8, 16)[..., ::2]), "state_cache"),
    ("state_cache slots overlap",
     lambda: dict(state_cache=_z(320).as_strided((4, 2, 8, 8), (64, 64, 8, 1))), "state_cache"),
    ("state_cache slots expanded (stride 0)", lambda: dict(state_cache=_z(1, 2, 8, 8).expand(4, 2, 8, 8)),
     "state_cache"),
    ("state_cache heads expanded (stride 0)", lambda: dict(state_cache=_z(4, 1, 8, 8).expand(4, 2, 8, 8)),
     "state_cache"),
    ("initial_state expanded (stride 0)", lambda: _dense(initial_state=_z(1, 2, 8, 8).expand(2, 2, 8, 8)),
     "initial_state"),
    ("state_indices strided", lambda: dict(state_indices=_i32(1, 0, 2, 0)[::2]), "state_indices"),
    ("cu_seqlens strided", lambda: dict(cu_seqlens=_i32(0, 0, 2, 0, 6)[::2]), "cu_seqlens"),
    # out aliasing an input or the pool
    ("out is v", _out_is_v, "out"),
    ("out is g", _out_is_g, "out"),
    ("out overlaps q in part", _out_overlaps_q, "out"),
    ("out inside state_cache", _out_in_the_pool, "out"),
    # state_indices and has_initial_state
    ("state_indices missing", lambda: dict(state_indices=None), "state_indices"),
    ("state_indices a list", lambda: dict(state_indices=[1, 2]), "state_indices"),
    ("state_indices 2-D", lambda: dict(state_indices=_i32(1, 2).view(1, 2)), "state_indices"),
    ("state_indices without state_cache", lambda: dict(state_cache=None, has_initial_state=None), "state_indices"),
    ("has_initial_state too long", lambda: dict(has_initial_state=_flags(3)), "has_initial_state"),
    ("has_initial_state a list", lambda: dict(has_initial_state=[False, False]), "has_initial_state"),
    ("has_initial_state without state_cache", lambda: dict(state_cache=None, state_indices=None),
     "has_initial_state"),
    # bounds with a host copy (checked without KDA_DEBUG)
    ("cu_seqlens_cpu not starting at 0", lambda: dict(cu_seqlens_cpu=[1, 2, 6]), "cu_seqlens_cpu"),
    ("cu_seqlens_cpu decreasing", lambda: _three_seqs(cu_seqlens_cpu=[0, 4, 2, 6]), "cu_seqlens_cpu"),
    ("cu_seqlens_cpu past T", lambda: dict(cu_seqlens_cpu=[0, 2, 7]), "cu_seqlens_cpu"),
    ("cu_seqlens_cpu wrong length", lambda: dict(cu_seqlens_cpu=[0, 6]), "cu_seqlens_cpu"),
    ("cu_seqlens_cpu not a sequence", lambda: dict(cu_seqlens_cpu=6), "cu_seqlens_cpu"),
    ("cu_seqlens_cpu without cu_seqlens",
     lambda: dict(cu_seqlens=None, cu_seqlens_cpu=[0, 6], state_indices=_i32(1), has_initial_state=_flags(1)),
     "cu_seqlens_cpu"),
    # the in-kernel gate
    ("lower_bound zero", lambda: dict(GATE, lower_bound=0.0), "lower_bound"),
    ("lower_bound -inf", lambda: dict(GATE, lower_bound=float("-inf")), "lower_bound"),
    ("lower_bound NaN", lambda: dict(GATE, lower_bound=float("nan")), "lower_bound"),
    ("lower_bound a string", lambda: dict(GATE, lower_bound="-5"), "lower_bound"),
    ("lower_bound without the gate", lambda: dict(lower_bound=-5.0), "lower_bound"),
    ("dt_bias without the gate", lambda: dict(dt_bias=_z(16)), "dt_bias"),
    ("A_log wrong length", lambda: dict(GATE, A_log=_z(3)), "A_log"),
    ("A_log 2-D", lambda: dict(GATE, A_log=_z(2, 1)), "A_log"),
    ("A_log integer", lambda: dict(GATE, A_log=_z(2, dtype=torch.int32)), "A_log"),
    ("A_log a list", lambda: dict(GATE, A_log=[0.0, 0.0]), "A_log"),
    ("dt_bias wrong shape", lambda: dict(GATE, dt_bias=_z(15)), "dt_bias"),
    ("dt_bias float64", lambda: dict(GATE, dt_bias=_z(16, dtype=torch.float64)), "dt_bias"),
    ("dt_bias not contiguous", lambda: dict(GATE, dt_bias=_z(8, 2).t()), "dt_bias"),
    # keywords and scale
    ("unknown keyword (fla's initial_states typo)", lambda: dict(initial_states=None), "initial_states"),
    ("scale NaN", lambda: dict(scale=float("nan")), "scale"),
    ("scale inf", lambda: dict(scale=float("inf")), "scale"),
    ("scale a bool", lambda: dict(scale=True), "scale"),
    ("scale a tensor", lambda: dict(scale=torch.tensor(0.5)), "scale"),
    # head sizes past the supported 256
    ("K above 256", lambda: dict(q=_z(1, 6, 1, 257), k=_z(1, 6, 1, 257), g=_z(1, 6, 2, 257),
                                 state_cache=_z(4, 2, 8, 257)), "q"),
    ("V above 256", lambda: dict(v=_z(1, 6, 2, 257), state_cache=_z(4, 2, 257, 8), out=_z(1, 6, 2, 257)), "v"),
]


@pytest.mark.parametrize("fn", FNS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("name,make,word", CATALOG, ids=[c[0] for c in CATALOG])
def test_catalog_bad_input_raises_naming_the_argument_and_writes_nothing(fn, name, make, word):
    info = _call(fn, **make())
    assert _names(word, str(info.value)), str(info.value)


def _ckpt(**over):
    """Prefix-cache checkpoints for the base call, valid but for what `over` replaces. Slots 5 and 6 lie past
    the pool of 4, but the base call's sequences (2 and 4 tokens) reach no checkpoint, so no slot value is in
    play: the value checks are in tests/test_checkpoints.py."""
    return {**dict(checkpoint_every=64, checkpoint_indices=_i32(5, 6).view(2, 1)), **over}


# chunk_kda only: fused_recurrent_kda has no checkpoint keywords (an unknown keyword there, TypeError)
CHECKPOINT_CATALOG = [
    ("checkpoint_every without checkpoint_indices", lambda: dict(checkpoint_every=64), "checkpoint_indices"),
    ("checkpoint_indices without checkpoint_every", lambda: _ckpt(checkpoint_every=None), "checkpoint_every"),
    ("checkpoints without a pool", lambda: _dense(**_ckpt()), "checkpoint_indices"),
    ("checkpoints with a dense initial_state", lambda: _dense(initial_state=_z(2, 2, 8, 8), **_ckpt()),
     "checkpoint_indices"),
    ("checkpoint_every not a multiple of 64", lambda: _ckpt(checkpoint_every=100), "checkpoint_every"),
    ("checkpoint_every 32", lambda: _ckpt(checkpoint_every=32), "checkpoint_every"),
    ("checkpoint_every zero", lambda: _ckpt(checkpoint_every=0), "checkpoint_every"),
    ("checkpoint_every negative", lambda: _ckpt(checkpoint_every=-64), "checkpoint_every"),
    ("checkpoint_every a float", lambda: _ckpt(checkpoint_every=64.0), "checkpoint_every"),
    ("checkpoint_every a bool", lambda: _ckpt(checkpoint_every=True), "checkpoint_every"),
    ("checkpoint_every a tensor", lambda: _ckpt(checkpoint_every=torch.tensor(64)), "checkpoint_every"),
    ("checkpoint_indices a list", lambda: _ckpt(checkpoint_indices=[[5], [6]]), "checkpoint_indices"),
    ("checkpoint_indices float", lambda: _ckpt(checkpoint_indices=_z(2, 1)), "checkpoint_indices"),
    ("checkpoint_indices int16", lambda: _ckpt(checkpoint_indices=_i32(5, 6).view(2, 1).to(torch.int16)),
     "checkpoint_indices"),
    ("checkpoint_indices 1-D", lambda: _ckpt(checkpoint_indices=_i32(5, 6)), "checkpoint_indices"),
    ("checkpoint_indices wrong N", lambda: _ckpt(checkpoint_indices=_i32(5, 6, 7).view(3, 1)), "checkpoint_indices"),
    ("checkpoint_indices on another device",
     lambda: _ckpt(checkpoint_indices=_z(2, 1, dtype=torch.int32, device="meta")), "checkpoint_indices"),
    ("checkpoint_indices strided along C", lambda: _ckpt(checkpoint_indices=_i32(5, 0, 6, 0).view(2, 2)[:, :1]
                                                          .expand(2, 2)), "checkpoint_indices"),
]


@pytest.mark.parametrize("name,make,word", CHECKPOINT_CATALOG, ids=[c[0] for c in CHECKPOINT_CATALOG])
def test_checkpoint_catalog_raises_naming_the_argument_and_writes_nothing(name, make, word):
    info = _call(kda.chunk_kda, **make())
    assert _names(word, str(info.value)), str(info.value)


# Device-only values: checked on the host under KDA_DEBUG=1 (they need a device-to-host read).
DEBUG_CATALOG = [
    ("cu_seqlens not starting at 0", lambda: dict(cu_seqlens=_i32(1, 2, 6)), "cu_seqlens"),
    ("cu_seqlens decreasing inside [0, T]", lambda: _three_seqs(cu_seqlens=_i32(0, 4, 2, 6)), "cu_seqlens"),
    ("cu_seqlens past T", lambda: dict(cu_seqlens=_i32(0, 2, 7)), "cu_seqlens"),
    ("cu_seqlens_cpu differs from cu_seqlens", lambda: dict(cu_seqlens_cpu=[0, 3, 6]), "cu_seqlens_cpu"),
    ("slot == slots", lambda: dict(state_indices=_i32(1, 4)), "state_indices"),
    ("slot far out of range", lambda: dict(state_indices=_i32(1, 9)), "state_indices"),
    ("slot twice", lambda: dict(state_indices=_i32(2, 2)), "state_indices"),
    ("slot twice among padding", lambda: _three_seqs(state_indices=_i32(3, -1, 3)), "state_indices"),
]


@pytest.mark.parametrize("fn", FNS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("name,make,word", DEBUG_CATALOG, ids=[c[0] for c in DEBUG_CATALOG])
def test_debug_catalog_bad_device_values_raise_and_write_nothing(monkeypatch, fn, name, make, word):
    monkeypatch.setenv("KDA_DEBUG", "1")
    info = _call(fn, **make())
    assert _names(word, str(info.value)), str(info.value)


ROUNDING = [
    ("stochastic_rounding with an fp32 pool", dict(stochastic_rounding=True), "stochastic_rounding"),
    ("stochastic_rounding not a bool", dict(stochastic_rounding=1), "stochastic_rounding"),
    ("seed not an int", dict(seed=1.5), "seed"),
]


@pytest.mark.parametrize("name,over,word", ROUNDING, ids=[r[0] for r in ROUNDING])
def test_fused_recurrent_rounding_arguments_refused(name, over, word):
    info = _call(kda.fused_recurrent_kda, **over)
    assert _names(word, str(info.value)), str(info.value)


def test_chunk_kda_has_no_rounding_arguments():
    for over, word in ((dict(stochastic_rounding=False), "stochastic_rounding"), (dict(seed=0), "seed")):
        info = _call(kda.chunk_kda, **over)
        assert info.type is TypeError and _names(word, str(info.value)), str(info.value)


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


@pytest.mark.parametrize("fn,ref_fn", [(kda.chunk_kda, "chunk_kda"), (kda.fused_recurrent_kda, "recurrent_kda")],
                         ids=["chunk_kda", "fused_recurrent_kda"])
@pytest.mark.parametrize("scale", [0.0, -0.3])
def test_any_finite_scale_is_used_as_given(fn, ref_fn, scale):
    """Zero and negative scales are arithmetic, not errors (docs/contract.md): the output equals the oracle's."""
    import kda_reference

    q, k, v, g, beta, kw = make_inputs(1, 70, 1, 2, 16, 8, seed=4, device=DEVICE)
    o, _ = fn(q, k, v, g, beta, scale, **kw)
    ro, _ = getattr(kda_reference, ref_fn)(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), scale, **on_cpu(kw))
    if scale == 0.0:
        assert torch.equal(o, torch.zeros_like(o))
    else:
        assert (o.double().cpu() - ro).norm() <= 1e-5 * ro.norm()
