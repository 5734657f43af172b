"""The oracle and the kernels accept and reject the same inputs (docs/contract.md, "Arguments").

Every case of the bad-input catalogs of tests/test_contract.py, and the valid calls beside them (rows past the
last varlen bound among them), goes through `kda` and through `kda_reference` and must get the same verdict:
both raise the same exception type naming the same argument, or both accept, with outputs and pools that agree
within the fp32 tolerance of the kernel tests. The device-value catalog runs under `KDA_DEBUG=1`, the mode the
oracle always checks in. Not compared: `fused_recurrent_kda`'s stochastic rounding arguments, which the oracle
does not take (it never rounds stochastically).

Then the trailing rows themselves: with `cu_seqlens[-1] < T`, rows `[cu_seqlens[-1], T)` of `o` (or `out`,
poisoned with NaN first) are zero in both functions and in the oracle, whichever kernels run the call.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import DEVICE
from helpers import make_inputs, rel_err
from test_contract import BAD, CATALOG, CHECKPOINT_CATALOG, DEBUG_CATALOG, _names, call_with, case_args

import kda
import kda_reference

FP32_TOL = 1e-5  # the kernel tests' fp32 bound (tests/test_chunk.py, tests/test_fused_recurrent.py)
PAIRS = [(kda.chunk_kda, kda_reference.chunk_kda), (kda.fused_recurrent_kda, kda_reference.recurrent_kda)]
PAIR_IDS = ["chunk_kda", "fused_recurrent_kda"]


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _flags(n, value=False):
    return torch.full((n,), value, dtype=torch.bool, device=DEVICE)


def _pool():
    """A pool of finite states (the same for every call), for the cases that read their slots."""
    return torch.randn(4, 2, 8, 8, generator=torch.Generator().manual_seed(9)).to(DEVICE)


def _verdict(fn, make):
    """(the exception `fn` raised, or None; o, or None; the pool after) for a fresh `case_args(**make())`."""
    args, _ = case_args(**make())
    try:
        o, _ = call_with(fn, args)
    except (ValueError, TypeError) as error:
        return error, None, None
    pool = args.get("state_cache")
    return None, o, pool


def _same_verdict(kernel, oracle, make, word):
    """Both raise the same type naming `word`, or (`word` None) both accept with the same outputs and pool."""
    error, o, pool = _verdict(kernel, make)
    ref_error, ro, ref_pool = _verdict(oracle, make)
    if word is None:
        assert error is None, f"kda refused a valid call: {error!r}"
        assert ref_error is None, f"the oracle refused a call kda accepts: {ref_error!r}"
        assert rel_err(o, ro) <= FP32_TOL
        if pool is not None:  # slots written agree; the poison of the others is kept by both (NaN == NaN)
            torch.testing.assert_close(pool.cpu(), ref_pool.cpu(), rtol=FP32_TOL, atol=1e-6, equal_nan=True)
        return
    assert error is not None, f"kda accepted a call naming {word} as bad"
    assert ref_error is not None, f"the oracle accepted a call kda refuses: {error!r}"
    assert type(ref_error) is type(error), f"kda: {error!r}; oracle: {ref_error!r}"
    assert _names(word, str(error)) and _names(word, str(ref_error)), f"kda: {error!r}; oracle: {ref_error!r}"


def _fixed(over):
    return lambda: over


@pytest.mark.parametrize("kernel,oracle", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("name,over,word", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_same_verdict(kernel, oracle, name, over, word):
    _same_verdict(kernel, oracle, _fixed(over), word)


@pytest.mark.parametrize("kernel,oracle", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("name,make,word", CATALOG, ids=[c[0] for c in CATALOG])
def test_catalog_same_verdict(kernel, oracle, name, make, word):
    _same_verdict(kernel, oracle, make, word)


@pytest.mark.parametrize("name,make,word", CHECKPOINT_CATALOG, ids=[c[0] for c in CHECKPOINT_CATALOG])
def test_checkpoint_catalog_same_verdict(name, make, word):
    _same_verdict(kda.chunk_kda, kda_reference.chunk_kda, make, word)


@pytest.mark.parametrize("kernel,oracle", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("name,make,word", DEBUG_CATALOG, ids=[c[0] for c in DEBUG_CATALOG])
def test_device_value_catalog_same_verdict_under_kda_debug(monkeypatch, kernel, oracle, name, make, word):
    monkeypatch.setenv("KDA_DEBUG", "1")
    _same_verdict(kernel, oracle, make, word)


# The valid calls beside the catalogs, and the cases where the oracle used to differ: (name, make, the word
# named by both, or None where both accept; a dict where the two functions differ, by kda function name).
NEIGHBOURS = [
    ("the base call", lambda: {}, None),
    ("trailing rows past the last bound", lambda: dict(cu_seqlens=_i32(0, 2, 5)), None),
    ("trailing rows with host bounds", lambda: dict(cu_seqlens=_i32(0, 2, 5), cu_seqlens_cpu=[0, 2, 5]), None),
    ("only trailing rows (no sequence)",
     lambda: dict(cu_seqlens=_i32(0), state_indices=_i32(), has_initial_state=_flags(0)), None),
    ("a padding sequence", lambda: dict(state_indices=_i32(1, -1)), None),
    ("slots read", lambda: dict(has_initial_state=_flags(2, True), state_cache=_pool()), None),
    ("a K-first pool stated", lambda: dict(state_v_first=False), None),
    ("a pool without state_v_first", lambda: dict(state_v_first=None), "state_v_first"),
    ("state_indices int64", lambda: dict(state_indices=torch.tensor([1, 2], device=DEVICE)), "state_indices"),
    ("has_initial_state omitted", lambda: dict(has_initial_state=None, state_cache=_pool()),
     {"chunk_kda": "has_initial_state", "fused_recurrent_kda": None}),
    ("out in bf16 (v is fp32)", lambda: dict(out=torch.zeros(1, 6, 2, 8, dtype=torch.bfloat16)), "out"),
    ("speculative verify", lambda: dict(state_indices=_i32(0, 1, -1, -1, 2, -1, 3, -1).view(2, 4)),
     {"chunk_kda": "state_indices", "fused_recurrent_kda": None}),
    ("num_accepted_tokens int64", lambda: dict(state_indices=_i32(0, 1, -1, -1, 2, -1, 3, -1).view(2, 4),
                                               num_accepted_tokens=torch.tensor([1, 2], device=DEVICE)),
     "num_accepted_tokens"),  # chunk_kda takes no num_accepted_tokens: a TypeError naming it, from both
]


@pytest.mark.parametrize("kernel,oracle", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("name,make,word", NEIGHBOURS, ids=[c[0] for c in NEIGHBOURS])
def test_valid_neighbours_same_verdict(kernel, oracle, name, make, word):
    if isinstance(word, dict):
        word = word[kernel.__name__]
    _same_verdict(kernel, oracle, make, word)


def test_the_oracle_accepts_float64_only_when_asked():
    """float64 is the oracle's exact mode: refused as kda refuses it, accepted with allow_float64=True."""
    q, k, v, g, beta, _ = make_inputs(1, 5, 1, 2, 8, 8, dtype=torch.float64, seed=2)
    for oracle in (kda_reference.chunk_kda, kda_reference.recurrent_kda):
        with pytest.raises(TypeError, match="q"):
            oracle(q, k, v, g, beta)
        with pytest.raises(TypeError, match="state_dtype"):
            oracle(q.float(), k.float(), v.float(), g.float(), beta.float(), state_dtype=torch.float64)
        o, s = oracle(q, k, v, g, beta, output_final_state=True, state_dtype=torch.float64, allow_float64=True)
        assert o.dtype == s.dtype == torch.float64


def test_the_oracle_loads_no_triton():
    """The oracle checks with `kda.contract` and stays importable without Triton."""
    code = "import sys, kda_reference; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=".")


# ---------------------------------------------------------------------------------------------------------------
# Trailing rows: zero in o and out, in both functions and in the oracle, whichever kernels run
# ---------------------------------------------------------------------------------------------------------------

# (bounds, host bounds given): two long sequences (chunk kernels), short ones only (the recurrent loop kernel
# alone, also in chunk_kda), long and short mixed (the loop kernel beside the walk), and no sequence at all
TRAILING = [
    ([0, 40, 90], False), ([0, 40, 90], True), ([0, 3, 5], False), ([0, 3, 80, 85], True), ([0, 3, 80, 85], False),
    ([0], False),
]


@pytest.mark.parametrize("kernel,oracle", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("bounds,host", TRAILING, ids=[f"{b}{'-host' if h else ''}" for b, h in TRAILING])
def test_rows_past_the_last_bound_are_zero(kernel, oracle, bounds, host):
    T = 100
    q, k, v, g, beta, _ = make_inputs(1, T, 1, 2, 16, 16, seed=5, device=DEVICE)
    N = len(bounds) - 1
    pool = torch.randn(N + 1, 2, 16, 16, device=DEVICE)
    kw = dict(cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=DEVICE),
              state_indices=torch.arange(N, dtype=torch.int32, device=DEVICE), has_initial_state=_flags(N, True),
              state_v_first=True)
    if host:
        kw["cu_seqlens_cpu"] = bounds
    out = torch.full((1, T, 2, 16), float("nan"), device=DEVICE)
    ref_pool = pool.cpu().clone()
    ro, _ = oracle(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(),
                   **{n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}, state_cache=ref_pool)
    o_fresh, _ = kernel(q, k, v, g, beta, **kw, state_cache=pool.clone())  # no out: o allocated by the call
    o, _ = kernel(q, k, v, g, beta, out=out, **kw, state_cache=pool)
    last = bounds[-1]
    for x in (ro, o, o_fresh):
        assert not torch.isnan(x).any()
        assert torch.equal(x[0, last:].cpu(), torch.zeros_like(x[0, last:].cpu()))
    assert o is out and rel_err(o[0, :last], ro[0, :last]) <= FP32_TOL
    assert rel_err(pool.cpu(), ref_pool) <= FP32_TOL


@pytest.mark.parametrize("kernel,oracle", PAIRS, ids=PAIR_IDS)
def test_trailing_rows_of_a_dense_state_call(kernel, oracle):
    """No pool: the dense contract with trailing rows (the issue's case: bounds 0, 40, 90 and T = 100)."""
    T = 100
    q, k, v, g, beta, _ = make_inputs(1, T, 2, 4, 32, 16, seed=6, device=DEVICE)
    cu = torch.tensor([0, 40, 90], dtype=torch.int32, device=DEVICE)
    h0 = torch.randn(2, 4, 32, 16, device=DEVICE)
    out = torch.full((1, T, 4, 16), float("nan"), device=DEVICE)
    o, s = kernel(q, k, v, g, beta, None, h0, True, cu_seqlens=cu, out=out)
    ro, rs = oracle(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), None, h0.cpu(), True, cu_seqlens=cu.cpu())
    assert torch.equal(o[0, 90:].cpu(), torch.zeros(10, 4, 16))
    assert torch.equal(ro[0, 90:], torch.zeros_like(ro[0, 90:]))
    assert rel_err(o, ro) <= FP32_TOL and rel_err(s, rs) <= FP32_TOL
