"""The Gluon prepare (`kda/ops/hopper_prepare.py`, plan override prepare="hopper") in its variants against the tl twin:
accuracy against the float64 oracle, the output and state against the twin's, graph-replay times of the benchmark's
prefill shapes, the profiler's kernel times. One device call: `python3 benchmarks/hopper_probe.py`."""
import sys
import traceback
from dataclasses import replace

sys.path.insert(0, "tests")
sys.path.insert(0, ".")
import torch  # noqa: E402
import triton  # noqa: E402
from helpers import make_inputs, rel_err, rounding_floor  # noqa: E402

import kda  # noqa: E402
import kda.ops.chunk as C  # noqa: E402
import kda.plan as P  # noqa: E402
import kda.replay  # noqa: E402
import kda_reference as ref  # noqa: E402

# resources from ptxas (Triton 3.6, sm_90, K = V = 128, folded / unfolded)
VARIANTS = {"tl": None,
            "v4": dict(),  # 4 warps, one (chunk, head) a program: 241 / 247 registers, 110 / 94 KB: two an SM
            "v5": dict(num_warps=8),  # 172 registers: one program an SM
            "v6": dict(num_warps=8, maxnreg=128),  # two an SM, 152 bytes of spills (folded)
            "v7": dict(num_warps=8, programs=132),  # persistent, 245 registers, 224 KB: one an SM
            "v8": dict(form="v8")}  # 4 warps, operands formed in registers: 254 / 255 registers, 96 / 84 KB
MODES = sys.argv[1].split(",") if len(sys.argv) > 1 else list(VARIANTS)
MODE = {"p": "tl"}
_orig = P.prefill_plan


def patched(call, device=None, **ov):
    plan, route = _orig(call, device, **ov)
    if MODE["p"] != "tl" and plan.prepare == "fused" and plan.gate_pass:
        plan = replace(plan, prepare="hopper")
    return plan, route


P.prefill_plan = patched


def setmode(mode):
    if MODE["p"] != mode:
        kda.replay.CACHE.clear()  # recorded calls replay the launches of the mode they were recorded in
    MODE["p"] = mode
    C.HOPPER_VARIANT.clear()
    C.HOPPER_VARIANT.update(VARIANTS[mode] or {})


def inputs(B, T, H, seed=0, K=128, V=128, lengths=None):
    q, k, v, g, beta, kw = make_inputs(B, T, H, H, K, V, dtype=torch.bfloat16, gate="lower_bound", device="cuda",
                                       seed=seed, normalize_k=False, beta_sigmoid=True)
    kw["use_qk_l2norm_in_kernel"] = True
    N = B if lengths is None else len(lengths)
    if lengths is not None:
        kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                                        device="cuda")
    h0 = 0.1 * torch.randn(N, H, K, V, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    return (q, k, v, g, beta), h0, kw


def run(mode, args, h0, kw):
    setmode(mode)
    return kda.chunk_kda(*args, initial_state=h0, output_final_state=True, **kw)


print("== accuracy against float64 (H=4) ==", flush=True)
cases = [(1, 1024, None), (1, 8192, None), (2, 1000, None), (1, 65, None), (1, 130, None),
         (1, 2900, [1, 0, 700, 5, 64, 65, 1000, 1, 17, 1047])]
for (B, T, lengths) in cases:
    try:
        args, h0, kw = inputs(B, T, 4, seed=T, lengths=lengths)
        ro, rs = ref.chunk_kda(*args, initial_state=h0.double(), output_final_state=True, allow_float64=True, **kw)
        res = {}
        for mode in MODES:
            o, s = run(mode, args, h0, kw)
            torch.cuda.synchronize()
            res[mode] = (o, s)
            vs = "" if mode == "tl" else f" | vs tl: o {rel_err(o, res['tl'][0]):.2e} s {rel_err(s, res['tl'][1]):.2e}"
            print(f"{B}x{T}{' varlen' if lengths else ''} {mode}: o {rel_err(o, ro):.3e} state {rel_err(s, rs):.3e} "
                  f"nan {bool(torch.isnan(o).any() or torch.isnan(s).any())}{vs}", flush=True)
        print(f"   bf16 floor {rounding_floor(ro, torch.bfloat16):.3e}", flush=True)
    except Exception:
        traceback.print_exc()

print("== graph replay, us (benchmark prefill shapes) ==", flush=True)
shapes = [(1, 4096, 12), (1, 16384, 12), (1, 4096, 32), (1, 16384, 32), (4, 4096, 32), (1, 8192, 96), (1, 65536, 12)]
for (B, T, H) in shapes:
    try:
        args, h0, kw = inputs(B, T, H, seed=1)
        ref_o = run("tl", args, h0, kw)
        times, diffs = {}, {}
        for mode in MODES:
            setmode(mode)
            f = lambda a=args, h=h0, w=kw: kda.chunk_kda(*a, initial_state=h, output_final_state=True, **w)  # noqa: E731
            o, s = f()
            diffs[mode] = (rel_err(o, ref_o[0]), rel_err(s, ref_o[1]))
            st = torch.cuda.Stream()
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                f()
                f()
            torch.cuda.current_stream().wait_stream(st)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                f()
            times[mode] = triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median") * 1e3
        print(f"{B}x{T} H={H}: " + ", ".join(f"{m} {times[m]:.1f} ({times[m] / times['tl']:.3f}; o {diffs[m][0]:.1e})"
                                             for m in MODES), flush=True)
    except Exception:
        traceback.print_exc()

print("== kernel times (torch profiler, us) ==", flush=True)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

for (B, T, H) in [(1, 16384, 32), (1, 4096, 12)]:
    args, h0, kw = inputs(B, T, H, seed=2)
    for mode in MODES:
        run(mode, args, h0, kw)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                run(mode, args, h0, kw)
            torch.cuda.synchronize()
        ev = {e.key: e.device_time_total / max(e.count, 1) for e in prof.key_averages() if "kernel" in e.key}
        top = sorted(ev.items(), key=lambda x: -x[1])[:3]
        print(f"{B}x{T} H={H} {mode}: " + ", ".join(f"{k} {v:.1f}" for k, v in top), flush=True)
