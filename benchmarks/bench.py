"""Benchmark `kda` against fla 0.6.0, side by side in one run (needs a CUDA device; fla when importable).

    python benchmarks/bench.py [--shapes prefill,decode,mixed,varlen|all] [--out FILE.md] [--json FILE.json]
                               [--no-fla] [--no-fla-varlen] [--plan-device sm_80]

It lives outside the package because it needs fla. Every row times a call eagerly (a plain Python call,
host overhead included) and as CUDA-graph replay (capture after warm-up, time `graph.replay`), both with
`triton.testing.do_bench` and its median, and the host cost of one call (200 calls issued back to back
without a sync, `time.perf_counter` around them, one sync after; the mean per call, the best of 3 such
loops: the host is shared). Inputs: q, k, v bf16
random, K = V = 128, raw fp32 gate with the in-kernel lower-bound gate (lb = -5, `A_log` and `dt_bias`
given), in-kernel q/k L2 norm and beta sigmoid, fp32 state. Nothing is timed on zeros.

Rows, in the order they run (the varlen row last: fla autotunes at a new varlen shape, once over 100 s):
- `prefill BxT H=h`: dense `initial_state` [N, HV, K, V] + `output_final_state=True`; fla `chunk_kda`.
- `prefill BxT H=h paged`: kda's paged contract (`state_cache` [4N, HV, V, K] fp32, random distinct
  slots, `has_initial_state` all true, `state_v_first=True`). fla has no paged prefill: its columns time
  what serving engines do around it (gather the slots, call with `state_v_first=True`, scatter back).
- `decode N=n ...`: one token per sequence through a paged pool of 4N slots: V-first pools
  ([slots, HV, V, K], `state_v_first=True`) in fp32 at N = 1, 64, 256, 1024 and bf16 / fp16 at N = 256;
  K-first pools ([slots, HV, K, V], `state_v_first=False`, fla's native layout) in fp32 at N = 64, 256,
  1024 and bf16 at N = 256, each called as a dense [N, 1] batch and as varlen (`cu_seqlens` +
  `cu_seqlens_cpu`). fla: `fused_recurrent_kda_fwd(initial_state=pool, inplace_final_state=True,
  ssm_state_indices=idx)` with the same `state_v_first` on the same pool. Decode rows are also timed in
  steady state (`Timer.steady`, a second table): 8 calls back to back in one graph, cycling over 4
  disjoint slot sets of the pool, after an L2 flush that only reads. A single replay of one ~25 us call
  also times the graph launch (about 3 us on the H200) and, through do_bench's zeroing L2 flush, the
  write-back of someone else's dirty lines, neither of which is the call's own HBM traffic. Both are
  printed.
- `mixed 256x1 + 2x2048 H=32`: a serving step of 256 one-token decode sequences and two 2048-token
  prefill chunks over one paged fp32 V-first pool of 4N slots: one `chunk_kda` varlen call, against the
  split pair (`fused_recurrent_kda` on the one-token sequences with `cu_seqlens_cpu`, then `chunk_kda` on
  the two long ones, both on views of the same token tensors), against fla's `chunk_kda` on the same
  varlen batch with a dense state (fla has no paged prefill). Graph replay, eager and host cost.
- `varlen ...`: 12 single-token sequences then 1100, 1300 and 900 tokens, H=32, dense initial state,
  `cu_seqlens` int64 on the device (no host copy passed to either library). `--no-fla-varlen` skips fla.

The HBM floor of a row is the bytes that must move (q, k, v, o in bf16, g in fp32, beta, the state read
and written once in its dtype) over the copy bandwidth measured at the start of the run (a large
device-to-device copy, bytes read plus bytes written); the last floor column uses 4.25 TB/s, the copy
bandwidth measured on the H200 when the targets were set.

Before timing, each row runs kda and fla once on identical inputs and reports the relative L2 difference
of the outputs and of the final states (a check that both compute the same function).

A graph is captured only if one eager call after warm-up makes no host sync
(`torch.cuda.set_sync_debug_mode("error")`); otherwise the graph cell says why. Every failure is caught
per cell and reported under the table; the run goes on. The markdown (`--out`) and the JSON of the rows
(`--json`, default `benchmarks/results/h200-latest.json`) are rewritten after every row, so a run stopped
early keeps the rows it finished.

`--plan-device sm_80` plans every kda call as on an A100 (`kda.plan.plan_as`: capability 8.0, 163 KiB of shared
memory a block, the GPU's own SM count: no TMA, no walk beside the prepare, no PDL), the kernels still compiled for
the GPU at hand; the header says which plan ran, every JSON row carries it (`plan_device`), and the default JSON is
then `benchmarks/results/h200-sm_80-plan-latest.json`, so the Hopper plan's rows stay where they are.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import subprocess
import sys
import time
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `kda` from this tree, also when run as `python benchmarks/bench.py`

from kda.plan import PLAN_DEVICES  # noqa: E402  (`--plan-device NAME`: the GPU planned as this device)

K_DIM = 128
V_DIM = 128
LOWER_BOUND = -5.0
ANCHOR_BW = 4.25e12  # bytes/s, the H200's copy bandwidth measured when the targets were set
RESULTS = Path(__file__).resolve().parent / "results"
GROUPS = ("prefill", "decode", "mixed", "varlen")  # the order rows run in: varlen last (fla's autotuning)
# (B, T, H): the prefill rows, in the order they run
PREFILL_SHAPES = ((1, 4096, 12), (1, 16384, 12), (1, 4096, 32), (1, 16384, 32), (4, 4096, 32), (1, 8192, 96),
                  (1, 65536, 12))
VARLEN_LENS = (1,) * 12 + (1100, 1300, 900)
VARLEN_H = 32
MIXED_LENS = (1,) * 256 + (2048, 2048)
MIXED_H = 32
MIXED_TARGET = 1.10  # the unified call at most 10% slower than the split pair
DECODE_H = 12
DECODE_NS = (1, 64, 256, 1024)
K_FIRST_NS = (64, 256, 1024)
HOST_CALLS = 200
# Timer.host: the best of this many loops of HOST_CALLS calls (the H200 host's speed moves by up to 1.6x between
# consecutive loops of one process: benchmarks/results/2026-12-02-b1a4e00-h200-late-walk-tail-suite.md)
HOST_ROUNDS = 8
NARROW_POOL_N = 256
NARROW_POOL_NS = (64, 256, 1024)  # the 2-byte pools' rows, both layouts, beside the fp32 pool of the same N
NARROW_POOL_TARGET = 0.6
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


# --------------------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    name: str
    group: str              # prefill | decode | mixed | varlen (the JSON's "kind")
    mode: str               # dense | paged | decode | mixed
    B: int
    T: int
    H: int
    seqlens: tuple[int, ...] | None = None
    pool_dtype: str = "float32"
    v_first: bool = True    # the pool's layout (paged, decode and mixed rows)
    host_bounds: bool = True  # decode varlen rows: cu_seqlens_cpu passed too (engines' usual call)

    @property
    def N(self) -> int:
        return len(self.seqlens) if self.seqlens is not None else self.B


def all_cases() -> list[Case]:
    cases = []
    for B, T, H in PREFILL_SHAPES:
        label = f"prefill {B}x{T} H={H}"
        cases.append(Case(label, "prefill", "dense", B, T, H))
        cases.append(Case(label + " paged", "prefill", "paged", B, T, H))
    for n in DECODE_NS:
        cases.append(Case(f"decode N={n} H={DECODE_H} fp32 pool", "decode", "decode", n, 1, DECODE_H))
    for n in NARROW_POOL_NS:  # 2-byte pools, both layouts (the K-first ones below)
        for dt in ("bfloat16", "float16"):
            cases.append(Case(f"decode N={n} H={DECODE_H} {DTYPE_SHORT[dt]} pool", "decode", "decode", n, 1,
                              DECODE_H, pool_dtype=dt))
    k_first = [(n, dt) for n in K_FIRST_NS for dt in ("float32", "bfloat16", "float16")]
    for n, dt in k_first:
        label = f"decode N={n} H={DECODE_H} {DTYPE_SHORT[dt]} K-first pool"
        cases.append(Case(label, "decode", "decode", n, 1, DECODE_H, pool_dtype=dt, v_first=False))
        if dt == "float32" or (n, dt) == (NARROW_POOL_N, "bfloat16"):  # the varlen form of the same steps
            cases.append(Case(label + " varlen", "decode", "decode", 1, n, DECODE_H, seqlens=(1,) * n,
                              pool_dtype=dt, v_first=False))
    # the contract without host bounds (the loop kernel: the lengths are on the device only)
    cases.append(Case(f"decode N={NARROW_POOL_N} H={DECODE_H} fp32 K-first pool varlen no host bounds", "decode",
                      "decode", 1, NARROW_POOL_N, DECODE_H, seqlens=(1,) * NARROW_POOL_N, v_first=False,
                      host_bounds=False))
    long = [n for n in MIXED_LENS if n != 1]
    cases.append(Case(f"mixed {MIXED_LENS.count(1)}x1 + {len(long)}x{long[0]} H={MIXED_H}", "mixed", "mixed", 1,
                      sum(MIXED_LENS), MIXED_H, seqlens=MIXED_LENS))
    n1 = VARLEN_LENS.count(1)
    rest = " + ".join(str(n) for n in VARLEN_LENS if n != 1)
    cases.append(Case(f"varlen {n1}x1 + {rest} H={VARLEN_H}", "varlen", "dense", 1, sum(VARLEN_LENS), VARLEN_H,
                      seqlens=VARLEN_LENS))
    return cases


def floor_bytes(case: Case) -> int:
    """Bytes that must move: q, k, v, o (bf16), g (fp32), beta (bf16), A_log + dt_bias (fp32), the state
    of every sequence read once and written once in its dtype, and the slot indices (decode)."""
    H = HV = case.H
    ntok = case.B * case.T
    per_tok = 2 * (H * K_DIM * 2) + 2 * (HV * V_DIM * 2) + HV * K_DIM * 4 + HV * 2
    state = 2 * case.N * HV * K_DIM * V_DIM * DTYPES[case.pool_dtype].itemsize
    params = HV * 4 + HV * K_DIM * 4
    idx = case.N * 4 if case.mode in ("paged", "decode", "mixed") else 0
    return ntok * per_tok + state + params + idx


# --------------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------------

class HostSync(RuntimeError):
    pass


@dataclass
class Timer:
    warmup_ms: int
    rep_ms: int

    def bench(self, fn) -> float:
        """Median of triton.testing.do_bench, in microseconds."""
        from triton.testing import do_bench

        return do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median") * 1e3

    def eager(self, fn) -> float:
        fn()
        torch.cuda.synchronize()
        return self.bench(fn)

    def host(self, fn, calls: int = HOST_CALLS, rounds: int = HOST_ROUNDS) -> tuple[float, float]:
        """Host microseconds of one call issued back to back: `calls` calls after warm-up with no sync
        inside the loop (`time.perf_counter` around it), one sync after; the best of `rounds` such loops (the
        host is shared: another tenant only adds time). What a serving engine pays in Python per layer per
        step while the GPU runs behind; a call whose launches fill the device's launch queue within the loop
        reads its GPU time instead. Why not bursts between syncs: docs/performance.md, "Host cost per call".
        Returns (wall, cpu): cpu is the same loops' CPU time of this thread (`time.thread_time`), which
        another tenant's preemption of the shared host does not add to."""
        for _ in range(3):
            fn()
        best = best_cpu = float("inf")
        for _ in range(rounds):
            torch.cuda.synchronize()
            c0, t0 = time.thread_time(), time.perf_counter()
            for _ in range(calls):
                fn()
            t1, c1 = time.perf_counter(), time.thread_time()
            best = min(best, (t1 - t0) * 1e6 / calls)
            best_cpu = min(best_cpu, (c1 - c0) * 1e6 / calls)
        torch.cuda.synchronize()
        return best, best_cpu

    def steady(self, fns, repeat: int = 2) -> float:
        """Per-call time of back-to-back calls: one graph holds `fns` `repeat` times in a row (decode: one
        call per disjoint slot set of the pool, so no call finds its state in L2 from the call before),
        each replay follows an L2 flush that only reads (a sum over 256 MB: the cache holds clean lines, and
        the timed calls write back no bytes of the flush, unlike do_bench's zeroing flush); events around
        the replay, median over the replays, divided by the calls in the graph. This is a serving step's
        view (many layers' decode calls back to back in one graph, the launch cost shared); each call pays
        the write-back of the states that the call before it wrote."""
        calls = list(fns) * repeat
        graph = capture_graph(calls)
        try:
            return time_replays(graph, read_only_flush(), len(calls), min_reps=20, budget_s=self.rep_ms / 1e3)
        finally:
            del graph
            torch.cuda.synchronize()

    def graph(self, fn) -> float:
        # the call must not read device memory back to the host, or capture would fail (and may leave the
        # context in a bad state): check one eager call with sync debugging first
        fn()
        torch.cuda.synchronize()
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        except RuntimeError as e:
            if "synchroniz" not in str(e).lower():
                raise
            raise HostSync(f"not captured: the call syncs with the host ({_short(e, 160)})") from None
        finally:
            torch.cuda.set_sync_debug_mode(prev)
        torch.cuda.synchronize()
        graph = capture_graph([fn], warmup_rounds=2)
        try:
            return self.bench(graph.replay)
        finally:
            del graph
            torch.cuda.synchronize()


def capture_graph(calls, warmup_rounds: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` in order, captured after `warmup_rounds` rounds on a side stream, replayed
    once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_rounds):
            for f in calls:
                f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def read_only_flush(mb: int = 256):
    """A callable that evicts the L2 by reading `mb` MB (a sum into a scalar): it leaves clean lines, so a
    kernel timed after it writes back none of the flush's bytes."""
    buf = torch.ones(mb << 18, dtype=torch.float32, device="cuda")
    sink = torch.empty((), dtype=torch.float32, device="cuda")
    return lambda: torch.sum(buf, dim=0, out=sink)


def time_replays(graph, flush, div: int = 1, min_reps: int = 20, budget_s: float = 0.1, max_reps: int = 2000) -> float:
    """Median microseconds of `graph.replay()` / div, each replay after `flush()`, timed with events; at
    least `min_reps` replays, more while `budget_s` lasts."""
    times = []
    deadline = time.perf_counter() + budget_s
    while len(times) < min_reps or (time.perf_counter() < deadline and len(times) < max_reps):
        flush()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / div)
    times.sort()
    return times[len(times) // 2]


def measure_bandwidth(timer: Timer, gib: float) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = int(gib * (1 << 30)) // 4
    bufs = [torch.empty(n, dtype=torch.float32, device="cuda").normal_()]
    bufs.append(torch.empty_like(bufs[0]))
    t_us = timer.eager(lambda: bufs[1].copy_(bufs[0]))
    bufs.clear()
    torch.cuda.empty_cache()
    return 2 * n * 4 / (t_us * 1e-6)


# --------------------------------------------------------------------------------------------------------
# one row
# --------------------------------------------------------------------------------------------------------

@dataclass
class Row:
    case: Case
    floor_b: int
    kda_eager: float | str | None = None
    kda_graph: float | str | None = None
    fla_eager: float | str | None = None
    fla_graph: float | str | None = None
    kda_steady: float | str | None = None  # decode rows: Timer.steady over 4 disjoint slot sets
    fla_steady: float | str | None = None
    kda_host: float | str | None = None    # Timer.host: host time of one call issued back to back
    fla_host: float | str | None = None
    kda_host_cpu: float | str | None = None  # the same loops' CPU time of the calling thread (Timer.host)
    fla_host_cpu: float | str | None = None
    split_host_cpu: float | str | None = None
    split_eager: float | str | None = None  # mixed row: the decode call + the prefill call
    split_graph: float | str | None = None
    split_host: float | str | None = None
    o_diff: float | str | None = None
    s_diff: float | str | None = None
    fla_safe_gate: bool = False  # fla's chunk_kda called with safe_gate=True (prefill, paged and mixed rows)
    notes: list[str] = field(default_factory=list)


def _short(e: BaseException, n: int = 300) -> str:
    msg = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
    msg = re.sub(r"\s+", " ", msg)
    return msg if len(msg) <= n else msg[: n - 3] + "..."


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _tokens(B: int, T: int, H: int, HV: int, dev: str):
    q = torch.randn(B, T, H, K_DIM, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, T, H, K_DIM, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, T, HV, V_DIM, device=dev, dtype=torch.bfloat16)
    g = torch.randn(B, T, HV, K_DIM, device=dev, dtype=torch.float32)
    beta = torch.randn(B, T, HV, device=dev, dtype=torch.bfloat16)
    A_log = torch.empty(HV, device=dev, dtype=torch.float32).uniform_(1.0, 16.0).log_()
    dt_bias = torch.randn(HV * K_DIM, device=dev, dtype=torch.float32) * 0.5
    return q, k, v, g, beta, A_log, dt_bias


def build(case: Case, fla, fla_extra: dict, dev: str = "cuda"):
    """Returns (calls, compare) for one case: calls maps "kda", "fla" and, for the mixed row, "split" (the
    decode call then the prefill call) to a zero-argument callable (fla's is None when fla is not run);
    compare() runs kda and fla once on identical inputs and states and returns (o rel diff, state rel
    diff)."""
    import kda

    H = HV = case.H
    q, k, v, g, beta, A_log, dt_bias = _tokens(case.B, case.T, H, HV, dev)
    flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                 A_log=A_log, dt_bias=dt_bias, lower_bound=LOWER_BOUND)
    cu, cu_host = None, None
    if case.seqlens is not None:
        cu_host = [0, *torch.tensor(case.seqlens).cumsum(0).tolist()]
        cu = torch.tensor(cu_host, dtype=torch.int64, device=dev)
    N = case.N
    fla_chunk, fla_decode = (fla if fla is not None else (None, None))

    if case.mode == "dense":
        h0 = torch.randn(N, HV, K_DIM, V_DIM, device=dev, dtype=torch.float32) * 0.1

        def kda_call():
            return kda.chunk_kda(q, k, v, g, beta, None, h0, True, cu_seqlens=cu, **flags)

        def fla_call():
            return fla_chunk(q, k, v, g, beta, scale=None, initial_state=h0, output_final_state=True,
                             cu_seqlens=cu, **flags, **fla_extra)

        def compare():
            o1, s1 = kda_call()
            o2, s2 = fla_call()
            return _rel(o1, o2), _rel(s1, s2)

        return {"kda": kda_call, "fla": fla_call if fla_chunk else None}, compare

    slots = 4 * N
    pool_dtype = DTYPES[case.pool_dtype]
    vf = case.v_first
    plane = (HV, V_DIM, K_DIM) if vf else (HV, K_DIM, V_DIM)
    pool0 = (torch.randn(slots, *plane, device=dev, dtype=torch.float32) * 0.1).to(pool_dtype)
    slot_sets = torch.randperm(slots, device=dev).to(torch.int32).view(4, N)  # 4 disjoint sets of N slots
    idx = slot_sets[0].clone()
    idx64 = idx.long()
    pool_k = pool0.clone()
    pool_f = pool0.clone()
    has_init = torch.ones(N, dtype=torch.bool, device=dev)
    calls = {}

    if case.mode == "paged":
        def kda_call():
            return kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, state_cache=pool_k, state_indices=idx,
                                 has_initial_state=has_init, state_v_first=vf, **flags)

        def fla_call():  # what an engine does around fla: gather, call, scatter
            h0 = pool_f.index_select(0, idx64)
            o, ht = fla_chunk(q, k, v, g, beta, scale=None, initial_state=h0, output_final_state=True,
                              state_v_first=vf, cu_seqlens=cu, **flags, **fla_extra)
            pool_f.index_copy_(0, idx64, ht.to(pool_f.dtype))
            return o, None

    elif case.mode == "mixed":  # one-token sequences first, then the long ones
        n1 = case.seqlens.count(1)
        t1 = n1
        cu_long_host = [c - t1 for c in cu_host[n1:]]
        cu_one = torch.arange(n1 + 1, dtype=torch.int64, device=dev)
        cu_long = torch.tensor(cu_long_host, dtype=torch.int64, device=dev)
        ids_one, ids_long = idx[:n1].clone(), idx[n1:].clone()
        has_long = has_init[n1:].clone()
        head = [x[:, :t1] for x in (q, k, v, g, beta)]
        tail = [x[:, t1:] for x in (q, k, v, g, beta)]

        def kda_call():
            return kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=cu_host, state_cache=pool_k,
                                 state_indices=idx, has_initial_state=has_init, state_v_first=vf, **flags)

        def split_call():
            o1, _ = kda.fused_recurrent_kda(*head, cu_seqlens=cu_one, cu_seqlens_cpu=list(range(n1 + 1)),
                                            state_cache=pool_k, state_indices=ids_one, state_v_first=vf, **flags)
            o2, _ = kda.chunk_kda(*tail, cu_seqlens=cu_long, cu_seqlens_cpu=cu_long_host, state_cache=pool_k,
                                  state_indices=ids_long, has_initial_state=has_long, state_v_first=vf, **flags)
            return o1, o2

        h0_fla = pool0.index_select(0, idx64).float()
        if vf:
            h0_fla = h0_fla.transpose(-1, -2).contiguous()  # fla's dense state: K-first [N, HV, K, V]

        def fla_call():
            return fla_chunk(q, k, v, g, beta, scale=None, initial_state=h0_fla, output_final_state=True,
                             cu_seqlens=cu, **flags, **fla_extra)

        calls["split"] = split_call

        def compare():
            pool_k.copy_(pool0)
            o1, _ = kda_call()
            s1 = pool_k.index_select(0, idx64).float()
            o2, s2 = fla_call()
            if vf:
                s1 = s1.transpose(-1, -2)
            return _rel(o1, o2), _rel(s1, s2)

        return {"kda": kda_call, "split": split_call, "fla": fla_call if fla_chunk else None}, compare

    else:  # decode: a dense [N, 1] batch, or varlen (B == 1, T == N) with the host copy of the bounds
        extra = {} if cu is None else dict(cu_seqlens=cu, cu_seqlens_cpu=cu_host if case.host_bounds else None)
        fla_cu = {} if cu is None else dict(cu_seqlens=cu)

        def kda_on(ix):
            return lambda: kda.fused_recurrent_kda(q, k, v, g, beta, state_cache=pool_k, state_indices=ix,
                                                   state_v_first=vf, **extra, **flags)

        def fla_on(ix):
            return lambda: fla_decode(q, k, v, g, beta, initial_state=pool_f, inplace_final_state=True,
                                      state_v_first=vf, ssm_state_indices=ix, **fla_cu, **flags)

        kda_call, fla_call = kda_on(idx), fla_on(idx)
        # the same call on each of the 4 disjoint slot sets, for Timer.steady
        kda_call.rotations = [kda_on(s.clone()) for s in slot_sets]
        fla_call.rotations = [fla_on(s.clone()) for s in slot_sets]

    def compare():
        pool_k.copy_(pool0)
        pool_f.copy_(pool0)
        o1, _ = kda_call()
        o2, _ = fla_call()
        return _rel(o1, o2), _rel(pool_k.index_select(0, idx64), pool_f.index_select(0, idx64))

    return {"kda": kda_call, "fla": fla_call if fla_chunk else None}, compare


def run_case(case: Case, timer: Timer, fla, fla_extra: dict, skip_fla: bool = False) -> Row:
    """Times every side of one row ("kda", "split" for the mixed row, "fla") eagerly, as graph replay, by
    host cost, and (decode) in steady state. Each cell's failure is caught and noted."""
    row = Row(case, floor_bytes(case), fla_safe_gate=bool(fla_extra.get("safe_gate")) and case.group != "decode")
    try:
        torch.manual_seed(zlib.crc32(case.name.encode()))
        calls, compare = build(case, fla, fla_extra)
    except Exception as e:  # noqa: BLE001 - a failed row is reported, the run goes on
        row.notes.append(f"inputs: {_short(e)}")
        for who in ("kda", "fla"):
            for how in ("eager", "graph", "host"):
                setattr(row, f"{who}_{how}", "err")
        return row
    if skip_fla:
        calls["fla"] = None
        row.notes.append("fla not run (--no-fla-varlen)")
    if calls["fla"] is None:
        row.fla_eager = row.fla_graph = row.fla_host = "n/a"
        row.o_diff = row.s_diff = "-"
    else:
        try:
            row.o_diff, row.s_diff = compare()
        except Exception as e:  # noqa: BLE001
            row.o_diff = row.s_diff = "err"
            row.notes.append(f"kda vs fla check: {_short(e)}")
            traceback.print_exc()
    for who, fn in calls.items():
        if fn is None:
            continue
        for how in ("eager", "graph", "host"):
            attr = f"{who}_{how}"
            try:
                value = getattr(timer, how)(fn)
                if how == "host":
                    value, cpu = value
                    setattr(row, f"{who}_host_cpu", cpu)
                setattr(row, attr, value)
            except HostSync as e:
                setattr(row, attr, "sync")
                row.notes.append(f"{who} graph: {e}")
            except Exception as e:  # noqa: BLE001
                setattr(row, attr, "err")
                row.notes.append(f"{who} {how}: {_short(e)}")
                traceback.print_exc()
            try:
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a sticky CUDA error: later rows will say so too
                row.notes.append(f"after {who} {how}: {_short(e)}")
        if hasattr(fn, "rotations"):
            try:
                setattr(row, f"{who}_steady", timer.steady(fn.rotations))
            except Exception as e:  # noqa: BLE001
                setattr(row, f"{who}_steady", "err")
                row.notes.append(f"{who} steady: {_short(e)}")
                traceback.print_exc()
    return row


def remeasure_host(rows: list[Row], timer: Timer, fla, fla_extra: dict, make=build) -> None:
    """The host column's second pass, after every row: each row's calls built again and timed by `timer.host`
    once more, the faster of the two passes kept (wall and CPU each). The host's speed drifts over seconds,
    so two samples minutes apart are likelier to find it at its usual speed than one row's consecutive loops.
    A row whose first pass failed, or whose rebuild or timing fails now, keeps its first values."""
    for row in rows:
        try:
            calls, _ = make(row.case, fla, fla_extra)
        except Exception:  # noqa: BLE001 - the first pass stands
            continue
        for who, fn in calls.items():
            first = getattr(row, f"{who}_host", None)
            if fn is None or not isinstance(first, float):
                continue
            try:
                wall, cpu = timer.host(fn)
            except Exception:  # noqa: BLE001
                continue
            setattr(row, f"{who}_host", min(first, wall))
            first_cpu = getattr(row, f"{who}_host_cpu", None)
            setattr(row, f"{who}_host_cpu", min(first_cpu, cpu) if isinstance(first_cpu, float) else cpu)
        del calls
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------------

def _fmt_us(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def _best(row: Row, who: str) -> tuple[float | None, str]:
    """The graph time if there is one, else the eager time marked '(eager)'."""
    g, e = getattr(row, f"{who}_graph"), getattr(row, f"{who}_eager")
    if isinstance(g, float):
        return g, ""
    if isinstance(e, float):
        return e, " (eager)"
    return None, ""


def render(meta: list[str], rows: list[Row], bw: float, done: bool) -> str:
    lines = ["# kda benchmark", ""]
    lines += [f"- {m}" for m in meta]
    lines += ["", "| shape | kda eager us | kda graph us | fla eager us | fla graph us | kda/fla (graph) "
              "| kda graph / floor | floor us | floor us @4.25 TB/s | kda host us | fla host us "
              "| kda vs fla rel diff o / state |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    for r in rows:
        floor_us = r.floor_b / bw * 1e6
        floor_anchor = r.floor_b / ANCHOR_BW * 1e6
        ratio = "-"
        if isinstance(r.kda_graph, float) and isinstance(r.fla_graph, float):
            ratio = f"{r.kda_graph / r.fla_graph:.2f}"
        elif isinstance(r.kda_eager, float) and isinstance(r.fla_eager, float):
            ratio = f"{r.kda_eager / r.fla_eager:.2f} (eager)"
        kb, kmark = _best(r, "kda")
        over = f"{kb / floor_us:.1f}{kmark}" if kb is not None else "-"
        diff = "-"
        if isinstance(r.o_diff, float) and isinstance(r.s_diff, float):
            diff = f"{r.o_diff:.1e} / {r.s_diff:.1e}"
        elif r.o_diff is not None:
            diff = f"{r.o_diff} / {r.s_diff}"
        label = r.case.name
        if r.notes:
            refs = []
            for n in r.notes:
                notes.append(f"[{len(notes) + 1}] {r.case.name}: {n}")
                refs.append(str(len(notes)))
            label += " [" + ",".join(refs) + "]"
        lines.append(f"| {label} | {_fmt_us(r.kda_eager)} | {_fmt_us(r.kda_graph)} | {_fmt_us(r.fla_eager)} | "
                     f"{_fmt_us(r.fla_graph)} | {ratio} | {over} | {floor_us:.1f} | {floor_anchor:.1f} | "
                     f"{_fmt_us(r.kda_host)} | {_fmt_us(r.fla_host)} | {diff} |")
    lines.append("")
    lines.append("kda/fla: kda time over fla time (below 1: kda is faster), graph times where both have one. "
                 "Floor: bytes that must move over the copy bandwidth. 'sync': the call reads device memory "
                 "back to the host, so it was not captured in a graph. 'n/a': fla not importable or not run. "
                 "'paged' rows: kda reads and writes a [4N, HV, V, K] fp32 pool in place; fla has no paged prefill, "
                 "so its columns time what an engine does around it: gather the slots (index_select), fla chunk_kda "
                 "with state_v_first=True, scatter back (index_copy_). Host us: host time of one call issued "
                 f"back to back ({HOST_CALLS} calls after warm-up, no sync inside the loop, time.perf_counter; "
                 f"the mean per call, the best of {HOST_ROUNDS} loops in each of two passes: with the row, and "
                 "after every row, `remeasure_host`). The mixed row's kda columns are the single "
                 "varlen call.")
    cpu = [r for r in rows if isinstance(r.kda_host_cpu, float)]
    if cpu:
        lines += ["", "Host CPU time per call: the calling thread's CPU time (`time.thread_time`) in the host "
                  "column's loops, which another tenant's preemption of the shared host does not add to (a slower "
                  "host, sharing its cores' caches or clocks, still does).", "",
                  "| shape | kda host us | kda host CPU us | fla host us | fla host CPU us |", "|---|---|---|---|---|"]
        lines += [f"| {r.case.name} | {_fmt_us(r.kda_host)} | {_fmt_us(r.kda_host_cpu)} | {_fmt_us(r.fla_host)} | "
                  f"{_fmt_us(r.fla_host_cpu)} |" for r in cpu]
    mixed = [r for r in rows if r.case.group == "mixed"]
    if mixed:
        lines += ["", "Mixed step: one chunk_kda varlen call (unified) against the split pair (fused_recurrent_kda "
                  "on the one-token sequences with cu_seqlens_cpu, then chunk_kda on the long ones) and fla's "
                  f"chunk_kda on the same batch (dense state). Target: unified / split <= {MIXED_TARGET}.", "",
                  "| shape | unified graph us | split graph us | unified / split | fla graph us | unified / fla "
                  "| unified host us | split host us | fla host us |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in mixed:
            def ratio_of(a, b):
                return f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) else "-"
            us = ratio_of(r.kda_graph, r.split_graph)
            if us != "-":
                us += " (meets)" if r.kda_graph / r.split_graph <= MIXED_TARGET else " (misses)"
            lines.append(f"| {r.case.name} | {_fmt_us(r.kda_graph)} | {_fmt_us(r.split_graph)} | {us} | "
                         f"{_fmt_us(r.fla_graph)} | {ratio_of(r.kda_graph, r.fla_graph)} | {_fmt_us(r.kda_host)} | "
                         f"{_fmt_us(r.split_host)} | {_fmt_us(r.fla_host)} |")
    steady = [r for r in rows if r.kda_steady is not None]
    if steady:
        lines += ["", "Decode, steady state (`Timer.steady`: one graph of 8 calls cycling twice over the 4 disjoint "
                  "slot sets of the pool, after an L2 flush that only reads; time per call). The single-replay "
                  "'graph' column above pays the graph launch (about 3 us) and the write-back of do_bench's "
                  "zeroing flush on top of the call.", "",
                  "| shape | kda steady us | kda / floor | fla steady us | fla / floor | kda/fla | floor us |",
                  "|---|---|---|---|---|---|---|"]
        for r in steady:
            floor_us = r.floor_b / bw * 1e6
            cells = []
            for who in ("kda", "fla"):
                t = getattr(r, f"{who}_steady")
                cells += [_fmt_us(t), f"{t / floor_us:.2f}" if isinstance(t, float) else "-"]
            ratio = (f"{r.kda_steady / r.fla_steady:.2f}"
                     if isinstance(r.kda_steady, float) and isinstance(r.fla_steady, float) else "-")
            lines.append(f"| {r.case.name} | {' | '.join(cells)} | {ratio} | {floor_us:.1f} |")
    # narrow state pools against the fp32 pool of the same N and layout
    by_name = {r.case.name: r for r in rows}
    pairs = [(n, f"{dt} {lay}pool", f"fp32 {lay}pool") for n in NARROW_POOL_NS for lay in ("", "K-first ")
             for dt in ("bf16", "fp16")]
    pairs += [(NARROW_POOL_N, "bf16 K-first pool varlen", "fp32 K-first pool varlen")]
    for n, narrow, wide in pairs:
        base = by_name.get(f"decode N={n} H={DECODE_H} {wide}")
        r = by_name.get(f"decode N={n} H={DECODE_H} {narrow}")
        if base is not None and r is not None:
            parts = []
            for who in ("kda", "fla"):
                for how in ("steady", "graph"):
                    a, b = getattr(r, f"{who}_{how}"), getattr(base, f"{who}_{how}")
                    if not (isinstance(a, float) and isinstance(b, float)):
                        continue
                    verdict = ""
                    if who == "kda" and how == "steady":
                        verdict = " (meets" if a / b <= NARROW_POOL_TARGET else " (misses"
                        verdict += f" the <= {NARROW_POOL_TARGET}x target)"
                    parts.append(f"{who} {how} {a / b:.3f}x{verdict}")
            if parts:
                lines.append("")
                lines.append(f"decode N={n} {narrow} time over {wide} time: " + "; ".join(parts))
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    if not done:
        lines += ["", "(run in progress or interrupted: rows so far)"]
    return "\n".join(lines) + "\n"


def _num(x) -> float | None:
    """A measured time, or None where the cell was not measured or failed."""
    return round(x, 2) if isinstance(x, float) else None


def row_json(r: Row, bw: float, plan_device: str = "own") -> dict:
    """One row of the JSON report: the acceptance keys of every row (None where not measured), the plan kda ran
    under ("own": the GPU's; else `--plan-device`'s), then the keys that make sense for its kind (decode: pool and
    form, steady state; mixed: the split pair)."""
    c = r.case
    d = {"kind": c.group, "name": c.name, "shape": f"{c.B}x{c.T}" if c.seqlens is None else f"1x{c.T} varlen",
         "T": c.B * c.T, "H": c.H, "N": c.N,
         "ours_graph_us": _num(r.kda_graph), "ours_eager_us": _num(r.kda_eager),
         "fla_graph_us": _num(r.fla_graph), "fla_eager_us": _num(r.fla_eager),
         "hbm_floor_us": round(r.floor_b / bw * 1e6, 2),
         "ours_host_us": _num(r.kda_host), "fla_host_us": _num(r.fla_host),
         "ours_host_cpu_us": _num(r.kda_host_cpu), "fla_host_cpu_us": _num(r.fla_host_cpu),
         "o_rel_diff": r.o_diff if isinstance(r.o_diff, float) else None,
         "state_rel_diff": r.s_diff if isinstance(r.s_diff, float) else None,
         "fla_safe_gate": r.fla_safe_gate, "plan_device": plan_device}
    if c.mode in ("paged", "decode", "mixed"):
        d.update(state="paged", pool_dtype=DTYPE_SHORT[c.pool_dtype], state_v_first=c.v_first)
    else:
        d["state"] = "dense"
    if c.group == "decode":
        d.update(form="varlen" if c.seqlens is not None else "dense [N, 1]",
                 ours_steady_us=_num(r.kda_steady), fla_steady_us=_num(r.fla_steady))
    if c.group == "mixed":
        d.update(ours_split_graph_us=_num(r.split_graph), ours_split_eager_us=_num(r.split_eager),
                 ours_split_host_us=_num(r.split_host))
    if r.notes:
        d["notes"] = list(r.notes)
    return d


def write_json(path: Path, meta: list[str], rows: list[Row], bw: float, plan_device: str = "own") -> None:
    """The rows so far as a JSON list (one object per row), written whole to a temporary file and renamed,
    so a run killed mid-write leaves the previous complete list. The run's header is in the .md."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps([row_json(r, bw, plan_device) for r in rows], indent=1) + "\n")
    tmp.replace(path)


def git_commit() -> str:
    """KDA_COMMIT when set (the GPU machine's copy of the tree may carry a stale .git), else git's HEAD."""
    if os.environ.get("KDA_COMMIT"):
        return os.environ["KDA_COMMIT"] + " (from KDA_COMMIT)"
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", "-q", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + (" (+ uncommitted changes)" if dirty else "")
    except Exception:  # noqa: BLE001 - no git or no .git on the GPU machine
        return os.environ.get("KDA_COMMIT", "unknown") + " (from KDA_COMMIT)"


def _driver() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001
        return "?"


def load_fla():
    """(chunk_kda, fused_recurrent_kda_fwd, version) or raises."""
    from fla.ops.kda import chunk_kda as fla_chunk
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_decode

    try:
        import fla as _fla

        version = getattr(_fla, "__version__", "?")
    except Exception:  # noqa: BLE001
        version = "?"
    return fla_chunk, fla_decode, version


# --------------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------------

def _groups(text: str) -> tuple[str, ...]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("empty --shapes")
    if "all" in parts:
        return GROUPS
    bad = [p for p in parts if p not in GROUPS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown shape group(s) {bad}; choose from {', '.join(GROUPS)} or all")
    return tuple(p for p in GROUPS if p in parts)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/bench.py",
        description="Time kda (and fla 0.6.0 when importable) on the serving shapes: eager and CUDA-graph "
                    "medians of triton.testing.do_bench, against the HBM floor. Needs a CUDA device.")
    p.add_argument("--shapes", type=_groups, default=GROUPS, metavar="GROUPS",
                   help="comma list of prefill, decode, mixed, varlen, or 'all' (default: all)")
    p.add_argument("--filter", default=None, metavar="REGEX",
                   help="only rows whose name matches this regular expression (e.g. 'H=12')")
    p.add_argument("--out", type=Path, default=None, metavar="FILE.md",
                   help="also write the markdown report here (rewritten after every row)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE.json",
                   help="the rows as JSON, rewritten after every row (default: benchmarks/results/h200-latest.json; "
                        "with --plan-device NAME, benchmarks/results/h200-NAME-plan-latest.json)")
    p.add_argument("--plan-device", choices=sorted(PLAN_DEVICES), default=None,
                   help="plan every kda call as this device's (kda.plan.plan_as): sm_80 is an A100's plan (no TMA, "
                        "no walk beside the prepare, no PDL, 163 KiB of shared memory) on the GPU at hand")
    p.add_argument("--no-fla", action="store_true", help="do not import or time fla")
    p.add_argument("--no-fla-varlen", action="store_true",
                   help="do not time fla on the varlen row (its autotuning at a new varlen shape took over 100 s "
                        "on a fresh machine)")
    p.add_argument("--fla-default-gate", action="store_true",
                   help="call fla's chunk_kda without safe_gate=True (by default it gets safe_gate=True, its M=16 "
                        "tensor-core path for bounded gates and its fastest mode for the lower-bound gate here)")
    p.add_argument("--warmup", type=int, default=25, metavar="MS", help="do_bench warm-up in ms (default 25)")
    p.add_argument("--rep", type=int, default=100, metavar="MS", help="do_bench repetition time in ms (default 100)")
    p.add_argument("--bw-gib", type=float, default=2.0, metavar="GIB",
                   help="size of the tensor copied to measure bandwidth (default 2 GiB)")
    p.add_argument("--list", action="store_true", help="list the rows and exit (no GPU needed)")
    args = p.parse_args(argv)
    if args.json is None:
        args.json = RESULTS / ("h200-latest.json" if args.plan_device is None
                               else f"h200-{args.plan_device}-plan-latest.json")
    return args


def plan_line(plan_device: str | None, planned) -> str:
    """The header's line on the plan kda ran under: `--plan-device`'s or the GPU's own, as `kda.plan.device_info`
    describes it."""
    who = (f"{plan_device}, forced by --plan-device (kda.plan.plan_as)" if plan_device is not None
           else "the GPU's own")
    has = [name for name in ("tma", "spin", "pdl") if getattr(planned, name)]
    return (f"plan device: {who}: capability {planned.capability[0]}.{planned.capability[1]}, {planned.max_smem} B "
            f"shared memory a block, {planned.sm_count} SMs; {', '.join(has) if has else 'no TMA, spin or PDL'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = [c for c in all_cases() if c.group in args.shapes]
    if args.filter:
        rx = re.compile(args.filter)
        cases = [c for c in cases if rx.search(c.name)]
    if args.list:
        for c in cases:
            fb = floor_bytes(c)
            print(f"{c.name}: floor {fb / 1e6:.1f} MB, {fb / ANCHOR_BW * 1e6:.1f} us @4.25 TB/s")
        return 0
    if not cases:
        print("bench: no rows selected", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("benchmarks/bench.py needs a CUDA device (torch.cuda.is_available() is False); it times GPU kernels and "
              "has no CPU mode. Run it on the GPU machine: see benchmarks/README.md.", file=sys.stderr)
        return 2
    from kda.contract import debug_enabled

    if debug_enabled():
        print("bench: warning: KDA_DEBUG is on; its checks sync with the host and distort eager times "
              "and disable graph capture", file=sys.stderr)
    from kda.plan import device_info, plan_as

    if args.plan_device is not None:
        plan_as(*PLAN_DEVICES[args.plan_device])
    plan_desc = plan_line(args.plan_device, device_info(torch.cuda.current_device()))
    print(f"[bench] {plan_desc}", file=sys.stderr, flush=True)
    import triton

    torch.set_grad_enabled(False)
    timer = Timer(args.warmup, args.rep)

    fla, fla_extra, fla_desc = None, {}, "not run (--no-fla)"
    if not args.no_fla:
        try:
            fla_chunk, fla_decode, fla_version = load_fla()
            fla = (fla_chunk, fla_decode)
            fla_desc = f"fla {fla_version} (chunk_kda, fused_recurrent.fused_recurrent_kda_fwd)"
            if not args.fla_default_gate:  # every row's gate has a lower bound: fla at its fastest
                fla_extra = {"safe_gate": True}
                fla_desc += ", safe_gate=True"
        except Exception as e:  # noqa: BLE001
            fla_desc = f"not importable: {_short(e)}"
    print(f"[bench] fla: {fla_desc}", file=sys.stderr, flush=True)

    bw = measure_bandwidth(timer, args.bw_gib)
    props = torch.cuda.get_device_properties(0)
    meta = [
        f"device: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB, "
        f"driver {_driver()}, CUDA {torch.version.cuda}",
        f"torch {torch.__version__}, triton {triton.__version__}, python {sys.version.split()[0]}",
        plan_desc,
        f"fla: {fla_desc}",
        f"date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"commit: {git_commit()}",
        f"copy bandwidth measured: {bw / 1e12:.2f} TB/s (device-to-device copy of {args.bw_gib:g} GiB, "
        "bytes read + written); 'floor us' uses it, 'floor us @4.25 TB/s' uses the H200's copy bandwidth "
        "when the targets were set",
        f"host us: {HOST_CALLS} calls issued back to back after warm-up, no sync inside the loop; mean per call, "
        f"best of {HOST_ROUNDS} loops in each of two passes (with the row, and after every row)",
        f"timing: triton.testing.do_bench median (warmup {args.warmup} ms, rep {args.rep} ms); eager = plain "
        "Python call, graph = torch.cuda.CUDAGraph replay",
        "inputs: q, k, v, beta bf16 randn; g fp32 randn (raw gate, in-kernel lower-bound gate lb=-5 with A_log, "
        "dt_bias); in-kernel q/k l2norm and beta sigmoid; K = V = 128; HV = H; fp32 initial state (randn x 0.1), "
        "final state returned",
    ]
    print(f"[bench] copy bandwidth {bw / 1e12:.2f} TB/s", file=sys.stderr, flush=True)

    rows: list[Row] = []

    def write(done: bool) -> str:
        text = render(meta, rows, bw, done)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
        try:
            write_json(args.json, meta, rows, bw, args.plan_device or "own")
        except Exception as e:  # noqa: BLE001 - the markdown still has the rows
            print(f"[bench] could not write {args.json}: {_short(e)}", file=sys.stderr, flush=True)
        return text

    for case in cases:
        t0 = time.time()
        print(f"[bench] {case.name} ...", file=sys.stderr, flush=True)
        try:
            row = run_case(case, timer, fla, fla_extra, skip_fla=args.no_fla_varlen and case.group == "varlen")
        except Exception as e:  # noqa: BLE001 - never lose the rows already measured
            row = Row(case, floor_bytes(case), "err", "err", "err", "err", notes=[_short(e)])
            traceback.print_exc()
        rows.append(row)
        print(f"[bench] {case.name}: kda {_fmt_us(row.kda_eager)} / {_fmt_us(row.kda_graph)} us, "
              f"fla {_fmt_us(row.fla_eager)} / {_fmt_us(row.fla_graph)} us (eager / graph), "
              f"host {_fmt_us(row.kda_host)} / {_fmt_us(row.fla_host)} us (kda / fla), "
              f"floor {row.floor_b / bw * 1e6:.1f} us, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        for n in row.notes:
            print(f"[bench]   note: {n}", file=sys.stderr, flush=True)
        write(False)
        gc.collect()
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            print(f"[bench] CUDA error after {case.name}: {_short(e)}", file=sys.stderr, flush=True)
    print("[bench] host column, second pass ...", file=sys.stderr, flush=True)
    try:
        remeasure_host(rows, timer, fla, fla_extra)
    except Exception as e:  # noqa: BLE001 - the first pass's values stand
        print(f"[bench] host second pass: {_short(e)}", file=sys.stderr, flush=True)
    text = write(True)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
