"""Carry Triton's compiled kernels from one GPU machine to the next: the device machines start bare, and a cold
test suite spends most of its time compiling (benchmarks/results/2026-12-02-bd80f73-h200-beside-h32-host-cost.md).

    python3 scripts/triton_cache.py pack OUT.tar.xz [--limit-mib 15.9] [--parts N]   (at the end of a call, into $OUT)
    python3 scripts/triton_cache.py unpack FILE.tar.xz [FILE.tar.xz ...]              (at the start of the next call)

`pack` keeps of each cache entry what a cache hit loads (the binary, its metadata, the group naming them, a
compiled launcher, an autotuning result), not the intermediate IR, newest entries first while the xz file stays
within its limit (the device tool brings back files of at most 16 MiB); with `--parts N` the entries past the first
file go on into OUT.2.tar.xz .. OUT.N.tar.xz (each within the limit, each entry in one file: a benchmark beside fla
compiles more than one file holds). `unpack` writes the entries into the cache
directory and points each group at its files there: Triton's groups name their files by absolute path, so a group
unpacked elsewhere would find none and miss (and a group naming a file left behind misses too). An entry is keyed by
everything that compiled it (Triton's build, the kernel's source and its dependencies, the specialisation, the
options), so an entry whose kernel changed since is never hit, only carried. The cache directory is Triton's:
TRITON_CACHE_DIR, else TRITON_HOME/.triton/cache, else ~/.triton/cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
from pathlib import Path

KEEP = (".cubin", ".hsaco", ".json", ".so")  # what a hit reads; ttir, ttgir, llir, ptx, source are for humans


def cache_dir() -> Path:
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    return Path(os.environ.get("TRITON_HOME") or Path.home()) / ".triton" / "cache"


def pack(out: Path, limit: int, parts: int = 1) -> None:
    root = cache_dir()
    left = sorted((d for d in root.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime, reverse=True) \
        if root.is_dir() else []
    total, written = len(left), []
    for path in part_paths(out, parts):
        if not left and written:
            break
        budget = limit - 2**21  # the compressor holds output back: stop adding entries short of the limit
        while True:
            kept, rest = _write(path, left, budget)
            if path.stat().st_size <= limit:
                break
            budget = int(budget * 0.8) if budget > 2**20 else -1  # at -1 no entry: an entry past the limit stays out
        written.append(f"{path} ({kept} entries, {path.stat().st_size / 2**20:.1f} MiB)")
        left = rest
    print(f"packed {total - len(left)} of {total} cache entries of {root} into {', '.join(written)}"
          f"{'; the oldest ' + str(len(left)) + ' left out (budget)' if left else ''}")


def part_paths(out: Path, parts: int) -> list[Path]:
    """OUT.tar.xz, then OUT.2.tar.xz .. OUT.<parts>.tar.xz."""
    stem = out.name[:-len(".tar.xz")] if out.name.endswith(".tar.xz") else out.name
    return [out] + [out.with_name(f"{stem}.{i}.tar.xz") for i in range(2, parts + 1)]


def _write(out: Path, entries: list[Path], budget: int) -> tuple[int, list[Path]]:
    """The newest entries into `out` until its compressed size passes `budget`: (entries kept, those left)."""
    kept = 0
    with out.open("wb") as raw, tarfile.open(fileobj=raw, mode="w:xz", preset=1) as tar:  # 7x at 20 MB/s
        for d in entries:
            if raw.tell() > budget:
                break
            for f in sorted(d.iterdir()):
                if f.suffix in KEEP and f.is_file():
                    tar.add(f, arcname=f"{d.name}/{f.name}")
            kept += 1
    return kept, entries[kept:]


def unpack(src: Path) -> None:
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(src, mode="r:xz") as tar:
        files = {}
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if m.isfile() and len(parts) == 2 and ".." not in parts:  # entry/file, nothing else
                files[parts] = tar.extractfile(m).read()
    groups = 0
    for (key, name), data in files.items():
        entry = root / key
        entry.mkdir(exist_ok=True)
        if name.startswith("__grp__"):  # the files of the group that came along, where they now are
            names = [c for c in json.loads(data)["child_paths"] if (key, c) in files]
            data = json.dumps({"child_paths": {c: str(entry / c) for c in names}}).encode()
            groups += 1
        (entry / name).write_bytes(data)
    print(f"unpacked {groups} compiled kernels from {src} into {root}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    a = sub.add_parser("pack")
    a.add_argument("out", type=Path)
    a.add_argument("--limit-mib", type=float, default=15.9, help="a file's size at most (default 15.9)")
    a.add_argument("--parts", type=int, default=1, help="files at most: OUT, then OUT.2.tar.xz, ... (default 1)")
    b = sub.add_parser("unpack")
    b.add_argument("src", type=Path, nargs="+")
    args = p.parse_args()
    if args.verb == "pack":
        pack(args.out, int(args.limit_mib * 2**20), max(1, args.parts))
    else:
        for src in args.src:
            unpack(src)
    return 0


if __name__ == "__main__":
    sys.exit(main())
