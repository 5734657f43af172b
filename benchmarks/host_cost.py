"""Host (Python) cost of one `kda` call on CPU, the kernel launches replaced by no-ops.

    TRITON_INTERPRET=1 python3 benchmarks/host_cost.py [--calls 2000] [--device meta|cpu] [--profile CASE]

At the benchmark's serving shapes (K = V = 128, bf16 q/k/v, fp32 raw gate with the in-kernel lower-bound
gate, q/k l2norm and beta sigmoid in the kernel, fp32 state), per case: `kda.contract.check_call`, the
plan (`decode_plan` or `chunk_plan`), and the whole public call with every Triton launch stubbed out
(validation, plan, allocations, argument assembly: the Python around the launches), in microseconds per
call (the best of 5 rounds of `--calls` calls, timed by this thread's CPU time, `time.thread_time`, so
that other processes on a shared machine do not count). Triton's own launch cost is not in these numbers
(it needs a GPU). The tensors live on the `meta` device by default: no memory behind them, so `torch.empty`
costs about what CUDA's caching allocator does (a CPU allocation of a large workspace costs more), and
the CPU-only interpreter check is skipped as on a GPU. `--profile CASE` prints cProfile's top entries of
that case's stubbed call.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import os
import pstats
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import kda  # noqa: E402
from kda import plan as kplan  # noqa: E402
from kda.api import check_call_args  # noqa: E402
from kda.contract import check_call  # noqa: E402

K_DIM = V_DIM = 128


class _NoLaunch:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](*args, **kwargs)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_launches() -> None:
    import kda.ops.chunk as chunk
    import kda.ops.fused_recurrent as fr

    for mod in (chunk, fr):
        for name in dir(mod):
            if name.startswith("_") and name.endswith("_kernel"):
                setattr(mod, name, _NoLaunch())


def _tokens(B, T, H, dev):
    q, k, v = (torch.empty(B, T, H, K_DIM, dtype=torch.bfloat16, device=dev) for _ in range(3))
    g = torch.empty(B, T, H, K_DIM, device=dev)
    beta = torch.empty(B, T, H, dtype=torch.bfloat16, device=dev)
    flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                 A_log=torch.zeros(H, device=dev), dt_bias=torch.zeros(H * K_DIM, device=dev), lower_bound=-5.0)
    return (q, k, v, g, beta), flags


def cases(dev: str) -> dict:
    """name -> (public function, positional args, keyword args): the benchmark's decode and prefill rows."""
    out = {}
    N, H = 256, 12
    for vf in (True, False):
        plane = (H, V_DIM, K_DIM) if vf else (H, K_DIM, V_DIM)
        pool = torch.zeros(4 * N, *plane, device=dev)
        idx = torch.arange(0, 4 * N, 4, dtype=torch.int32, device=dev)
        tag = "vfirst" if vf else "kfirst"
        args, flags = _tokens(N, 1, H, dev)
        out[f"decode N=256 H=12 dense-batch {tag}"] = (
            kda.fused_recurrent_kda, args,
            dict(state_cache=pool, state_indices=idx, state_v_first=vf, **flags))
        args, flags = _tokens(1, N, H, dev)
        out[f"decode N=256 H=12 varlen+cpu {tag}"] = (
            kda.fused_recurrent_kda, args,
            dict(cu_seqlens=torch.arange(N + 1, device=dev), cu_seqlens_cpu=list(range(N + 1)), state_cache=pool,
                 state_indices=idx, state_v_first=vf, **flags))
    for T, H in ((4096, 12), (16384, 32)):
        args, flags = _tokens(1, T, H, dev)
        h0 = torch.zeros(1, H, K_DIM, V_DIM, device=dev)
        out[f"prefill 1x{T} H={H} dense"] = (kda.chunk_kda, (*args, None, h0, True), flags)
        pool = torch.zeros(4, H, V_DIM, K_DIM, device=dev)
        out[f"prefill 1x{T} H={H} paged"] = (
            kda.chunk_kda, args,
            dict(state_cache=pool, state_indices=torch.tensor([2], dtype=torch.int32, device=dev),
                 has_initial_state=torch.ones(1, dtype=torch.bool, device=dev), state_v_first=True, **flags))
    # the benchmark's mixed row: 256 one-token sequences and two of 2048 in one varlen call, host bounds given
    N, H = 258, 32
    bounds = list(range(257)) + [256 + 2048, 256 + 4096]
    args, flags = _tokens(1, bounds[-1], H, dev)
    out["mixed 256x1 + 2x2048 H=32 paged"] = (
        kda.chunk_kda, args,
        dict(cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=dev), cu_seqlens_cpu=bounds,
             state_cache=torch.zeros(4 * N, H, V_DIM, K_DIM, device=dev),
             state_indices=torch.arange(0, 4 * N, 4, dtype=torch.int32, device=dev),
             has_initial_state=torch.ones(N, dtype=torch.bool, device=dev), state_v_first=True, **flags))
    return out


def checked(fn, args, kw):
    """`check_call` as the public function makes it (its arguments assembled once, outside the timing)."""
    positional, keywords = check_call_args(fn, *args, **kw)
    return lambda: check_call(*positional, **keywords)


def per_call_us(f, calls: int, rounds: int = 5) -> float:
    f()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(calls):
            f()
        best = min(best, (time.thread_time() - t0) / calls)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--device", default="meta", choices=("meta", "cpu"))
    ap.add_argument("--profile", default=None, help="a case name (or a unique part of one) to profile")
    a = ap.parse_args()
    stub_launches()
    print(f"torch {torch.__version__}, {a.device} tensors; CPU us per call, best of 5 x {a.calls} calls")
    print(f"{'case':40s} {'check_call':>10s} {'plan':>8s} {'call':>8s}")
    for name, (fn, args, kw) in cases(a.device).items():
        check = checked(fn, args, kw)
        planner = kplan.decode_plan if fn is kda.fused_recurrent_kda else kplan.prefill_plan
        plan = functools.partial(planner, check())
        whole = functools.partial(fn, *args, **kw)
        print(f"{name:40s} {per_call_us(check, a.calls):10.1f} {per_call_us(plan, a.calls):8.1f} "
              f"{per_call_us(whole, a.calls):8.1f}")
        if a.profile and a.profile in name:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.calls):
                whole()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)

if __name__ == "__main__":
    main()
