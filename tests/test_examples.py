"""The examples run as a user runs them: a subprocess from the repository root, checked by their exit code."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_serving_step():
    """examples/serving_step.py for 6 steps: a prefill step, mixed steps (decode tokens with prefill chunks,
    a prompt continued across steps), a padded decode step and a request admitted into a freed slot, each
    checked against the oracle by the example itself (it exits 1 when a step is out of tolerance)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "examples/serving_step.py", "--steps", "6"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert len([ln for ln in lines if ln.startswith("step")]) == 6
    for kind in ("prefill", "mixed", "decode", "pad", "D:"):
        assert any(kind in ln for ln in lines), (kind, res.stdout)
    assert lines[-1] == "all steps within tolerance"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU ranks under the interpreter (tests/test_distributed.py)")
def test_cp_prefill():
    """examples/cp_prefill.py under torchrun, 2 CPU processes (gloo, the interpreter): the serving call (varlen,
    paged pools) and the training call (dense batch cut in time), each rank checked against the oracle by
    the example itself (exit 1 when out of tolerance)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "examples/cp_prefill.py", "--device", "cpu"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    for rank in (0, 1):
        for kind in ("serving", "training"):
            assert any(ln.startswith(f"rank {rank}: {kind}") and ln.endswith("ok") for ln in lines), res.stdout
    assert "all ranks within tolerance" in lines, res.stdout
