"""`--check BASELINE.json`: compare this run with a committed baseline report.

An entry of the baseline fails when, in this run,
- any error metric (relative L2 error, max abs error / max |exact|; scalars and every point of a curve)
  exceeds CHECK_FACTOR x its baseline value + CHECK_SLACK (config.py), or is missing or not finite;
- any check that was true in the baseline (bitwise agreement, finiteness, bounds) is false or missing;
- the entry itself is missing although its section ran.
Sections this run skipped (`--sections`) are not compared. The preset must be the baseline's."""

from __future__ import annotations

import json
import math

from .config import CHECK_FACTOR, CHECK_SLACK


def load(path: str) -> dict:
    with open(path) as f:
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
