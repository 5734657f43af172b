"""scripts/triton_cache.py, which carries compiled kernels from one GPU machine to the next: what Triton's own cache
manager reads back after a pack on one machine and an unpack into another directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "triton_cache.py"


def _entry(root: Path, key: str, name: str, size: int = 64) -> dict[str, str]:
    """A cache entry as Triton writes one: IR, binary, metadata, and the group naming them by absolute path."""
    d = root / key
    d.mkdir(parents=True)
    files = {}
    for ext in ("source", "ttir", "ttgir", "llir", "ptx", "cubin", "json"):
        f = d / f"{name}.{ext}"
        f.write_bytes(os.urandom(size) if ext == "cubin" else f"{ext} of {name}".encode())
        files[f.name] = str(f)
    (d / f"__grp__{name}.json").write_text(json.dumps({"child_paths": files}))
    return files


def _run(env_dir: Path, *args: str) -> str:
    env = dict(os.environ, TRITON_CACHE_DIR=str(env_dir))
    done = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, check=True)
    return done.stdout


def test_unpacked_groups_point_at_their_new_place(tmp_path, monkeypatch):
    """Triton's groups name files by absolute path: unpacked elsewhere, its cache manager must find the binary and
    the metadata there (a hit), and nothing of the IR that was left behind."""
    cache = pytest.importorskip("triton.runtime.cache")
    src, dst = tmp_path / "a", tmp_path / "b"
    sent = _entry(src, "KEY1", "_k")
    (src / "KEY2").mkdir()
    (src / "KEY2" / "k.autotune.json").write_text('{"configs": 1}')
    _run(src, "pack", str(tmp_path / "c.tar.xz"))
    _run(dst, "unpack", str(tmp_path / "c.tar.xz"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(dst))  # Triton's cache manager reads it at construction
    group = cache.FileCacheManager("KEY1").get_group("_k.json")
    assert group == {"_k.cubin": str(dst / "KEY1" / "_k.cubin"), "_k.json": str(dst / "KEY1" / "_k.json")}
    assert (dst / "KEY1" / "_k.cubin").read_bytes() == Path(sent["_k.cubin"]).read_bytes()
    assert (dst / "KEY2" / "k.autotune.json").read_text() == '{"configs": 1}'


def test_pack_keeps_the_newest_entries_within_its_limit(tmp_path):
    """Incompressible binaries past the limit: the file stays within it and keeps the most recent entries."""
    src = tmp_path / "a"
    for i in range(8):
        _entry(src, f"KEY{i}", f"_k{i}", size=2**20)
        os.utime(src / f"KEY{i}", (1000 + i, 1000 + i))
    out = tmp_path / "c.tar.xz"
    _run(src, "pack", str(out), "--limit-mib", "3")
    assert out.stat().st_size <= 3 * 2**20
    _run(tmp_path / "b", "unpack", str(out))
    kept = sorted(p.name for p in (tmp_path / "b").iterdir())
    assert kept and kept == [f"KEY{i}" for i in range(8 - len(kept), 8)]


def test_pack_in_parts_carries_every_entry_once(tmp_path):
    """Past one file's limit the entries go on into OUT.2.tar.xz, newest first: each file within the limit, every
    entry in exactly one, and unpacking all of them restores every entry (with its group pointing there)."""
    src = tmp_path / "a"
    for i in range(8):
        _entry(src, f"KEY{i}", f"_k{i}", size=2**20)
        os.utime(src / f"KEY{i}", (1000 + i, 1000 + i))
    out = tmp_path / "c.tar.xz"
    _run(src, "pack", str(out), "--limit-mib", "3", "--parts", "8")
    parts = [out] + sorted(tmp_path.glob("c.*.tar.xz"), key=lambda p: int(p.name.split(".")[1]))
    assert len(parts) > 1 and all(p.stat().st_size <= 3 * 2**20 for p in parts)
    seen = []
    for i, part in enumerate(parts):
        dst = tmp_path / f"p{i}"
        _run(dst, "unpack", str(part))
        seen.append(sorted(p.name for p in dst.iterdir()))
    assert sorted(sum(seen, [])) == [f"KEY{i}" for i in range(8)]  # each entry once
    assert max(int(k[3:]) for k in seen[1]) < min(int(k[3:]) for k in seen[0])  # the newest in the first file
    _run(tmp_path / "all", "unpack", *map(str, parts))
    for i in range(8):
        group = json.loads((tmp_path / "all" / f"KEY{i}" / f"__grp___k{i}.json").read_text())
        assert group["child_paths"][f"_k{i}.cubin"] == str(tmp_path / "all" / f"KEY{i}" / f"_k{i}.cubin")
