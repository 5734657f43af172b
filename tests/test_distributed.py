"""`kda.distributed.chunk_kda` (context-parallel prefill) against the float64 oracle of the whole token axis.

Each test spawns a gloo process group of 2 or 4 CPU processes (the Triton interpreter, tiny shapes) that
runs every case of its world size; each rank saves its local outputs, final states and pool, and this
process compares them with `kda_reference.chunk_kda` on the global inputs: fp32 inputs within 1e-5
relative L2 (the single-device bound of tests/test_chunk.py), per sequence. The cases cover one sequence
crossing every rank (pass-through ranks, an empty rank: the identity transfer), several sequences with
empty ones (at rank boundaries and at the end, one owned by a last rank without tokens), sequences ending
exactly at a boundary, ranks holding no token of a sequence, dense and paged initial states (both
layouts, a padding slot that crosses ranks, `has_initial_state` false), the Kimi lower-bound gate in the
kernel, GVA (HV = 2H), the dense (trainer) split (ranks without tokens in the middle and at the end), and
the two forms of the continued pass (`fuse_identity`). Pools are poisoned: a slot no rank writes keeps
its bits on every rank, and only the rank ending a sequence writes its slot. About a minute on 2 cores."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
from helpers import bits, make_inputs, poison_pool, rel_err

import kda_reference as ref

FP32_TOL = 1e-5
H, K, V = 2, 16, 16

# name: (world, cu_seqlens or None (dense: B rows of T), T, rank_bounds, HV, gate, l2norm, state, fuse_identity)
#   state: "none", "kfirst"/"vfirst" (dense initial_state), "paged_kfirst"/"paged_vfirst" (a poisoned pool)
CASES = {
    # one sequence across both ranks, even split; Kimi's gate and l2norm in the kernel, GVA, dense K-first state
    "long": (2, [0, 160], 160, None, 2 * H, "lower_bound", True, "kfirst", None),
    # the same sequence with the continued pass as two launches (v, then the identity)
    "long-unfused": (2, [0, 160], 160, None, 2 * H, "lower_bound", True, "kfirst", False),
    # five sequences: inside rank 0, empty, across the boundary, a padding one, one ending the axis; V-first pool
    "varlen": (2, [0, 50, 50, 130, 150, 230], 230, [0, 100, 230], 2 * H, "logdecay", False, "paged_vfirst", None),
    # the trainer's split: B = 2 rows cut in time at uneven points, V-first dense state
    "dense": (2, None, 120, [0, 70, 120], H, "lower_bound", True, "vfirst", None),
    # the last rank holds no token but owns the empty sequence at the end of the axis
    "empty-last-rank": (2, [0, 40, 100, 100], 100, [0, 100, 100], H, "logdecay", False, "kfirst", None),
    # one sequence over four ranks, the third holding no token (identity transfer), the second passing through
    "long4": (4, [0, 240], 240, [0, 50, 110, 110, 240], 2 * H, "lower_bound", True, "kfirst", None),
    # the dense split with ranks holding no token: one in the middle (identity), the last (it writes the states)
    "dense4": (4, None, 100, [0, 40, 100, 100, 100], 2 * H, "lower_bound", True, "kfirst", None),
    # seven sequences over an even split: empty ones at a boundary and at the end, one ending at a boundary,
    # a padding sequence crossing a boundary, has_initial_state false; K-first pool
    "varlen4": (4, [0, 30, 30, 90, 150, 150, 200, 200], 200, None, 2 * H, "lower_bound", True, "paged_kfirst", None),
}
SLOTS = 9
PADDING = {"varlen": 3, "varlen4": 2}  # the padding sequence of each paged case
NO_INITIAL = {"varlen": [1], "varlen4": [5]}  # has_initial_state false


def case_inputs(name: str) -> dict:
    """The global inputs of a case, the same on every rank and here (seeded)."""
    world, cu, T, rank_bounds, HV, gate, l2, state, _ = CASES[name]
    B = 1 if cu is not None else 2
    seed = sum(map(ord, name))
    q, k, v, g, beta, kw = make_inputs(B, T, H, HV, K, V, gate=gate, seed=seed, normalize_k=not l2)
    kw["use_qk_l2norm_in_kernel"] = l2
    N = B if cu is None else len(cu) - 1
    gen = torch.Generator().manual_seed(seed + 1)
    vf = state.endswith("vfirst")
    plane = (HV, V, K) if vf else (HV, K, V)
    if cu is not None:
        kw.update(cu_seqlens=torch.tensor(cu, dtype=torch.int32), cu_seqlens_cpu=torch.tensor(cu))
    if state in ("kfirst", "vfirst"):
        kw.update(initial_state=torch.randn(N, *plane, generator=gen), state_v_first=vf, output_final_state=True)
    elif state.startswith("paged"):
        pool = poison_pool(SLOTS, plane, torch.float32, "cpu")
        slots = torch.randperm(SLOTS, generator=gen)[:N].to(torch.int32)
        slots[PADDING[name]] = -1
        has = torch.ones(N, dtype=torch.bool)
        has[NO_INITIAL[name]] = False
        for n in range(N):
            if slots[n] >= 0 and has[n]:
                pool[slots[n]] = torch.randn(plane, generator=gen)
        kw.update(state_cache=pool, state_indices=slots, has_initial_state=has, state_v_first=vf)
    return dict(q=q, k=k, v=v, g=g, beta=beta, kw=kw, rank_bounds=rank_bounds, B=B, T=T, N=N)


def _rank_bounds(x: dict, world: int) -> list[int]:
    from kda.distributed import split_tokens

    return x["rank_bounds"] or split_tokens(x["T"], world)


def _worker(rank: int, world: int, init_file: str, out_dir: str, names: list[str]) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # before kda imports triton's kernels: CPU tensors, gloo
    import warnings

    import torch.distributed as dist

    import kda.distributed

    warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)  # masked-off interpreter lanes
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for name in names:
            x = case_inputs(name)
            R = _rank_bounds(x, world)
            lo, hi = R[rank], R[rank + 1]
            local = [t[:, lo:hi].contiguous() for t in (x["q"], x["k"], x["v"], x["g"], x["beta"])]
            kw = dict(x["kw"])
            kernel_kw = dict(use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, use_gate_in_kernel=False,
                             A_log=None, dt_bias=None, lower_bound=None)
            kernel_kw.update({n: kw.pop(n) for n in list(kernel_kw) if n in kw})
            call = dict(initial_state=None, output_final_state=False, cu_seqlens=None, cu_seqlens_cpu=None,
                        state_v_first=None, state_cache=None, state_indices=None, has_initial_state=None)
            call.update(kw)
            o, final = kda.distributed._chunk_kda(
                *local, None, call.pop("initial_state"), call.pop("output_final_state"), group=None,
                rank_bounds=x["rank_bounds"], kernel_kw=kernel_kw, state_dtype=None, out=None,
                fuse_identity=CASES[name][-1], **call)
            torch.save(dict(o=o, final=final, pool=x["kw"].get("state_cache")), Path(out_dir) / f"{name}-{rank}.pt")
        if world == 2:
            _debug_calls(rank, Path(out_dir))
    finally:
        dist.destroy_process_group()


def _debug_calls(rank: int, out_dir: Path) -> None:
    """Under KDA_DEBUG: a good call, ranks that disagree on the bounds, and a rank that fails its own checks;
    every rank records what it raised (without KDA_DEBUG the last would leave rank 0 waiting)."""
    import kda.distributed

    q, k, v, g, beta, _ = make_inputs(1, 20, H, H, K, V, seed=3)
    lo, hi = 10 * rank, 10 * rank + 10
    local = [t[:, lo:hi].contiguous() for t in (q, k, v, g, beta)]
    one = dict(cu_seqlens=torch.tensor([0, 20], dtype=torch.int32), cu_seqlens_cpu=[0, 20])
    two = dict(cu_seqlens=torch.tensor([0, 5, 20], dtype=torch.int32), cu_seqlens_cpu=[0, 5, 20])
    raised = {}
    os.environ["KDA_DEBUG"] = "1"
    try:
        for what, args, kw in (("good", local, one), ("disagree", local, one if rank == 0 else two),
                               ("rank 1 fails", [t[:, :9] for t in local] if rank == 1 else local, one)):
            try:
                o, _ = kda.distributed.chunk_kda(*args, **kw)
                raised[what] = None
                if what == "good":
                    raised["good-o"] = o
            except ValueError as e:
                raised[what] = str(e)
    finally:
        del os.environ["KDA_DEBUG"]
    torch.save(raised, out_dir / f"debug-{rank}.pt")


def _oracle(name: str):
    x = case_inputs(name)
    kw = dict(x["kw"])
    pool = kw.get("state_cache")
    if pool is not None:
        kw["state_cache"] = pool.double()  # the exact final state; slots keep NaN/1e30 where unwritten
    o, final = ref.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], allow_float64=True, **kw)
    return x, o, final, kw.get("state_cache")


def _check_case(name: str, world: int, out_dir: Path) -> None:
    from kda.distributed import state_owners

    x, ro, rfinal, rpool = _oracle(name)
    R = _rank_bounds(x, world)
    res = [torch.load(out_dir / f"{name}-{r}.pt") for r in range(world)]
    o = torch.cat([r["o"] for r in res], dim=1)
    assert o.shape == ro.shape and o.dtype == torch.float32, name
    cu = CASES[name][1]
    spans = [(b, 0, x["T"]) for b in range(x["B"])] if cu is None else [(0, s, e) for s, e in zip(cu, cu[1:])]
    for n, (b, s, e) in enumerate(spans):
        if e > s:
            assert rel_err(o[b, s:e], ro[b, s:e]) < FP32_TOL, (name, "output", n)
    if cu is None:
        readers, writers = [0] * x["B"], [world - 1] * x["B"]
    else:
        readers, writers = state_owners(cu, R)
    if rfinal is not None:
        for r, got in enumerate(res):
            assert got["final"].shape == rfinal.shape and got["final"].dtype == torch.float32, name
            for n in range(x["N"]):
                if writers[n] == r:
                    assert rel_err(got["final"][n], rfinal[n]) < FP32_TOL, (name, "final state", n, r)
                else:
                    assert not got["final"][n].any(), (name, "final state row of another rank", n, r)
    if rpool is not None:
        before = x["kw"]["state_cache"]
        idx = x["kw"]["state_indices"].tolist()
        for r, got in enumerate(res):
            mine = {idx[n] for n in range(x["N"]) if writers[n] == r and idx[n] >= 0}
            for slot in range(SLOTS):
                if slot in mine:
                    assert rel_err(got["pool"][slot], rpool[slot]) < FP32_TOL, (name, "slot", slot, r)
                else:  # never written by this rank: the poison (or the initial state) keeps its bits
                    assert torch.equal(bits(got["pool"][slot]), bits(before[slot])), (name, "untouched slot", slot, r)
        b, s, e = spans[PADDING[name]]
        assert not o[b, s:e].any(), (name, "padding rows")


# The spawned ranks run the kernels in Triton's interpreter on CPU tensors (gloo). On a CUDA machine the
# installed Triton (3.6 there) has an interpreter that rejects the walk's tensor loop bounds, which the
# CPU machines' 3.9 runs; the GPU side of context parallelism is the two-GPU (NCCL) benchmark.
CPU_RANKS = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU ranks under the interpreter (see above)")


@CPU_RANKS
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_oracle(world, tmp_path):
    import torch.multiprocessing as mp

    names = [n for n, c in CASES.items() if c[0] == world]
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), str(tmp_path), names), nprocs=world, join=True)
    for name in names:
        _check_case(name, world, tmp_path)
    if world == 2:
        got = [torch.load(tmp_path / f"debug-{r}.pt") for r in range(2)]
        q, k, v, g, beta, _ = make_inputs(1, 20, H, H, K, V, seed=3)
        ro, _ = ref.chunk_kda(q, k, v, g, beta)
        assert got[0]["good"] is None and got[1]["good"] is None
        assert rel_err(torch.cat([got[0]["good-o"], got[1]["good-o"]], dim=1), ro) < FP32_TOL
        assert all("disagree" in r["disagree"] for r in got)
        assert "q has T=9" in got[1]["rank 1 fails"] and "rank 1 failed its checks" in got[0]["rank 1 fails"]


def test_plan_invariants():
    """Host planning over random layouts (empty sequences and empty ranks included): every token is in one
    local part; each sequence is read by one rank and written by one (those of `state_owners`); a continued
    sequence's transfers chain from a "start" rank through "pass" ranks."""
    import random

    from kda.distributed import _owner, _varlen_plan, state_owners

    rnd = random.Random(0)
    for _ in range(300):
        world = rnd.randint(1, 5)
        lengths = [rnd.choice([0, 0, 1, 5, 30, 70]) for _ in range(rnd.randint(1, 6))]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        R = sorted([0, cu[-1]] + [rnd.randint(0, cu[-1]) for _ in range(world - 1)])
        plans = [_varlen_plan(cu, R, r) for r in range(world)]
        readers, writers = state_owners(cu, R)
        N = len(lengths)
        read, written, covered = [[] for _ in range(N)], [[] for _ in range(N)], [0] * N
        for r, p in enumerate(plans):
            lo, hi = R[r], R[r + 1]
            assert len(p.cont) <= 1 and p.L0 + sum(min(cu[n + 1], hi) - cu[n] for n in range(p.a, p.b)) == hi - lo
            for n in p.cont:
                covered[n] += p.L0
                if p.cont_ends:
                    written[n].append(r)
                assert plans[p.fold_from].kind == "start" and _owner(R, cu[n]) == p.fold_from
                assert all(plans[j].kind == "pass" for j in range(p.fold_from + 1, r))
            for n in range(p.a, p.b):
                read[n].append(r)
                covered[n] += min(cu[n + 1], hi) - cu[n]
                if n < p.b_end:
                    written[n].append(r)
        assert covered == lengths, (cu, R)
        assert read == [[r] for r in readers], (cu, R)
        assert written == [[r] for r in writers], (cu, R)


def test_split_and_owners():
    from kda.distributed import split_tokens, state_owners

    assert split_tokens(10, 4) == [0, 2, 5, 7, 10] and split_tokens(0, 2) == [0, 0, 0]
    # an empty sequence at a boundary belongs to the rank holding that token; one at the end to the last rank
    assert state_owners([0, 5, 5, 12, 12], [0, 5, 5, 12]) == ([0, 2, 2, 2], [0, 2, 2, 2])
    assert state_owners([0, 3, 10], [0, 4, 8, 10]) == ([0, 0], [0, 2])


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of this process alone (world size 1: no collective runs)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_one_rank_equals_chunk_kda(one_rank_group, device):
    """On a group of one rank the call is the single-device call, bit for bit: varlen with empty sequences
    and a paged pool (padding slot, has_initial_state false), then a dense batch with `out` and a dense
    initial state."""
    import kda
    import kda.distributed

    bounds = [0, 20, 20, 90, 100]
    q, k, v, g, beta, kw = make_inputs(1, 100, H, 2 * H, K, V, gate="lower_bound", seed=5, device=device)
    kw.update(cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device), cu_seqlens_cpu=bounds,
              use_qk_l2norm_in_kernel=True)
    pool = poison_pool(6, (2 * H, V, K), torch.float32, device)
    pool[4] = torch.randn(2 * H, V, K).to(device)
    paged = dict(state_cache=pool, state_indices=torch.tensor([4, 1, -1, 3], dtype=torch.int32, device=device),
                 has_initial_state=torch.tensor([True, False, True, False], device=device), state_v_first=True)
    before = pool.clone()
    o1, _ = kda.distributed.chunk_kda(q, k, v, g, beta, **kw, **paged)
    mine = pool.clone()
    pool.copy_(before)
    o0, _ = kda.chunk_kda(q, k, v, g, beta, **kw, **paged)
    assert torch.equal(bits(o1), bits(o0)) and torch.equal(bits(mine), bits(pool))

    q, k, v, g, beta, kw = make_inputs(2, 70, H, H, K, V, seed=6, device=device)
    h0 = torch.randn(2, H, K, V).to(device)
    out = torch.full_like(v, float("nan"))
    o1, s1 = kda.distributed.chunk_kda(q, k, v, g, beta, None, h0, True, out=out, **kw)
    o0, s0 = kda.chunk_kda(q, k, v, g, beta, None, h0, True, **kw)
    assert o1 is out and torch.equal(bits(o1), bits(o0)) and torch.equal(bits(s1), bits(s0))


def test_bad_arguments(one_rank_group, device):
    import kda.distributed

    q, k, v, g, beta, _ = make_inputs(1, 10, H, H, K, V, device=device)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):
        kda.distributed.chunk_kda(q, k, v, g, beta, cu_seqlens=cu)
    with pytest.raises(ValueError, match="rank_bounds"):
        kda.distributed.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=[0, 4, 10], rank_bounds=[0, 5, 10])
    with pytest.raises(ValueError, match="q has T=10"):
        kda.distributed.chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 12], dtype=torch.int32),
                                  cu_seqlens_cpu=[0, 4, 12])
    with pytest.raises(ValueError, match="output_final_state"):  # the single-device contract, checked as there
        kda.distributed.chunk_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=[0, 4, 10],
                                  state_cache=torch.zeros(2, H, K, V, device=device), state_v_first=False,
                                  state_indices=torch.tensor([0, 1], dtype=torch.int32, device=device),
                                  has_initial_state=torch.ones(2, dtype=torch.bool, device=device))


def test_needs_a_process_group(device):
    import torch.distributed as dist

    import kda.distributed

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    q, k, v, g, beta, _ = make_inputs(1, 10, H, H, K, V, device=device)
    with pytest.raises(RuntimeError, match="process group"):
        kda.distributed.chunk_kda(q, k, v, g, beta)
