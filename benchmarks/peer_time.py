"""Prefill beside Moonshot's FlashKDA (`flash_kda.fwd`: CUTLASS, sm_90a) on one GPU, in one process: the
benchmark's prefill rows and its varlen row in graph replay, and each library's error against the float64 oracle.
fla 0.6.0 routes its own `chunk_kda` to FlashKDA when `flash_kda` is importable, under inference mode, with
`safe_gate=True` and a V-first state (`fla/ops/kda/backends/flash_kda.py`): this is that path, timed directly.

Inputs as `benchmarks/bench.py`'s (q, k, v, beta bf16 randn, raw gate g randn with A_log, dt_bias and lb = -5,
q/k l2norm and beta sigmoid in the kernel, an fp32 initial and final state), except that FlashKDA reads the gate g
rounded to bf16 (it takes no other; kda the benchmark's fp32 g) and the state is V-first `[N, H, V, K]` (FlashKDA's
layout; kda with `state_v_first=True`). Accuracy: `kda.accuracy.inputs.gate_form_inputs("lower_bound")` at B = 1,
H = 4, the inputs rounded to bf16 (g too) before the oracle (`kda_reference.recurrent_kda`, float64, on the GPU)
sees them.

FlashKDA is not a dependency: build it on the GPU machine from its repository with CUTLASS at the submodule's
commit, `FLASH_KDA_CUDA_ARCHS=90a python3 setup.py build_ext --inplace`, and put its directory on PYTHONPATH.

    python benchmarks/peer_time.py [--rows prefill,varlen] [--accuracy-T 2048,8192] (a CUDA device)
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402

import kda  # noqa: E402

LB = bench.LOWER_BOUND


def _inputs(B: int, T: int, H: int, seqlens, dev: str = "cuda"):
    q, k, v, g, beta, A_log, dt_bias = bench._tokens(B, T, H, H, dev)
    cu = None
    if seqlens is not None:
        cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int64, device=dev)
    N = len(seqlens) if seqlens is not None else B
    h0 = torch.randn(N, H, bench.V_DIM, bench.K_DIM, device=dev, dtype=torch.float32) * 0.1
    return q, k, v, g, beta, A_log, dt_bias, cu, h0


def _kda(q, k, v, g, beta, A_log, dt_bias, cu, h0):
    """kda.chunk_kda with Kimi's gate, q/k l2norm and beta sigmoid in the kernel, a V-first fp32 state."""
    return kda.chunk_kda(q, k, v, g, beta, None, h0, True, use_qk_l2norm_in_kernel=True,
                         use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                         lower_bound=LB, state_v_first=True, cu_seqlens=cu)


def _flash_kda(flash_kda, q, k, v, g16, beta, A_log, dt_bias, cu, h0, out, final):
    """The same call through `flash_kda.fwd` (its gate g bf16, dt_bias [H, K]), into `out` and `final`."""
    H, K = q.shape[2], q.shape[3]
    extra = {} if cu is None else dict(cu_seqlens=cu)
    flash_kda.fwd(q, k, v, g16, beta, K ** -0.5, out, A_log=A_log, dt_bias=dt_bias.view(H, K), lower_bound=LB,
                  initial_state=h0, final_state=final, **extra)
    return out, final


def _calls(flash_kda, q, k, v, g, beta, A_log, dt_bias, cu, h0):
    """kda (the benchmark's fp32 gate) and FlashKDA (the same gate rounded to bf16) as callables."""
    calls = {"kda": lambda: _kda(q, k, v, g, beta, A_log, dt_bias, cu, h0)}
    if flash_kda is not None:
        g16, out, final = g.to(torch.bfloat16), torch.empty_like(v), torch.empty_like(h0)
        calls["FlashKDA"] = lambda: _flash_kda(flash_kda, q, k, v, g16, beta, A_log, dt_bias, cu, h0, out, final)
    return calls


def timing(flash_kda, rows: list[str], timer: bench.Timer) -> list[str]:
    lines = ["| shape | kda us | FlashKDA us | kda / FlashKDA | o rel diff kda vs FlashKDA | state rel diff |",
             "|---|---|---|---|---|---|"]
    for case in bench.all_cases():
        if case.group not in rows or case.mode != "dense":
            continue
        q, k, v, g, beta, A_log, dt_bias, cu, h0 = _inputs(case.B, case.T, case.H, case.seqlens)
        calls = _calls(flash_kda, q, k, v, g, beta, A_log, dt_bias, cu, h0)
        t = {}
        for who, fn in calls.items():
            try:
                t[who] = timer.graph(fn)
            except Exception as e:  # noqa: BLE001
                t[who] = f"failed: {bench._short(e, 120)}"
        diff = ("-", "-")
        if "FlashKDA" in calls:
            o1, s1 = calls["kda"]()
            o2, s2 = calls["FlashKDA"]()
            diff = (f"{bench._rel(o1, o2):.2e}", f"{bench._rel(s1, s2):.2e}")

        def ratio(a, b):
            return f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) else "-"

        fk = t.get("FlashKDA", "n/a")
        line = (f"| {case.name} | {bench._fmt_us(t['kda'])} | {bench._fmt_us(fk)} | {ratio(t['kda'], fk)} | "
                f"{diff[0]} | {diff[1]} |")
        print(line, flush=True)
        lines.append(line)
        del calls, q, k, v, g, beta, h0
        torch.cuda.empty_cache()
    return lines


def accuracy(flash_kda, lengths: list[int], H: int = 4, dev: str = "cuda") -> list[str]:
    from kda.accuracy.inputs import gate_form_inputs, generator
    from kda.accuracy.measure import rel_l2
    from kda_reference import recurrent_kda

    lines = ["| T | kda o | kda state | FlashKDA o | FlashKDA state | bf16 floor of o |", "|---|---|---|---|---|---|"]
    K = V = 128
    for T in lengths:
        inp = gate_form_inputs("lower_bound", 1, T, H, H, K, V, generator(0, f"peer {T}"))
        q, k, v, g, beta = (x.to(torch.bfloat16).to(dev) for x in (inp.q, inp.k, inp.v, inp.g, inp.beta))
        A_log = inp.opts["A_log"].float().to(dev)
        dt_bias = inp.opts["dt_bias"].float().to(dev)
        h0 = torch.zeros(1, H, V, K, device=dev, dtype=torch.float32)
        o_ref, s_ref = recurrent_kda(q, k, v, g, beta, None, h0, True, use_qk_l2norm_in_kernel=True,
                                     use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                                     dt_bias=dt_bias, lower_bound=LB, state_v_first=True)  # float64 inside
        o1, s1 = _kda(q, k, v, g, beta, A_log, dt_bias, None, h0)
        row = [f"{rel_l2(o1, o_ref):.3e}", f"{rel_l2(s1, s_ref):.3e}"]
        if flash_kda is not None:
            o2, s2 = _flash_kda(flash_kda, q, k, v, g, beta, A_log, dt_bias, None, h0, torch.empty_like(v),
                                torch.empty_like(h0))
            row += [f"{rel_l2(o2, o_ref):.3e}", f"{rel_l2(s2, s_ref):.3e}"]
        else:
            row += ["n/a", "n/a"]
        line = f"| {T} | {' | '.join(row)} | {rel_l2(o_ref.to(torch.bfloat16), o_ref):.3e} |"
        print(line, flush=True)
        lines.append(line)
    return lines


def main() -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/peer_time.py")
    p.add_argument("--rows", default="prefill,varlen", help="the benchmark's row groups (default prefill,varlen)")
    p.add_argument("--accuracy-T", default="2048,8192", help="lengths of the accuracy rows ('' for none)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/peer_time.py needs a CUDA device", file=sys.stderr)
        return 2
    try:
        import flash_kda
    except ImportError as e:
        print(f"[peer_time] flash_kda not importable ({e}): kda's columns only", file=sys.stderr)
        flash_kda = None
    torch.set_grad_enabled(False)
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
          f"commit {bench.git_commit()}; graph replay, do_bench median, us", flush=True)
    timing(flash_kda, args.rows.split(","), bench.Timer(warmup_ms=25, rep_ms=200))
    if args.accuracy_T:
        accuracy(flash_kda, [int(t) for t in args.accuracy_T.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
