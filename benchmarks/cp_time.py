"""Context-parallel prefill on several GPUs against one (`kda.distributed.chunk_kda`), timed side by side.

    torchrun --standalone --nproc-per-node 2 benchmarks/cp_time.py [--shapes 131072x12,65536x32] [--check 8192x4]
    torchrun --standalone --nproc-per-node 2 benchmarks/cp_time.py --device cpu --shapes 256x2 --check 200x2

One dense sequence per shape (B = 1, T x H), bf16 q/k/v, Kimi's gate (lower bound -5), q/k l2norm and beta
sigmoid in the kernel, fp32 dense initial and final state, K = V = 128. Every rank builds the whole inputs
from one seed on its own device and keeps its time slice (`kda.distributed.split_tokens`). Per shape:
- one device: `kda.chunk_kda` of the whole sequence on rank 0 while the other ranks wait;
- all ranks: `kda.distributed.chunk_kda`, each on its slice.
Each is timed per call after a warm-up (CUDA events; a barrier before every call), the multi-rank time of a
call being its slowest rank's; the median over `--reps` calls. Then, at the `--check` shape, both against
the float64 oracle (`kda_reference.chunk_kda`, on rank 0's CPU): output and final-state relative L2 errors
and the multi-rank over one-device ratio (the issue asks at most 1.5). Rank 0 prints a markdown table and,
with `--json`, writes the rows. NVLink multicast stays off: only plain collectives, and
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are set before NCCL starts.
On CPU (gloo, the Triton interpreter) the same steps run at tiny shapes, timed by the host clock: a check
of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kda  # noqa: E402
import kda.distributed  # noqa: E402
import kda_reference as ref  # noqa: E402

K_DIM = V_DIM = 128
LOWER_BOUND = -5.0


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--shapes", default="131072x12,65536x32", help="comma list of TxH to time")
    p.add_argument("--check", default="8192x4", help="TxH of the accuracy check against the oracle ('' to skip)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", type=Path, default=None, help="rank 0 writes the rows here")
    return p.parse_args(argv)


def shape_list(spec: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in item.split("x")) for item in filter(None, spec.split(","))]


def inputs(T: int, H: int, device: torch.device, K: int = K_DIM, V: int = V_DIM):
    """The whole sequence's inputs, the same on every rank (one seed, generated on the rank's device)."""
    gen = torch.Generator(device=device).manual_seed(1000 * T + H)
    dtype = torch.bfloat16

    def randn(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=gen, device=device).to(dt)

    q, k, v = randn(1, T, H, K, dt=dtype), randn(1, T, H, K, dt=dtype), randn(1, T, H, V, dt=dtype)
    g = randn(1, T, H, K)
    beta = randn(1, T, H, dt=dtype)
    A_log = torch.rand(H, generator=gen, device=device).mul(15.0).add(1.0).log()
    dt_bias = 0.5 * randn(H * K)
    h0 = 0.1 * randn(1, H, K, V)
    gate = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                A_log=A_log, dt_bias=dt_bias, lower_bound=LOWER_BOUND)
    return (q, k, v, g, beta), h0, gate


class Clock:
    """Elapsed milliseconds of one call: CUDA events on a GPU, the host clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3


def slowest_median(clock: Clock, fn, reps: int, device: torch.device, active: bool = True) -> float:
    """Median over `reps` calls of the slowest rank's time (ranks with `active` False only wait)."""
    fn_or_wait = fn if active else (lambda: None)
    fn_or_wait()  # warm-up (compiles on the first shape)
    fn_or_wait()
    times = torch.zeros(reps, dtype=torch.float64, device=device)
    for i in range(reps):
        dist.barrier()
        times[i] = clock(fn_or_wait)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return statistics.median(times.tolist())


def rel(x: torch.Tensor, r: torch.Tensor) -> float:
    return ((x.double().cpu() - r).norm() / r.norm()).item()


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    clock = Clock(device)
    rows = []

    for T, H in shape_list(args.shapes):
        x, h0, gate = inputs(T, H, device)
        bounds = kda.distributed.split_tokens(T, world)
        lo, hi = bounds[rank], bounds[rank + 1]
        local_x = tuple(t[:, lo:hi].contiguous() for t in x)
        one = slowest_median(clock, functools.partial(kda.chunk_kda, *x, None, h0, True, **gate), args.reps,
                             device, active=rank == 0)
        many = slowest_median(clock, functools.partial(kda.distributed.chunk_kda, *local_x, None, h0, True, **gate),
                              args.reps, device)
        rows.append(dict(T=T, H=H, world=world, one_ms=one, many_ms=many, speedup=one / many))
        del x, local_x
        if device.type == "cuda":
            torch.cuda.empty_cache()

    check = None
    if args.check:
        (T, H), = shape_list(args.check)
        x, h0, gate = inputs(T, H, device)
        bounds = kda.distributed.split_tokens(T, world)
        o_one, s_one = kda.chunk_kda(*x, None, h0, True, **gate)
        lo, hi = bounds[rank], bounds[rank + 1]
        o_loc, s_many = kda.distributed.chunk_kda(*(t[:, lo:hi].contiguous() for t in x), None, h0, True, **gate)
        # gather the output slices (padded to the longest: collectives take equal shapes)
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        pad = o_loc.new_zeros((1, longest, *o_loc.shape[2:]))
        pad[:, : o_loc.shape[1]] = o_loc
        padded = [torch.empty_like(pad) for _ in range(world)]
        dist.all_gather(padded, pad)
        parts = [p[:, : b - a] for p, a, b in zip(padded, bounds[:-1], bounds[1:])]
        dist.all_reduce(s_many)  # only the last rank holds the final state
        if rank == 0:
            cpu = {n: (v.double().cpu() if isinstance(v, torch.Tensor) else v) for n, v in gate.items()}
            ro, rs = ref.chunk_kda(*(t.double().cpu() for t in x), None, h0.double().cpu(), True,
                                   allow_float64=True, **cpu)
            o_many = torch.cat(parts, dim=1)
            check = dict(T=T, H=H, world=world, o_one=rel(o_one, ro), o_many=rel(o_many, ro),
                         s_one=rel(s_one, rs), s_many=rel(s_many, rs))
            check["o_ratio"] = check["o_many"] / check["o_one"]
            check["s_ratio"] = check["s_many"] / check["s_one"]

    if rank == 0:
        print(f"| shape | one device ms | {world} ranks ms | speedup |\n|---|---|---|---|")
        for r in rows:
            print(f"| 1x{r['T']} H={r['H']} | {r['one_ms']:.3f} | {r['many_ms']:.3f} | {r['speedup']:.2f} |")
        if check:
            print(f"\naccuracy at 1x{check['T']} H={check['H']} against the float64 oracle: output "
                  f"{check['o_one']:.3e} (one device) / {check['o_many']:.3e} ({world} ranks) = "
                  f"{check['o_ratio']:.2f}; final state {check['s_one']:.3e} / {check['s_many']:.3e} = "
                  f"{check['s_ratio']:.2f}")
        if args.json:
            args.json.write_text(json.dumps(dict(rows=rows, check=check), indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
