"""A compiled kernel's SASS instructions by source line and opcode, loops weighted by their trips: how many
instructions a thread issues for one work item, counted on a machine without a GPU.

    python benchmarks/offline_compile.py --targets sm_90 --cases prefill-1x16384-h32 --pools fp32 --out DIR
    python benchmarks/sass_lines.py DIR/sm_90-1-_chunk_prepare_hopper_kernel.cubin [--trips 4] [--top 30] [--loop N]

Runs `nvdisasm -g` (beside the ptxas Triton ships) on the cubin. Every loop (a backward branch and its target) counts
`--trips` times, the same for all: the Gluon prepare's K loop and merges both run four, so its count is a warp's
instructions an item, the number that moved with its time when nothing else changed (the 64dafe5 file). Prints the
total, the opcodes, each loop's size, and the source lines issuing the most; `--loop N` lists the lines of loop N
alone (loops numbered by address). Which line an instruction is charged to is the compiler's line table's: inlined
helpers charge their own lines (`standard.py` for reductions and scans).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

FILE = re.compile(r'//## File "([^"]+)", line (\d+)')
INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
LABEL = re.compile(r"^(\.L_x_\d+):")
TARGET = re.compile(r"`\((\.L_x_\d+)\)")


@dataclass(frozen=True)
class Instr:
    address: int
    opcode: str  # without modifiers: `FSEL`, `HGMMA`
    line: tuple[str, int] | None  # (file name, line) of the line table, or None before any entry
    target: str | None  # a branch's label


def parse(listing: str) -> tuple[list[Instr], dict[str, int]]:
    """The instructions of an `nvdisasm -g` listing and the address of each label."""
    instrs, labels, pending, line = [], {}, [], None
    for text in listing.splitlines():
        m = FILE.search(text)
        if m:
            line = (Path(m.group(1)).name, int(m.group(2)))
            continue
        m = LABEL.match(text.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = INSTR.match(text)
        if m:
            address = int(m.group(1), 16)
            labels.update((name, address) for name in pending)
            pending = []
            t = TARGET.search(m.group(4)) if m.group(3).startswith("BRA") else None
            instrs.append(Instr(address, m.group(3).split(".")[0], line, t.group(1) if t else None))
    return instrs, labels


def loops(instrs: list[Instr], labels: dict[str, int], least: int = 8) -> list[tuple[int, int]]:
    """(first, last) address of every loop: a branch to a label at or before it, sorted by first address; loops of
    fewer than `least` instructions (spin-waits, the trap after the last exit) are not counted as loops."""
    spans = {(labels[i.target], i.address) for i in instrs if i.target in labels and labels[i.target] <= i.address}
    return sorted(s for s in spans if sum(1 for i in instrs if s[0] <= i.address <= s[1]) >= least)


def weight(address: int, spans: list[tuple[int, int]], trips: int) -> int:
    """trips ** (the loops holding the address): nested loops multiply."""
    return trips ** sum(1 for a, b in spans if a <= address <= b)


def census(instrs: list[Instr], spans: list[tuple[int, int]], trips: int, only: tuple[int, int] | None = None):
    """The weighted count by source line and opcode (`only`: the instructions of one loop, each counted once)."""
    counts = collections.defaultdict(collections.Counter)
    for i in instrs:
        if only is None:
            counts[i.line][i.opcode] += weight(i.address, spans, trips)
        elif only[0] <= i.address <= only[1]:
            counts[i.line][i.opcode] += 1
    return counts


def report(instrs: list[Instr], spans, trips: int, top: int, loop: int | None) -> str:
    only = spans[loop] if loop is not None else None
    counts = census(instrs, spans, trips, only)
    ops = sum(counts.values(), collections.Counter())
    total = sum(ops.values())
    what = (f"loop {loop} (0x{only[0]:04x}-0x{only[1]:04x}): {total} instructions a trip" if only
            else f"{total} instructions, loops weighted by {trips} trips ({len(instrs)} in the code)")
    out = [what, "opcodes: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(20))]
    if only is None:
        out.append("loops: " + "; ".join(f"{n}: 0x{a:04x}-0x{b:04x} {sum(1 for i in instrs if a <= i.address <= b)}"
                                          for n, (a, b) in enumerate(spans)))
    lines = collections.Counter({line: sum(c.values()) for line, c in counts.items()})
    for line, n in lines.most_common(top):
        where = f"{line[0]}:{line[1]}" if line else "?"
        out.append(f"{n:6d}  {where:32s} " + ", ".join(f"{k} {v}" for k, v in counts[line].most_common(6)))
    return "\n".join(out)


def listing_of(cubin: Path) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    nvdisasm = Path(get_ptxas(90).path).parent / "nvdisasm"
    return subprocess.run([str(nvdisasm), "-g", "-c", str(cubin)], capture_output=True, text=True, check=True).stdout


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/sass_lines.py", description=__doc__.split("\n\n")[0])
    p.add_argument("cubin", type=Path)
    p.add_argument("--trips", type=int, default=4, help="trips counted for every loop (default 4)")
    p.add_argument("--top", type=int, default=30, help="source lines listed (default 30)")
    p.add_argument("--loop", type=int, default=None, metavar="N", help="only loop N, its instructions once")
    args = p.parse_args(argv)
    instrs, labels = parse(listing_of(args.cubin))
    print(report(instrs, loops(instrs, labels), args.trips, args.top, args.loop))
    return 0


if __name__ == "__main__":
    sys.exit(main())
