"""The accuracy harness (`python -m kda.accuracy`): its report, its `--check`, and its statistics.

Properties that cannot pass by accident: the tiny preset writes every file with finite numbers and
bit-exact contract checks; a rerun with the same seed writes the same report.json, report.md and plots byte
for byte (the run's commit, date and host only in meta.json); float64 noise is written as a bound or 0;
`--check` passes against a fresh run of itself and fails on a kernel whose stored state is deliberately
truncated; without matplotlib the harness stops at once with the install command; the growth-exponent fit
recovers a known exponent; the vectorised float64 recurrence of the decode study equals
`kda_reference.recurrent_kda`; the quick preset on this tree stays within `--check` of the committed
(`git show HEAD:`) quick-cpu report."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kda  # TRITON_INTERPRET is set by conftest.py when there is no GPU
from kda.accuracy import check, kernels, report
from kda.accuracy.cli import INSTALL_HINT, main
from kda.accuracy.config import CHECK_FACTOR, CHECK_SLACK, REGIMES
from kda.accuracy.inputs import Inputs, generator, regime_inputs
from kda.accuracy.measure import fit_exponent
from kda.accuracy.oracle import selfcheck

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PLOTS = report.PLOT_FILES
REPO = Path(__file__).resolve().parent.parent


def _run(out_dir, *extra, jobs=1) -> int:
    """The tiny preset, in this process unless jobs > 1 (a monkeypatched kernel reaches no worker)."""
    return main(["--preset", "tiny", "--device", DEVICE, "--out-dir", str(out_dir), "--quiet", "--jobs", str(jobs),
                 *extra])


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("baseline")
    assert _run(out) == 0
    return out


def _numbers(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _numbers(v)
    elif isinstance(x, list):
        for v in x:
            yield from _numbers(v)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield x


def test_tiny_preset_writes_the_report(baseline):
    for name in ("report.md", "report.json", "meta.json", *PLOTS):
        assert (baseline / name).stat().st_size > 0, name
    rep = json.loads((baseline / "report.json").read_text())
    numbers = list(_numbers(rep))
    assert len(numbers) > 500 and all(math.isfinite(x) for x in numbers)
    sections = {e["section"] for e in rep["entries"]}
    assert sections == {"decode", "length", "dtype_matrix", "chunked_prefill", "varlen", "paged", "adversarial",
                        "spec_verify", "checkpoints"}
    env = rep["meta"]["environment"]
    assert env["seed"] == 0 and env["torch"] and env["triton"] and env["device"] == DEVICE
    # the volatile metadata is in meta.json only, never in report.json or report.md
    run_meta = json.loads((baseline / "meta.json").read_text())
    assert run_meta["date"] and run_meta["host"] and "git_commit" in run_meta and run_meta["elapsed_s"] > 0
    assert not {"date", "git_commit", "host", "elapsed_s"} & set(json.dumps(rep).split('"')[1::2])
    # every measured number at 3 significant digits
    assert all(x == float(f"{x:.3g}") for x in _numbers({k: v for k, v in rep.items() if k != "meta"})
               if isinstance(x, float))
    # every error is a number and the fits have their intervals
    for e in rep["entries"]:
        for v in e["metrics"].values():
            assert all(isinstance(x, float) for x in (v if isinstance(v, list) else [v])), e["id"]
    dec = [e for e in rep["entries"] if e["section"] == "decode"]
    assert all(e["info"]["fit_out"]["ci_low"] is not None for e in dec)
    # the bit-exact contract checks hold on main
    for e in rep["entries"]:
        if e["section"] in ("paged", "varlen"):
            bitwise = {n: ok for n, ok in e["checks"].items() if "bits" in n or "zero" in n}
            assert bitwise and all(bitwise.values()), (e["id"], bitwise)
    md = (baseline / "report.md").read_text()
    assert "## Verdict per state storage dtype" in md and "### What to do" in md
    assert run_meta["date"] not in md and run_meta["host"] not in md and "meta.json" in md
    if run_meta["git_commit"]:
        assert run_meta["git_commit"][:7] not in md
    assert {v["state"] for v in rep["verdicts"]} == {"fp32", "bf16"}
    assert {a["state"] for a in rep["advice"]} == {"fp32", "bf16"}
    # fp32 rows show no kernel/emulation ratio against the 1.5x threshold, which applies to fp16/bf16 only
    fp32_rows = [line for line in md.splitlines() if line.startswith("| fp32 | strong |")]
    assert fp32_rows and all("n/a (fp32: no storage rounding)" in line for line in fp32_rows)


def test_rerun_is_reproducible_and_passes_check(baseline, tmp_path, capsys):
    """A second run with the same seed, this time split over two worker processes, writes the same bytes
    (report.json, report.md and the plots; only meta.json differs), and `--check` passes."""
    assert _run(tmp_path, "--check", str(baseline / "report.json"), jobs=2) == 0
    assert "passed" in capsys.readouterr().out
    assert (tmp_path / "report.json").read_bytes() == (baseline / "report.json").read_bytes()
    for name in ("report.md", *PLOTS):
        assert (tmp_path / name).read_bytes() == (baseline / name).read_bytes(), name
    assert (tmp_path / "meta.json").read_bytes() != (baseline / "meta.json").read_bytes()  # run time, date, jobs


def test_float64_noise_is_written_as_a_bound_or_zero():
    """Digits that only measure float64 rounding change with the machine's BLAS and thread count: the oracle's
    self-check is written as a power-of-ten bound, a fit of a constant curve as 0, errors with 3 digits."""
    assert report.noise_bound(1.65e-16) == report.noise_bound(2.38e-16) == report.NOISE_BOUND
    assert report.noise_bound(3e-9) == 1e-8  # a real discrepancy keeps its order of magnitude
    raw = dict(meta=dict(x=1.23456), entries=[dict(
        metrics=dict(out_rel=[1.23456e-3, -0.0]),
        info=dict(fit_state=dict(slope=2.93e-32, stderr=2.87e-16, ci_low=-7.37e-16, ci_high=7.37e-16, r2=2.09e-33),
                  fit_out=dict(slope=1.31415, ci_low=0.0648, ci_high=-1e-20)))])
    clean = report.sanitize(raw)
    assert clean["meta"] == dict(x=1.23456)
    ent = clean["entries"][0]
    assert ent["metrics"]["out_rel"] == [1.23e-3, 0.0]
    assert ent["info"]["fit_state"] == dict(slope=0.0, stderr=0.0, ci_low=0.0, ci_high=0.0, r2=0.0)
    assert ent["info"]["fit_out"] == dict(slope=1.31, ci_low=0.0648, ci_high=0.0)
    assert "-0.0" not in json.dumps(clean)
    assert report.fmt_fit(dict(slope=-1e-32, ci_low=-1e-16, ci_high=1e-16)) == "0.00 [0.00, 0.00]"


def test_missing_matplotlib_fails_fast_with_the_install_hint(tmp_path):
    """`python -m kda.accuracy` without matplotlib stops before measuring anything (and before importing
    torch), names what is missing and the install command, and writes nothing."""
    out = tmp_path / "out"
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; "
            f"sys.argv = ['kda.accuracy', '--preset', 'tiny', '--out-dir', {str(out)!r}]; "
            "runpy.run_module('kda.accuracy', run_name='__main__', alter_sys=True)")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ))
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0, proc.stdout
    assert "matplotlib" in proc.stderr and INSTALL_HINT in proc.stderr, proc.stderr
    assert 'pip install "kda[reports]"' in proc.stderr
    assert elapsed < 5, f"took {elapsed:.1f} s"
    assert not out.exists()


def _truncate_(x: torch.Tensor) -> None:
    """Round the stored state toward zero: fp32 keeps its top 16 bits (bf16 precision), fp16/bf16 lose
    their two lowest mantissa bits. In place."""
    if x.dtype == torch.float32:
        x.view(torch.int32).bitwise_and_(-65536)
    else:
        x.view(torch.int16).bitwise_and_(~3)


def _worsened_chunk(*args, **kwargs):
    o, s = kda.chunk_kda(*args, **kwargs)
    if s is not None:
        _truncate_(s)
    if kwargs.get("state_cache") is not None:
        for slot in kwargs["state_indices"].tolist():
            if slot >= 0:
                _truncate_(kwargs["state_cache"][slot])
    return o, s


def test_check_fails_on_a_worsened_kernel(baseline, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(kernels.KERNELS, "chunk", _worsened_chunk)
    rc = _run(tmp_path, "--sections", "dtype_matrix,length", "--no-plots",
              "--check", str(baseline / "report.json"))
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL dtype_matrix/chunk/in=fp32/state=fp32/gate=lower_bound: state_rel" in out
    assert "FAIL length/strong/in=fp32/state=fp32: state_rel" in out
    # the fused_recurrent kernel was not touched: its entries must not be reported
    assert "dtype_matrix/fused_recurrent" not in out


def test_check_rules():
    def report(metrics, checks, section="length", preset="tiny"):
        return dict(meta=dict(preset=dict(name=preset), sections=[section]),
                    entries=[dict(id=f"{section}/x", section=section, metrics=metrics, checks=checks)])

    base = report(dict(a=1e-3, curve=[1e-7, 1e-3]), dict(bits=True, bound=False))
    at_limit = CHECK_FACTOR * 1e-3 + CHECK_SLACK
    assert check.compare(base, report(dict(a=at_limit, curve=[CHECK_SLACK, 1e-3]), dict(bits=True)))[0] == []
    fails, _ = check.compare(base, report(dict(a=at_limit * 1.01, curve=[1e-7, 1e-3]), dict(bits=True)))
    assert len(fails) == 1 and "a = " in fails[0]
    fails, _ = check.compare(base, report(dict(a=1e-3, curve=[1e-6, float("nan")]), dict(bits=False)))
    assert len(fails) == 3  # curve[0] past the slack, curve[1] not finite, a held check now false
    fails, _ = check.compare(base, report(dict(a=1e-3), dict(bits=True)))
    assert any("curve" in f for f in fails)  # a missing metric fails
    fails, _ = check.compare(base, dict(meta=dict(preset=dict(name="tiny"), sections=["length"]), entries=[]))
    assert fails == ["length/x: missing from this run"]
    skipped = dict(meta=dict(preset=dict(name="tiny"), sections=["decode"]), entries=[])
    assert check.compare(base, skipped)[0] == []  # a section this run skipped is not compared
    assert check.compare(base, report(dict(a=1e-3, curve=[1e-7, 1e-3]), dict(bits=True), preset="quick"))[0]


def test_fit_recovers_a_known_exponent():
    gen = torch.Generator().manual_seed(5)
    Ts = [64 * 2**i for i in range(11)]
    exact = fit_exponent(Ts, [3e-4 * T**0.5 for T in Ts])
    assert abs(exact["slope"] - 0.5) < 1e-12 and exact["ci_high"] - exact["ci_low"] < 1e-9
    noisy = [3e-4 * T**0.5 * math.exp(0.2 * torch.randn(1, generator=gen).item()) for T in Ts]
    fit = fit_exponent(Ts, noisy)
    assert fit["ci_low"] < 0.5 < fit["ci_high"]
    assert fit["ci_high"] - fit["ci_low"] < 0.2 and fit["n"] == 11
    flat = fit_exponent(Ts, [2e-3 * math.exp(0.2 * torch.randn(1, generator=gen).item()) for _ in Ts])
    assert flat["ci_low"] < 0 < flat["ci_high"]
    assert fit_exponent([16, 32], [1.0, 2.0])["ci_low"] is None  # two points: no interval


def test_vectorised_recurrence_equals_the_oracle():
    """The decode study's float64 recurrence (all sequences and heads at once, GVA) against
    kda_reference.recurrent_kda, from a random float64 state."""
    inp = regime_inputs(REGIMES["weak"], 3, 12, 1, 2, 8, 8, generator(0, "test"))
    state = torch.randn(3, 2, 8, 8, dtype=torch.float64, generator=generator(1, "test"))
    assert selfcheck(Inputs(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.opts), state, 1, 8**-0.5, 12) < 1e-13


@pytest.mark.skipif(DEVICE != "cpu", reason="the committed quick report is the CPU (interpreter) one")
def test_the_committed_quick_report_holds_on_this_tree(tmp_path, capsys):
    """The committed accuracy_reports/quick-cpu/report.json (read from git at HEAD, so a report the user
    regenerated in the working tree is not its own baseline) describes this tree: the quick preset's numbers
    stay within --check's documented factor of it. Every section but decode, whose long recurrences are
    60% of the preset's work (`nox -s accuracy -- --check committed` runs it too); the decode kernels'
    accuracy is held by tests/test_fused_recurrent.py against the oracle."""
    try:
        check.committed_report("quick", "cpu")
    except FileNotFoundError as err:
        pytest.skip(f"no committed quick-cpu report to compare with: {err}")
    sections = "length,dtype_matrix,chunked_prefill,varlen,paged,adversarial"
    rc = main(["--preset", "quick", "--device", "cpu", "--out-dir", str(tmp_path), "--quiet", "--no-plots",
               "--sections", sections, "--check", "committed"])
    assert rc == 0, capsys.readouterr().out[-3000:]
