"""Context-parallel prefill with `kda.distributed.chunk_kda`, checked against the float64 oracle.

Run one process per rank with torchrun (docs/distributed.md):

    torchrun --standalone --nproc-per-node 2 examples/cp_prefill.py            # GPUs (NCCL), else CPU (gloo)
    torchrun --standalone --nproc-per-node 4 examples/cp_prefill.py --device cpu

Two calls, as an engine and a trainer make them:

- serving: a varlen batch of prompts (one long prompt crossing every rank, short ones inside a rank, an
  empty one) on the packed token axis, split evenly over the ranks; every rank holds its own paged pool
  (V-first planes, vLLM's layout). The rank holding a prompt's first token reads its slot, the rank holding
  its last token writes it (`kda.distributed.state_owners`);
- training: a dense batch of B rows, each rank holding one time slice of every row, with a dense initial
  state; the final states come back on the last rank, replicated here with one `all_reduce` (the other
  ranks return zero rows).

Every rank compares its outputs and the states it wrote with `kda_reference.chunk_kda` (float64, on the
CPU) of the whole batch: fp32 inputs within 1e-5 relative L2. Exit status 1 when a rank is out of
tolerance. On CPU the Triton kernels run in the interpreter (tiny shapes, about half a minute).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

# NVLink multicast stays off: only plain collectives are used (set before NCCL starts)
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

TOL = 1e-5


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=None, help="total tokens of the serving batch")
    return p.parse_args(argv)


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double().cpu(), y.double().cpu()
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def say(line: str) -> None:
    """One line in one write: the ranks share stdout, and a line written in pieces can interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before kda imports its kernels
        warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)  # masked interpreter lanes
    import torch.distributed as dist

    import kda.distributed
    import kda_reference as ref

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=device)
        H, HV, K, V = 4, 8, 128, 128
        total = args.tokens or 4096
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        H, HV, K, V = 2, 4, 16, 16
        total = args.tokens or 48 * world
    gen = torch.Generator().manual_seed(0)  # the same global inputs on every rank
    failures = 0

    # ---- serving: a varlen batch, paged pools -------------------------------------------------------------
    lengths = [total // 8, 0, total // 2, total - total // 8 - total // 2 - total // 16, total // 16]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    N, T = len(lengths), bounds[-1]
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = torch.randn(1, T, HV, K, generator=gen)  # the raw gate input: Kimi's lower-bound gate in the kernel
    beta = torch.rand(1, T, HV, generator=gen)
    gate = dict(use_gate_in_kernel=True, A_log=torch.randn(HV, generator=gen) * 0.5,
                dt_bias=torch.randn(HV * K, generator=gen) * 0.5, lower_bound=-5.0, use_qk_l2norm_in_kernel=True)
    slots = torch.tensor([3, 0, 5, 1, 2], dtype=torch.int32)  # each prompt's pool slot
    has_initial = torch.tensor([True, False, True, False, True])  # prompts continuing a cached prefix
    pool0 = torch.randn(6, HV, V, K, generator=gen)  # every rank's pool starts the same

    rank_bounds = kda.distributed.split_tokens(T, world)
    lo, hi = rank_bounds[rank], rank_bounds[rank + 1]
    readers, writers = kda.distributed.state_owners(bounds, rank_bounds)

    def local(x):  # this rank's token slice, as its own tensor on its device
        return x[:, lo:hi].contiguous().to(device)

    pool = pool0.clone().to(device)  # this rank's pool
    o, _ = kda.distributed.chunk_kda(
        local(q), local(k), local(v), local(g), local(beta), state_cache=pool, state_v_first=True,
        state_indices=slots.to(device), has_initial_state=has_initial.to(device),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device), cu_seqlens_cpu=bounds,
        **{n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in gate.items()})

    ref_pool = pool0.double()
    ro, _ = ref.chunk_kda(q, k, v, g, beta, state_cache=ref_pool, state_v_first=True, state_indices=slots,
                         has_initial_state=has_initial, cu_seqlens=torch.tensor(bounds), allow_float64=True, **gate)
    err_o = rel(o, ro[:, lo:hi]) if hi > lo else 0.0
    mine = [n for n in range(N) if writers[n] == rank]
    err_s = max([rel(pool[slots[n]], ref_pool[slots[n]]) for n in mine], default=0.0)
    untouched = all(torch.equal(pool[s].cpu(), pool0[s]) for s in range(6) if s not in slots[mine].tolist())
    ok = err_o < TOL and err_s < TOL and untouched
    failures += not ok
    say(f"rank {rank}: serving  tokens [{lo}, {hi}) of {T}, reads {[n for n in range(N) if readers[n] == rank]} "
        f"writes {mine}: output {err_o:.1e}, written slots {err_s:.1e}, other slots untouched {untouched}  "
        f"{'ok' if ok else 'FAIL'}")

    # ---- training: a dense batch cut in time, dense initial state ----------------------------------------
    B, Tt = 2, total // 2
    x = [torch.randn(B, Tt, H, K, generator=gen), torch.randn(B, Tt, H, K, generator=gen),
         torch.randn(B, Tt, HV, V, generator=gen), -0.5 * torch.rand(B, Tt, HV, K, generator=gen),
         torch.rand(B, Tt, HV, generator=gen)]
    h0 = torch.randn(B, HV, K, V, generator=gen)
    t_bounds = kda.distributed.split_tokens(Tt, world)
    tl, th = t_bounds[rank], t_bounds[rank + 1]
    o, final = kda.distributed.chunk_kda(*(t[:, tl:th].contiguous().to(device) for t in x), None, h0.to(device),
                                         True, use_qk_l2norm_in_kernel=True)
    dist.all_reduce(final)  # only the last rank holds non-zero rows: the sum replicates them
    ro, rfinal = ref.chunk_kda(*x, None, h0, True, use_qk_l2norm_in_kernel=True)
    err_o = rel(o, ro[:, tl:th]) if th > tl else 0.0
    err_s = rel(final, rfinal)
    ok = err_o < TOL and err_s < TOL
    failures += not ok
    say(f"rank {rank}: training time [{tl}, {th}) of {Tt} x {B} rows: output {err_o:.1e}, final state "
        f"{err_s:.1e}  {'ok' if ok else 'FAIL'}")

    total_failures = torch.tensor([failures], device=device)
    dist.all_reduce(total_failures)
    if rank == 0:
        say("all ranks within tolerance" if not total_failures.item() else "out of tolerance")
    dist.destroy_process_group()
    return 1 if total_failures.item() else 0


if __name__ == "__main__":
    sys.exit(main())
