"""Error measures, rounding floors, growth-exponent fits, bitwise comparison and the run's environment.

Every error is taken in float64 against the float64 oracle; a rounding floor is the error of the exact
answer itself rounded to the dtype in question (no result stored in that dtype can do better)."""

from __future__ import annotations

import datetime
import math
import os
import platform
import subprocess

import torch


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref||_2 / ||ref||_2 in float64 (the plain norm of the difference when ref is zero)."""
    x, ref = x.double(), ref.double()
    den = torch.linalg.vector_norm(ref).item()
    num = torch.linalg.vector_norm(x - ref).item()
    return num / den if den > 0 else num


def max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    return (x.double() - ref.double()).abs().max().item()


def errors(x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, prefix: str) -> tuple[dict, dict]:
    """(metrics, info) for one result: relative L2 error, max abs error / max |ref| (the checked pair),
    and, as info, the raw max abs error, max |ref| and the rounding floor of ref in `dtype`."""
    ref_max = ref.double().abs().max().item() if ref.numel() else 0.0
    err_max = max_abs(x, ref)
    metrics = {f"{prefix}_rel": rel_l2(x, ref), f"{prefix}_max_abs_rel": err_max / ref_max if ref_max else err_max}
    floor = rel_l2(ref.to(dtype), ref)
    info = {f"{prefix}_max_abs": err_max, f"{prefix}_ref_absmax": ref_max, f"{prefix}_floor": floor,
            f"{prefix}_floor_max_abs": max_abs(ref.to(dtype), ref)}
    return metrics, info


def all_finite(*xs: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(x).all()) for x in xs if x is not None)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included) of two tensors of one dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    itype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[a.element_size()]
    return torch.equal(a.contiguous().view(itype), b.contiguous().view(itype))


def fit_exponent(xs, ys) -> dict:
    """Growth exponent of y ~ c * x^p: least squares of log y on log x (scipy.stats.linregress).

    Returns slope p, its standard error, the 95% interval p +- t_{0.975, n-2} * stderr, r^2 and n. Points
    with y <= 0 are dropped; with fewer than 3 points the interval is None (not enough to estimate it)."""
    import numpy as np
    from scipy import stats

    pts = [(float(x), float(y)) for x, y in zip(xs, ys) if x > 0 and y is not None and y > 0 and math.isfinite(y)]
    out = dict(slope=None, stderr=None, ci_low=None, ci_high=None, r2=None, n=len(pts))
    if len(pts) < 2:
        return out
    lx = np.log([p[0] for p in pts])
    ly = np.log([p[1] for p in pts])
    if np.ptp(lx) == 0:
        return out
    fit = stats.linregress(lx, ly)
    if not math.isfinite(fit.slope):
        return out
    out.update(slope=float(fit.slope), r2=float(fit.rvalue**2) if math.isfinite(fit.rvalue) else None)
    if len(pts) >= 3:
        # a perfect fit (e.g. a constant error) has stderr 0, which linregress may return as nan
        stderr = float(fit.stderr) if math.isfinite(fit.stderr) else 0.0
        half = float(stats.t.ppf(0.975, len(pts) - 2)) * stderr
        out.update(stderr=stderr, ci_low=float(fit.slope) - half, ci_high=float(fit.slope) + half)
    return out


def _git(*args: str) -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except Exception:
        return None


def environment(device: str, seed: int) -> dict:
    """What the numbers depend on and that stays put between two runs of one commit on one kind of device:
    device, library versions, seed, interpreter and dot-precision settings (report.json `meta.environment`).
    What changes from run to run is in `run_metadata`."""
    import numpy
    import scipy
    import triton

    device_name = torch.cuda.get_device_name() if device == "cuda" else "CPU, Triton interpreter"
    return dict(
        device=device, device_name=device_name, torch=torch.__version__, triton=triton.__version__,
        numpy=numpy.__version__, scipy=scipy.__version__, python=platform.python_version(), seed=seed,
        triton_interpret=os.environ.get("TRITON_INTERPRET", ""),
        kda_dot_precision=("ieee (interpreter)" if device == "cpu"
                           else "tf32, operands rounded to nearest (16-bit inputs); ieee (fp32 inputs)"),
    )


def run_metadata() -> dict:
    """The volatile part of a run (meta.json, and the one delimited block of report.md): git commit and
    whether the tree had changes, date, host and its load average. Taken when the run starts."""
    # KDA_COMMIT when set: the GPU machine's copy of the tree may carry a stale .git (scripts/gpu_suite.sh)
    commit, status = os.environ.get("KDA_COMMIT"), None
    if not commit:
        commit, status = _git("rev-parse", "HEAD"), _git("status", "--porcelain")
    return dict(
        git_commit=commit, git_dirty=None if status is None else bool(status),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        host=f"{platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        # what else kept the cores busy when the run started: the run time means little without it
        load_average=round(os.getloadavg()[0], 1) if hasattr(os, "getloadavg") else None,
    )
