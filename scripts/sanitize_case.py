"""Small kda calls for `compute-sanitizer --tool memcheck` (scripts/gpu_suite.sh runs it there):

(a) `kda.chunk_kda`, varlen with an empty sequence in the middle (cu_seqlens [0, 70, 70, 200]), paged
    state: an 8-slot pool with a padded slot stride, state_indices [5, 1, 3], has_initial_state
    [True, False, True] (slot 1 holds NaN: it must never be read);
(b) `kda.fused_recurrent_kda`, paged decode of N=5 sequences, two of them padding (index -1);
(c) on CUDA only (on CPU the host reads these values and raises): device values out of range, which the
    kernels guard without a sync: a prefill with one slot past the pool and one with bounds past T, a
    varlen decode with bounds past T and one with a slot past the pool, each with `errors=`: the bad
    sequence is a no-op, its error bit set, nothing else touched;
(d) a mixed step (`chunk_kda` with host bounds: one-token sequences and a 3-token one through the
    recurrent loop kernel, a 70-token one through the chunk kernels, a padding sequence, a NaN slot not
    read);
(e) a dense `chunk_kda` into a paged pool, which a Hopper GPU runs with the walk beside the prepare (the
    counters, the walk's bounded waits and its resume launch: `kda.ops.overlap`), twice (the second call
    replayed): the same bits both times;
(f) (a) and (e) again with as many q/k heads as value heads, the shapes an sm_90 GPU runs through the Gluon
    prepare (`kda.plan.gluon_prepare`: its asynchronous copies and shared-memory views).

All use K = V = 128, bf16 q/k/v, the in-kernel lower-bound gate, q/k L2 norm and beta sigmoid, and run
for an fp32 and a bf16 pool. Besides giving the sanitizer something to watch, each call checks the
contract's promises that need no reference: outputs finite, padding rows zero, slots not named and the
pool's padding untouched, the empty sequence's slot written with zeros; and, when `kda_reference`
imports, the outputs and written slots against its float64 recurrence.

    python3 scripts/sanitize_case.py           # CUDA
    TRITON_INTERPRET=1 python3 scripts/sanitize_case.py   # CPU, through the Triton interpreter (slow)

Prints "sanitize case ok" and exits 0 when every check passes; exits 1 otherwise.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kda  # noqa: E402

K = V = 128
H = 2
HV = 4  # GVA: two value heads per q/k head
SLOTS = 8
PAD = 96  # extra elements per slot: the pool's stride(0) is larger than one plane
SENTINEL = 7.0
TOL = 2e-2  # bf16 inputs and output against a float64 reference

failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  {'ok ' if ok else 'FAIL'} {what}")
    if not ok:
        failures.append(what)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def padded_pool(dtype: torch.dtype, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(base [SLOTS, plane + PAD], pool view [SLOTS, HV, V, K] with stride(0) = plane + PAD)."""
    plane = HV * V * K
    base = torch.full((SLOTS, plane + PAD), SENTINEL, dtype=dtype, device=dev)
    base[:, :plane] = (torch.randn(SLOTS, plane, device=dev) * 0.1).to(dtype)
    pool = base[:, :plane].view(SLOTS, HV, V, K)
    assert pool.stride(0) == plane + PAD
    return base, pool


def inputs(T: int, N: int | None, dev: str, h: int = H):
    B, TT = (1, T) if N is None else (N, 1)
    q = torch.randn(B, TT, h, K, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, TT, h, K, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, TT, HV, V, device=dev, dtype=torch.bfloat16)
    g = torch.randn(B, TT, HV, K, device=dev, dtype=torch.float32)
    beta = torch.randn(B, TT, HV, device=dev, dtype=torch.bfloat16)
    A_log = torch.empty(HV, device=dev).uniform_(1.0, 16.0).log_()
    dt_bias = torch.randn(HV * K, device=dev) * 0.5
    flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                 A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    return (q, k, v, g, beta), flags


def reference(tensors, flags, **kw):
    """kda_reference.recurrent_kda (float64) on CPU copies, or None when it does not import or refuses the
    call. A CPU `state_cache` in kw is written in place, as the contract says."""
    try:
        import kda_reference
    except Exception as e:  # noqa: BLE001 - the oracle is optional here
        print(f"  (kda_reference not importable, reference check skipped: {e})")
        return None
    cpu = lambda x: x.cpu() if isinstance(x, torch.Tensor) else x  # noqa: E731
    try:
        return kda_reference.recurrent_kda(*[cpu(t) for t in tensors], **{n: cpu(x) for n, x in flags.items()},
                                           **{n: cpu(x) for n, x in kw.items()})
    except Exception as e:  # noqa: BLE001
        print(f"  (kda_reference.recurrent_kda failed, reference check skipped: {type(e).__name__}: {e})")
        return None


def check_pool_and_reference(o, base, before, ref_pool, written, tensors, flags, **kw) -> None:
    """Slots not in `written` and the pool's padding untouched; o and the written slots against
    kda_reference run on `ref_pool`, a copy of the pool taken before the call (written in place there)."""
    plane = HV * V * K
    untouched = [s for s in range(SLOTS) if s not in written]
    check(torch.equal(base[untouched], before[untouched]), f"slots {untouched} untouched")
    check(torch.equal(base[:, plane:], before[:, plane:]), "pool padding untouched")
    ref_pool = ref_pool.cpu()
    ref = reference(tensors, flags, state_cache=ref_pool, **kw)
    if ref is not None:
        e = rel(o, ref[0])
        check(e < TOL, f"output vs kda_reference: rel {e:.1e}")
        pool = base[:, :plane].view(SLOTS, HV, V, K)
        e = rel(pool[list(written)], ref_pool[list(written)])
        check(e < TOL, f"slots {list(written)} vs kda_reference: rel {e:.1e}")


def case_chunk(dtype: torch.dtype, dev: str, h: int = H) -> None:
    print(f"(a) chunk_kda varlen + empty sequence, paged {dtype} pool")
    cu = torch.tensor([0, 70, 70, 200], dtype=torch.int32, device=dev)
    idx = torch.tensor([5, 1, 3], dtype=torch.int32, device=dev)
    has_init = torch.tensor([True, False, True], device=dev)
    tensors, flags = inputs(200, None, dev, h)
    base, pool = padded_pool(dtype, dev)
    pool[1] = float("nan")  # has_initial_state[1] is False: never read
    before = base.clone()
    ref_pool = pool.clone()
    o, final = kda.chunk_kda(*tensors, cu_seqlens=cu, state_cache=pool, state_indices=idx,
                             has_initial_state=has_init, state_v_first=True, **flags)
    if dev == "cuda":
        torch.cuda.synchronize()
    check(final is None, "final_state is None (paged contract)")
    check(bool(torch.isfinite(o.float()).all()), "output finite")
    check(bool((pool[1] == 0).all()), "empty sequence without initial state: slot 1 written with zeros")
    check(bool(torch.isfinite(pool[[5, 3]].float()).all()), "slots 5 and 3 finite")
    check_pool_and_reference(o, base, before, ref_pool, (5, 1, 3), tensors, flags, cu_seqlens=cu, state_indices=idx,
                             has_initial_state=has_init, state_v_first=True)


def case_decode(dtype: torch.dtype, dev: str) -> None:
    print(f"(b) fused_recurrent_kda paged decode N=5 with padding, {dtype} pool")
    idx = torch.tensor([2, -1, 7, -1, 0], dtype=torch.int32, device=dev)
    tensors, flags = inputs(1, 5, dev)
    base, pool = padded_pool(dtype, dev)
    before = base.clone()
    ref_pool = pool.clone()
    o, final = kda.fused_recurrent_kda(*tensors, state_cache=pool, state_indices=idx, state_v_first=True,
                                       **flags)
    if dev == "cuda":
        torch.cuda.synchronize()
    plane = HV * V * K
    check(final is None, "final_state is None (paged contract)")
    check(bool(torch.isfinite(o.float()).all()), "output finite")
    check(bool((o[[1, 3]] == 0).all()), "padding sequences (index -1): output rows zero")
    untouched = [s for s in range(SLOTS) if s not in (2, 7, 0)]
    check(torch.equal(base[untouched], before[untouched]), f"slots {untouched} untouched")
    check(torch.equal(base[:, plane:], before[:, plane:]), "pool padding untouched")
    ref_pool = ref_pool.cpu()
    ref = reference(tensors, flags, state_cache=ref_pool, state_indices=idx, state_v_first=True)
    if ref is not None:
        e = rel(o, ref[0])
        check(e < TOL, f"output vs kda_reference: rel {e:.1e}")
        e = rel(pool[[2, 7, 0]], ref_pool[[2, 7, 0]])
        check(e < TOL, f"slots 2, 7, 0 vs kda_reference: rel {e:.1e}")


def _bad_value_call(name, fn, dtype, dev, T, bounds, slots, expect, written, silent=None) -> None:
    """`fn` over a padded pool with one device value out of range and `errors=`: the error word, the slots
    not in `written` and the pool's padding untouched, and (`silent`) the bad sequence's output rows left
    as they were."""
    plane = HV * V * K
    tensors, flags = inputs(T, None, dev)
    base, pool = padded_pool(dtype, dev)
    before = base.clone()
    errors = torch.zeros(len(slots), dtype=torch.int32, device=dev)
    out = torch.full_like(tensors[2], SENTINEL)
    extra = dict(has_initial_state=torch.ones(len(slots), dtype=torch.bool, device=dev)) if fn is kda.chunk_kda else {}
    fn(*tensors, cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=dev), state_cache=pool,
       state_indices=torch.tensor(slots, dtype=torch.int32, device=dev), state_v_first=True, out=out,
       errors=errors, **extra, **flags)
    torch.cuda.synchronize()
    check(errors.tolist() == expect, f"{name}: error word {errors.tolist()}")
    if silent is not None:
        check(bool((out[0, silent] == SENTINEL).all()), f"{name}: the bad sequence wrote no output row")
    untouched = [s for s in range(SLOTS) if s not in written]
    check(torch.equal(base[untouched], before[untouched]), f"{name}: slots {untouched} untouched")
    check(torch.equal(base[:, plane:], before[:, plane:]), f"{name}: pool padding untouched")


def case_bad_device_values(dtype: torch.dtype, dev: str) -> None:
    print(f"(c) device values out of range, {dtype} pool")
    if dev != "cuda":
        print("  (CUDA only: on CPU the host checks read these values and raise)")
        return
    _bad_value_call("chunk, a slot past the pool", kda.chunk_kda, dtype, dev, 200, [0, 70, 70, 200],
                    [5, SLOTS + 40, 3], [0, kda.ERROR_SLOT, 0], (5, 3))
    _bad_value_call("chunk, bounds past T", kda.chunk_kda, dtype, dev, 200, [0, 70, 70, 250],
                    [5, 1, 3], [0, 0, kda.ERROR_BOUNDS], (5, 1), slice(70, None))
    _bad_value_call("decode, bounds past T", kda.fused_recurrent_kda, dtype, dev, 3, [0, 1, 2, 999],
                    [2, 7, 0], [0, 0, kda.ERROR_BOUNDS], (2, 7), 2)
    _bad_value_call("decode, a slot past the pool", kda.fused_recurrent_kda, dtype, dev, 3, [0, 1, 2, 3],
                    [2, SLOTS + 9, 0], [0, kda.ERROR_SLOT, 0], (2, 0))


def case_mixed(dtype: torch.dtype, dev: str) -> None:
    print(f"(d) chunk_kda mixed step (decodes and a short continuation through the recurrent loop, host bounds "
          f"given), paged {dtype} pool")
    bounds = [0, 1, 71, 72, 75, 75]
    cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
    idx = torch.tensor([6, 2, -1, 4, 0], dtype=torch.int32, device=dev)  # sequence 2: padding
    has_init = torch.tensor([True, True, True, False, True], device=dev)
    tensors, flags = inputs(bounds[-1], None, dev)
    base, pool = padded_pool(dtype, dev)
    pool[4] = float("nan")  # has_initial_state[3] is False: never read
    before = base.clone()
    ref_pool = pool.clone()
    errors = torch.zeros(5, dtype=torch.int32, device=dev)
    o, _ = kda.chunk_kda(*tensors, cu_seqlens=cu, cu_seqlens_cpu=bounds, state_cache=pool, state_indices=idx,
                         has_initial_state=has_init, state_v_first=True, errors=errors, **flags)
    if dev == "cuda":
        torch.cuda.synchronize()
    check(not errors.any(), f"error word {errors.tolist()} clear")
    check(bool(torch.isfinite(o.float()).all()), "output finite")
    check(bool((o[0, 71] == 0).all()), "padding sequence: zero output row")
    check_pool_and_reference(o, base, before, ref_pool, (6, 2, 4, 0), tensors, flags, cu_seqlens=cu,
                             state_indices=idx, has_initial_state=has_init, state_v_first=True)


def case_beside(dtype: torch.dtype, dev: str, h: int = H) -> None:
    print(f"(e) chunk_kda dense, paged {dtype} pool: the walk beside the prepare on a GPU that plans it (its counters, "
          f"bounded waits and resume launch), the first call and a repeated (replayed) one")
    idx = torch.tensor([5], dtype=torch.int32, device=dev)
    has_init = torch.tensor([True], device=dev)
    tensors, flags = inputs(300, None, dev, h)
    base, pool = padded_pool(dtype, dev)
    base2 = base.clone()
    pool2 = base2[:, :HV * V * K].view(SLOTS, HV, V, K)
    before = base.clone()
    ref_pool = pool.clone()
    runs = [kda.chunk_kda(*tensors, state_cache=p, state_indices=idx, has_initial_state=has_init, state_v_first=True,
                          **flags)[0] for p in (pool, pool2)]
    if dev == "cuda":
        torch.cuda.synchronize()
    check(torch.equal(runs[0], runs[1]) and torch.equal(base, base2), "the repeated call: the same bits")
    check(bool(torch.isfinite(runs[0].float()).all()), "output finite")
    check_pool_and_reference(runs[0], base, before, ref_pool, (5,), tensors, flags, state_indices=idx,
                             has_initial_state=has_init, state_v_first=True)


def main() -> int:
    if torch.cuda.is_available():
        dev = "cuda"
    elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        dev = "cpu"
    else:
        print("sanitize_case.py needs CUDA (or TRITON_INTERPRET=1 to run the kernels on CPU)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        case_chunk(dtype, dev)
        case_decode(dtype, dev)
        case_bad_device_values(dtype, dev)
        case_mixed(dtype, dev)
        case_beside(dtype, dev)
    for dtype in (torch.float32, torch.bfloat16):
        print(f"(f) (a) and (e) with H = HV = {HV}: the Gluon prepare on sm_90")
        case_chunk(dtype, dev, HV)
        case_beside(dtype, dev, HV)
    if failures:
        print(f"sanitize case FAILED: {len(failures)} check(s): " + "; ".join(failures))
        return 1
    print("sanitize case ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
