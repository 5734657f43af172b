"""How long a step of a one-dot walk takes, against today's walk: the decision before building it.

The one-dot walk (`one_dot_walk_study.py`: as accurate, better on the long regimes' state) carries S through
S' = gt S + R S + B and writes O = Q' S + E, with R = -M^T Kd, Q' = Qd - N Kd, B = M^T V, E = N V formed ahead of
the walk from today's folded operands. Its step holds one tensor-core round trip on the state's chain (today's
folded step three: [Kd; Qd] S, N D, M^T D). Here a stand-alone kernel walks that step over random tiles of the
right shapes and scales (no prepare: only the walk's own time), one program per (V block, head) as the walk's
grid, and today's walk is timed alone on the same shape (`chunk_kda` with the walk after the prepare, torch
profiler), so the two per-step times compare on one GPU. Forms:

- `stacked`: [R; Q'; 0] (256 rows) times S in one dot, the [B; E; 0] tile added (one round trip a step);
- `two dots`: R S on the chain, then Q' S for the output (two round trips, the output's awaited where issued).

On the CPU (TRITON_INTERPRET=1) `--check` holds both forms to a float64 loop of the same recurrence.

    python benchmarks/one_dot_step_probe.py [--shape 1x16384x12] [--bv 32] [--stages 2,3] [--check]
"""

import argparse
import functools
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402

from kda.ops.common import pow2_scale  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _one_dot_walk(rq, be, gt, sc, s0, o, NT, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BV: tl.constexpr, STACK: tl.constexpr, TMA: tl.constexpr):
    """S [K, BV] (columns of V block program_id(0), head program_id(1)) through NT chunks: per chunk c the
    fp16 rows [R; Q'; 0] of rq ([NT, HV, 2K, K]) and [B; E; 0] of be ([NT, HV, 2K, V]), gt ([NT, HV, K]) and
    the chunk's scales sc ([NT, HV, 2]: R's and Q''s inverse powers of two): S <- gt S + sc0 R S + B,
    O = sc1 Q' S + E for the chunk's BT tokens (o: [NT BT, HV, V] fp32)."""
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    o_k = tl.arange(0, K)
    o_c = i_v * BV + tl.arange(0, BV)
    o_r = tl.arange(0, 2 * K)
    S = tl.load(s0 + i_h * K * V + o_k[:, None] * V + o_c[None, :])
    for c in range(NT):
        row = (c * HV + i_h) * (2 * K)
        g = tl.load(gt + (c * HV + i_h) * K + o_k)
        s_r = tl.load(sc + (c * HV + i_h) * 2)
        s_q = tl.load(sc + (c * HV + i_h) * 2 + 1)
        ps = pow2_scale(S)
        Sr = (S * ps).to(tl.float16)
        inv_ps = 1.0 / ps
        if STACK:
            if TMA:
                a = rq.load([row, 0])
                b = be.load([row, i_v * BV])
            else:
                a = tl.load(rq + (row + o_r)[:, None] * K + o_k[None, :])
                b = tl.load(be + (row + o_r)[:, None] * V + o_c[None, :])
            acc = tl.dot(a, Sr) * inv_ps
            r, q = tl.split(tl.permute(tl.reshape(acc, [2, K, BV]), (1, 2, 0)))
            b_r, b_q = tl.split(tl.permute(tl.reshape(b.to(tl.float32), [2, K, BV]), (1, 2, 0)))
            S = S * g[:, None] + r * s_r + b_r
            out = q * s_q + b_q
        else:  # R and Q' as two [K, K] tiles, two dots
            if TMA:
                a_r = rq.load([row, 0])
                a_q = rq.load([row + K, 0])
                b_r = be.load([row, i_v * BV]).to(tl.float32)
                b_q = be.load([row + K, i_v * BV]).to(tl.float32)
            else:
                a_r = tl.load(rq + (row + o_k)[:, None] * K + o_k[None, :])
                a_q = tl.load(rq + (row + K + o_k)[:, None] * K + o_k[None, :])
                b_r = tl.load(be + (row + o_k)[:, None] * V + o_c[None, :]).to(tl.float32)
                b_q = tl.load(be + (row + K + o_k)[:, None] * V + o_c[None, :]).to(tl.float32)
            S_new = S * g[:, None] + tl.dot(a_r, Sr) * (inv_ps * s_r) + b_r
            out = tl.dot(a_q, Sr) * (inv_ps * s_q) + b_q
            S = S_new
        # rows 0..BT-1 of the Q' half are the chunk's tokens (the rest is the zero padding's)
        tl.store(o + ((c * BT + o_k[:, None]) * HV + i_h) * V + o_c[None, :], out, mask=o_k[:, None] < BT)
    tl.store(s0 + i_h * K * V + o_k[:, None] * V + o_c[None, :], S)


def tiles(NT, HV, K, V, BT, dev, seed=0):
    """Random operands at the walk's scales: R and Q' of entries ~ 2^-4 (|R S| below |S|, as a decayed
    transition's), stored fp16 times 2^4 with inverse scale 2^-4; B, E ~ 1e-1; gt in (0.5, 1)."""
    gen = torch.Generator().manual_seed(seed)
    rq = torch.zeros(NT, HV, 2 * K, K)
    rq[:, :, :K] = torch.randn(NT, HV, K, K, generator=gen) / K ** 0.5 * 0.5
    rq[:, :, K:K + BT] = torch.randn(NT, HV, BT, K, generator=gen) / K ** 0.5
    be = torch.zeros(NT, HV, 2 * K, V)
    be[:, :, :K + BT] = torch.randn(NT, HV, K + BT, V, generator=gen) * 0.1
    gt = 0.5 + 0.5 * torch.rand(NT, HV, K, generator=gen)
    sc = torch.full((NT, HV, 2), 2.0 ** -4)
    rq16 = (rq * 2.0 ** 4).half()
    be16 = be.half()
    s0 = torch.randn(HV, K, V, generator=gen) * 0.1
    return [x.to(dev) for x in (rq16, be16, gt, sc, s0)]


def reference(rq16, be16, gt, sc, s0, BT):
    """The recurrence in float64 from the same fp16 operands (S unrounded)."""
    NT, HV, K2, K = rq16.shape
    S = s0.double().cpu().clone()
    outs = []
    for c in range(NT):
        R = rq16[c, :, :K].double().cpu() * sc[c, :, 0].double().cpu()[:, None, None]
        Q = rq16[c, :, K:K + BT].double().cpu() * sc[c, :, 1].double().cpu()[:, None, None]
        B = be16[c, :, :K].double().cpu()
        E = be16[c, :, K:K + BT].double().cpu()
        outs.append(Q @ S + E)  # [HV, BT, V]
        S = gt[c].double().cpu()[:, :, None] * S + R @ S + B
    return torch.stack(outs).permute(0, 2, 1, 3).reshape(NT * BT, HV, -1), S


def launch(args, NT, HV, K, V, BT, BV, stack, stages, tma):
    rq16, be16, gt, sc, s0 = args
    o = torch.empty(NT * BT, HV, V, device=s0.device)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        rows = 2 * K if stack else K
        rq_d = TensorDescriptor.from_tensor(rq16.view(-1, K), [rows, K])
        be_d = TensorDescriptor.from_tensor(be16.view(-1, V), [rows, BV])
    else:
        rq_d, be_d = rq16, be16
    s = s0.clone()
    _one_dot_walk[(V // BV, HV)](rq_d, be_d, gt, sc, s, o, NT, HV=HV, K=K, V=V, BT=BT, BV=BV, STACK=stack,
                                 TMA=tma, num_warps=4, num_stages=stages)
    return o, s


def check(BV):
    NT, HV, K, V, BT = 3, 2, 128, 128, 64
    args = tiles(NT, HV, K, V, BT, "cpu")
    o_ref, s_ref = reference(*args, BT)
    for stack in (True, False):
        o, s = launch(args, NT, HV, K, V, BT, BV, stack, 1, False)
        eo = ((o.double() - o_ref).norm() / o_ref.norm()).item()
        es = ((s.double() - s_ref).norm() / s_ref.norm()).item()
        # fp16 S operand: 2^-11 a rounding, a few steps
        ok = eo < 4e-3 and es < 4e-3
        print(f"check BV {BV} {'stacked' if stack else 'two dots'}: output {eo:.2e} state {es:.2e} "
              f"{'ok' if ok else 'FAILED'}")
        assert ok


def todays_walk(B, T, H):
    """Today's walk kernel alone (after the prepare) on the shape: its time from the torch profiler, us."""
    import kda
    import kda.plan as P
    import kda.replay as R

    R.CAPACITY = 0
    may_wait = P._may_wait
    P._may_wait = lambda call, device: False
    try:
        torch.manual_seed(0)
        q, k, v, g, beta, A_log, dt_bias = bench._tokens(B, T, H, H, "cuda")
        flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                     A_log=A_log, dt_bias=dt_bias, lower_bound=bench.LOWER_BOUND)
        h0 = torch.randn(B, H, 128, 128, device="cuda") * 0.1
        for _ in range(3):
            kda.chunk_kda(q, k, v, g, beta, None, h0, True, **flags)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                kda.chunk_kda(q, k, v, g, beta, None, h0, True, **flags)
                torch.cuda.synchronize()
            times += [e.device_time_total / e.count for e in prof.key_averages() if e.key == "_chunk_state_kernel"]
        return min(times)
    finally:
        P._may_wait = may_wait


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/one_dot_step_probe.py")
    p.add_argument("--shape", default="1x16384x12", help="BxTxH (B = 1)")
    p.add_argument("--bv", type=int, default=32)
    p.add_argument("--stages", default="2,3")
    p.add_argument("--check", action="store_true", help="CPU: hold both forms to a float64 loop")
    a = p.parse_args()
    if a.check or INTERPRET:
        check(a.bv)
        return
    B, T, H = (int(x) for x in a.shape.split("x"))
    K = V = 128
    BT = 64
    NT = T // BT
    walk = todays_walk(B, T, H)
    print(f"{torch.cuda.get_device_name(0)} {a.shape}: today's walk alone {walk:.1f} us, {walk / NT:.3f} us a step",
          flush=True)
    args = tiles(NT, H, K, V, BT, "cuda")
    timer = bench.Timer(warmup_ms=25, rep_ms=200)  # median of do_bench, an L2 flush before each launch
    for stack in (True, False):
        for stages in (int(s) for s in a.stages.split(",")):
            for tma in (True, False):
                form = "stacked" if stack else "two dots"
                name = f"{form} BV {a.bv} stages {stages} {'TMA' if tma else 'pointers'}"
                try:
                    us = timer.eager(functools.partial(launch, args, NT, H, K, V, BT, a.bv, stack, stages, tma))
                except Exception as e:  # a form that does not fit (shared memory) is reported, not fatal
                    print(f"{name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                print(f"{name}: {us:.1f} us, {us / NT:.3f} us a step ({us / walk:.3f} of today's walk)", flush=True)


if __name__ == "__main__":
    main()
