"""The benchmark's CPU-side parts: its command line and its HBM floor (the timing itself needs a GPU)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_help_runs_without_a_gpu():
    done = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--json" in done.stdout and "--no-fla-varlen" in done.stdout


def test_floor_bytes_by_hand():
    bench = _bench()
    # H = HV = 12, K = V = 128; per token: q, k bf16 (2 x 12 x 128 x 2 B) + v, o bf16 (same) + g fp32
    # (12 x 128 x 4 B) + beta bf16 (12 x 2 B) = 6144 + 6144 + 6144 + 24 = 18456 B; A_log + dt_bias fp32:
    # 12 x 4 + 12 x 128 x 4 = 6192 B; one fp32 state plane set: 12 x 128 x 128 x 4 = 786432 B.
    decode = bench.Case("d", "decode", "decode", 64, 1, 12)
    # 64 tokens, 64 states read and written, 64 int32 slot indices
    assert bench.floor_bytes(decode) == 64 * 18456 + 2 * 64 * 786432 + 6192 + 64 * 4 == 101_850_928
    prefill = bench.Case("p", "prefill", "dense", 1, 4096, 12)
    # 4096 tokens, one dense state read and written, no indices
    assert bench.floor_bytes(prefill) == 4096 * 18456 + 2 * 786432 + 6192 == 77_174_832
    bf16_pool = bench.Case("d", "decode", "decode", 256, 1, 12, pool_dtype="bfloat16", v_first=False)
    assert bench.floor_bytes(bf16_pool) == 256 * 18456 + 2 * 256 * 786432 // 2 + 6192 + 256 * 4


def test_the_acceptance_rows_are_all_there():
    bench = _bench()
    names = [c.name for c in bench.all_cases()]
    for B, T, H in ((1, 4096, 12), (1, 16384, 12), (1, 4096, 32), (1, 16384, 32), (4, 4096, 32), (1, 8192, 96),
                    (1, 65536, 12)):
        assert f"prefill {B}x{T} H={H}" in names
    kinds = [c.group for c in bench.all_cases()]
    assert kinds[-1] == "varlen" and "mixed" in kinds  # the varlen row runs last


def test_no_benchmark_script_shadows_a_standard_module():
    """`python benchmarks/X.py` puts benchmarks/ first on sys.path: a script named like a standard module
    (profile.py did) replaces it for every library the benchmark imports (fla's import then failed)."""
    import sys
    from pathlib import Path

    names = {p.stem for p in (Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py")}
    assert not names & set(sys.stdlib_module_names)
