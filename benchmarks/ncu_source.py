"""Where one kernel's warps stall, by SASS instruction: a summary of Nsight Compute's source page.

    ncu --profile-from-start off --kernel-name regex:_chunk_state_kernel --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -f -o walk \\
        python3 benchmarks/kernel_profile.py call --op chunk --B 1 --T 16384 --H 32
    ncu --import walk.ncu-rep --page source --csv --print-source sass > walk.csv      (on the GPU machine)
    python benchmarks/ncu_source.py walk.csv [--top 30]                                  (anywhere)
    ncu --import walk.ncu-rep --page source --csv --print-source cuda,sass > lines.csv
    python benchmarks/ncu_source.py --lines lines.csv [--top 30]

Prints the stall samples (`Warp Stall Sampling (All Samples)`) and the warp instructions executed: in all, by opcode,
by stall reason (the `stall_*` columns, where the export has them), by loop (each backward branch closes one: the
instructions from its target to it, the innermost loop owning an instruction), and the top instructions with their
main reasons. With --lines, the export that interleaves source lines with their instructions: the stall samples by
source line (file and line number, each line's own row: its instructions' samples summed by Nsight Compute), with
their main reasons. Which instruction a stall is charged to is the one waiting to issue: a load's latency shows at
its first use.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
BRANCH = re.compile(r"\bBRA\S*\s+[^;]*?(0x[0-9a-fA-F]+)")


@dataclass
class Instr:
    address: int
    text: str
    samples: float
    executed: float
    reasons: dict = field(default_factory=dict)

    @property
    def opcode(self) -> str:
        words = self.text.split()
        if words and words[0].startswith("@"):
            words = words[1:]
        return words[0].split(".")[0] if words else "?"

    def branch_target(self) -> int | None:
        m = BRANCH.search(self.text)
        return int(m.group(1), 16) if m else None


def _num(x: str) -> float:
    try:
        return float((x or "").replace(",", ""))
    except ValueError:
        return 0.0


def _why(reasons: dict) -> str:
    """The three largest stall reasons with their samples."""
    return ", ".join(f"{r} {v:.0f}" for r, v in sorted(reasons.items(), key=lambda kv: -kv[1])[:3])


def _reason_columns(hd: list[str]) -> list[tuple[int, str]]:
    """(column, reason) of each stall reason in a header row; the "(Not Issued)" columns count a subset of the same
    samples again."""
    return [(i, name[len("stall_"):]) for i, name in enumerate(hd)
            if name.startswith("stall_") and not name.endswith("(Not Issued)")]


def read(path: Path) -> list[Instr]:
    """The instructions of the first kernel in an exported source page (a header row naming Address and Source)."""
    rows = list(csv.reader(path.read_text(errors="replace").splitlines()))
    head = next((i for i, r in enumerate(rows) if "Address" in r and "Source" in r), None)
    if head is None:
        raise ValueError(f"{path}: no header row with Address and Source (is it `--page source --csv`?)")
    hd = rows[head]
    col = {name: hd.index(name) for name in ("Address", "Source")}
    i_s = hd.index(SAMPLES) if SAMPLES in hd else None
    i_e = hd.index(EXECUTED) if EXECUTED in hd else None
    reasons = _reason_columns(hd)
    out = []
    for r in rows[head + 1:]:
        if len(r) != len(hd):
            if out:
                break  # the next kernel's table
            continue
        try:
            address = int(r[col["Address"]], 16)
        except ValueError:
            continue
        out.append(Instr(address, r[col["Source"]].strip(), _num(r[i_s]) if i_s is not None else 0.0,
                         _num(r[i_e]) if i_e is not None else 0.0,
                         {name: _num(r[i]) for i, name in reasons if _num(r[i])}))
    return out


def loops(instrs: list[Instr]) -> list[tuple[int, int]]:
    """(first, last) address of each loop: a branch to an address at or before its own."""
    spans = []
    for ins in instrs:
        t = ins.branch_target()
        if t is not None and t <= ins.address:
            spans.append((t, ins.address))
    return sorted(spans)


def owner(address: int, spans: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The innermost loop holding `address` (None: straight-line code)."""
    inside = [s for s in spans if s[0] <= address <= s[1]]
    return min(inside, key=lambda s: s[1] - s[0]) if inside else None


def summary(instrs: list[Instr], top: int = 30) -> str:
    total = sum(i.samples for i in instrs) or 1.0
    lines = [f"{len(instrs)} instructions, {total:.0f} stall samples, "
             f"{sum(i.executed for i in instrs):.0f} warp instructions executed"]
    by_op = collections.Counter()
    for i in instrs:
        by_op[i.opcode] += i.samples
    lines.append("by opcode: " + ", ".join(f"{o} {100 * v / total:.1f}%" for o, v in by_op.most_common(16)))
    by_reason = collections.Counter()
    for i in instrs:
        by_reason.update(i.reasons)
    if by_reason:
        rs = sum(by_reason.values()) or 1.0
        lines.append("by reason: " + ", ".join(f"{r} {100 * v / rs:.1f}%" for r, v in by_reason.most_common(12)))
    spans = loops(instrs)
    regions = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for i in instrs:
        key = owner(i.address, spans)
        regions[key][0] += i.samples
        regions[key][1] += i.executed
        regions[key][2] += 1
    lines.append("by loop (first-last address: instructions, samples, executed):")
    for key in sorted(regions, key=lambda k: (-1, -1) if k is None else k):
        s, e, n = regions[key]
        name = "outside loops" if key is None else f"{key[0]:#06x}-{key[1]:#06x}"
        lines.append(f"  {name}: {n} instructions, {100 * s / total:.1f}% of samples, {e:.0f} executed")
    lines.append(f"top {top} instructions:")
    for i in sorted(instrs, key=lambda x: -x.samples)[:top]:
        lines.append(f"  {i.address:#06x} {100 * i.samples / total:5.1f}%  {i.text[:70]:70s} {_why(i.reasons)}")
    return "\n".join(lines)


@dataclass
class Line:
    file: str
    line: int
    text: str
    samples: float
    reasons: dict = field(default_factory=dict)


def read_lines(path: Path) -> list[Line]:
    """The source lines of a `--print-source cuda,sass` export: after each `File Path` row a header (`Line No`, ...)
    and, per line, its row (its number, its text, then the metrics of its instructions summed) before the rows of its
    instructions (no number)."""
    out, file, hd = [], "?", None
    for r in csv.reader(path.read_text(errors="replace").splitlines()):
        if not r:
            continue
        if r[0] == "File Path":
            file = r[1].rsplit("/", 1)[-1] if len(r) > 1 else "?"
        elif r[0] == "Line No":
            hd, i_s, cols = r, r.index(SAMPLES), _reason_columns(r)
        elif hd is not None and r[0].isdigit() and len(r) == len(hd):
            reasons = {name: _num(r[i]) for i, name in cols if _num(r[i])}
            out.append(Line(file, int(r[0]), r[1].strip(), _num(r[i_s]), reasons))
    if hd is None:
        raise ValueError(f"{path}: no `Line No` header (is it `--print-source cuda,sass`?)")
    return out


def line_summary(lines: list[Line], top: int = 30) -> str:
    total = sum(x.samples for x in lines) or 1.0
    out = [f"{len(lines)} source lines, {total:.0f} stall samples; top {top} lines:"]
    for x in sorted(lines, key=lambda x: -x.samples)[:top]:
        out.append(f"  {100 * x.samples / total:5.1f}%  {x.file}:{x.line:<5} {x.text[:60]:60s} {_why(x.reasons)}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv", type=Path, help="`ncu --import REP --page source --csv --print-source sass` output")
    p.add_argument("--top", type=int, default=30, help="instructions (or lines) listed (default 30)")
    p.add_argument("--lines", action="store_true", help="the CSV is `--print-source cuda,sass`: samples by line")
    a = p.parse_args(argv)
    print(line_summary(read_lines(a.csv), a.top) if a.lines else summary(read(a.csv), a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
