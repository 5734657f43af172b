"""`--check BASELINE`: compare this run with a baseline report.

The baseline is a report.json, or `committed`: `accuracy_reports/<preset>-<device>/report.json` as committed
at HEAD, read with `git show` (`committed_report`), so a rerun that overwrote the working-tree copy does not
become its own baseline. Regenerating a report and committing it is all it takes to move the baseline.

An entry of the baseline fails when, in this run,
- any error metric (relative L2 error, max abs error / max |exact|; scalars and every point of a curve)
  exceeds CHECK_FACTOR x its baseline value + CHECK_SLACK (config.py), or is missing or not finite;
- any check that was true in the baseline (bitwise agreement, finiteness, bounds) is false or missing;
- the entry itself is missing although its section ran.
Sections this run skipped (`--sections`) are not compared. The preset must be the baseline's."""

from __future__ import annotations

import json
import math
import os
import subprocess

from .config import CHECK_FACTOR, CHECK_SLACK

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def committed_path(preset: str, device: str) -> str:
    """The committed report of a preset and device, relative to the repository root."""
    return f"accuracy_reports/{preset}-{device}/report.json"


def committed_report(preset: str, device: str, rev: str = "HEAD") -> dict:
    """The report.json of `preset`-`device` as committed at `rev` (`git show`), not the working-tree file.
    Raises FileNotFoundError outside a git checkout or when that commit has no such report."""
    path = committed_path(preset, device)
    try:
        text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True,
                              timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise FileNotFoundError(f"no committed {path} at {rev} (git show failed: {err})") from err
    return json.loads(text)


def load(spec: str, preset: str, device: str) -> dict:
    """The baseline `--check` names: a report.json path, or `committed` (`committed_report`)."""
    if spec == "committed":
        try:
            return committed_report(preset, device)
        except FileNotFoundError as err:
            raise SystemExit(f"kda.accuracy --check committed: {err}") from err
    with open(spec) as f:
        return json.load(f)


def _worse(new, base) -> bool:
    if base is None:
        return False
    if new is None or not math.isfinite(new):
        return True
    return not new <= CHECK_FACTOR * base + CHECK_SLACK


def compare(baseline: dict, current: dict) -> tuple[list[str], int]:
    """(failures, number of values compared)."""
    b_preset, c_preset = baseline["meta"]["preset"]["name"], current["meta"]["preset"]["name"]
    if b_preset != c_preset:
        return [f"baseline preset {b_preset!r} differs from this run's {c_preset!r}: the entries do not match"], 0
    ran = set(current["meta"]["sections"])
    current_entries = {x["id"]: x for x in current["entries"]}
    failures, compared = [], 0
    for b in baseline["entries"]:
        if b["section"] not in ran:
            continue
        c = current_entries.get(b["id"])
        if c is None:
            failures.append(f"{b['id']}: missing from this run")
            continue
        for name, bv in b["metrics"].items():
            cv = c["metrics"].get(name)
            if isinstance(bv, list):
                if not isinstance(cv, list) or len(cv) != len(bv):
                    failures.append(f"{b['id']}: {name} has {len(cv) if isinstance(cv, list) else cv} points, "
                                    f"baseline {len(bv)}")
                    continue
                bad = [(i, n, o) for i, (n, o) in enumerate(zip(cv, bv)) if _worse(n, o)]
                compared += len(bv)
                for i, n, o in bad:
                    failures.append(f"{b['id']}: {name}[{i}] = {_f(n)} > {CHECK_FACTOR:g} x {_f(o)} + {CHECK_SLACK:g}")
            else:
                compared += 1
                if _worse(cv, bv):
                    failures.append(f"{b['id']}: {name} = {_f(cv)} > {CHECK_FACTOR:g} x {_f(bv)} + {CHECK_SLACK:g}")
        for name, ok in b["checks"].items():
            compared += 1
            if ok and not c["checks"].get(name, False):
                failures.append(f"{b['id']}: check {name} held in the baseline and fails now")
    return failures, compared


def _f(x) -> str:
    return "missing" if x is None else f"{x:.3e}"
