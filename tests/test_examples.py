"""The examples run as a user runs them: a subprocess from the repository root, checked by their exit code."""

import os
import subprocess
import sys
from pathlib import Path

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
