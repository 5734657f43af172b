"""Per-kernel GPU time of chunk_kda (torch.profiler): every stage for Kimi's bounded gate, with the
bounded intra kernel and the solve at their default launches and swept around them, with the pairwise
one (what an unbounded gate runs), and the state walk plain (also at BV 32 with 8 and 2 warps) and
segmented. Development aid:
`python scripts/profile_chunk.py`."""

import torch
from torch.profiler import ProfilerActivity, profile

import kda
import kda.ops.chunk as chunk_ops
import kda.ops.chunk_state as walk_ops


def inputs(B, T, H, K=128, V=128):
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, T, H, K, device=dev, dtype=dt)
    k = torch.randn(B, T, H, K, device=dev, dtype=dt)
    v = torch.randn(B, T, H, V, device=dev, dtype=dt)
    g = torch.randn(B, T, H, K, device=dev)
    beta = torch.randn(B, T, H, device=dev)
    h0 = torch.randn(B, H, K, V, device=dev)
    kw = dict(use_gate_in_kernel=True, A_log=torch.randn(H, device=dev), dt_bias=torch.randn(H * K, device=dev),
              lower_bound=-5.0, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              initial_state=h0, output_final_state=True)
    return (q, k, v, g, beta), kw


def kernel_times(args, kw, reps=3):
    for _ in range(2):
        kda.chunk_kda(*args, **kw)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            kda.chunk_kda(*args, **kw)
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / reps for e in prof.key_averages() if e.self_device_time_total > 0}


def fmt(rows):
    return ", ".join(f"{k[:28]} {v:.0f}us" for k, v in sorted(rows.items(), key=lambda x: -x[1])[:4])


def timed(args, kw):
    """fmt(kernel_times(...)), or the error of a launch that does not compile (e.g. out of shared memory)."""
    try:
        return fmt(kernel_times(args, kw))
    except Exception as e:  # noqa: BLE001 - a sweep point that fails is reported, the sweep goes on
        return f"failed: {type(e).__name__}: {str(e)[:200]}"


if __name__ == "__main__":
    bounded = chunk_ops.bounded_gate
    for B, T, H in [(1, 4096, 12), (1, 16384, 32), (1, 8192, 96)]:
        args, kw = inputs(B, T, H)
        print(f"{B}x{T} H={H} bounded: {timed(args, kw)}", flush=True)
        chunk_ops._ROW_BATCHED = not chunk_ops._ROW_BATCHED  # the other form (KDA_DEV_INTRA_FORM)
        print(f"{B}x{T} H={H} bounded, ROW_BATCHED={chunk_ops._ROW_BATCHED}: {timed(args, kw)}", flush=True)
        chunk_ops._ROW_BATCHED = not chunk_ops._ROW_BATCHED
        if (B, T, H) != (1, 4096, 12):  # the K-slice loads' pipelining (_BOUNDED_LAUNCH num_stages)
            default_launch = chunk_ops._BOUNDED_LAUNCH
            for warps, stages in ((8, 1), (8, 2), (8, 4), (4, 3)):
                chunk_ops._BOUNDED_LAUNCH = {"num_warps": warps, "num_stages": stages}
                print(f"{B}x{T} H={H} bounded {warps} warps {stages} stages: {timed(args, kw)}", flush=True)
            chunk_ops._BOUNDED_LAUNCH = default_launch
            default_solve = chunk_ops._SOLVE_LAUNCH  # the solve's launch (_SOLVE_LAUNCH)
            for warps, stages in ((8, 1), (4, 2), (2, 1)):
                chunk_ops._SOLVE_LAUNCH = {"num_warps": warps, "num_stages": stages}
                print(f"{B}x{T} H={H} solve {warps} warps {stages} stages: {timed(args, kw)}", flush=True)
            chunk_ops._SOLVE_LAUNCH = default_solve
        chunk_ops.bounded_gate = lambda call: False  # the intra kernel of an unbounded gate
        print(f"{B}x{T} H={H} pairwise: {timed(args, kw)}", flush=True)
        chunk_ops.bounded_gate = bounded
    for B, T, H in [(1, 16384, 12), (1, 16384, 32), (4, 4096, 32), (1, 8192, 96), (1, 65536, 12)]:
        args, kw = inputs(B, T, H)
        for mode in ("never", "always"):
            walk_ops.SEGMENT_MODE = mode
            print(f"{B}x{T} H={H} segments {mode:6s}: {timed(args, kw)}", flush=True)
        walk_ops.SEGMENT_MODE = "never"  # the plain walk's launch (walk_ops._WALK_LAUNCH)
        default_walk = walk_ops._WALK_LAUNCH
        for bv, warps in ((32, 8), (32, 2)):
            walk_ops._WALK_LAUNCH = {"BV": bv, "num_warps": warps}
            print(f"{B}x{T} H={H} plain walk BV={bv} {warps} warps: {timed(args, kw)}", flush=True)
        walk_ops._WALK_LAUNCH = default_walk
    walk_ops.SEGMENT_MODE = "auto"
