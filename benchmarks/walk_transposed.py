"""The state walk transposed, timed against the shipped walk on the same workspaces (an experiment).

    python benchmarks/walk_transposed.py [--shapes 1x16384x12,1x16384x32] [--check-only]

The shipped walk (`kda.ops.chunk_walk._walk`) keeps S [K, BV] in registers and takes it as the column operand
of `[Kd; Qd] S`, and D as that of `N D` and `M^T D`: a wgmma reads its column operand from shared memory, so
every step stages S and D there (a store, a fence, a barrier) before its dots. Transposed, S^T [BV, K] is the
row operand of every dot, and a wgmma may take its row operand from registers:

    X = S^T [Kd; Qd]^T   ([BV, 2 BT]: (Kd S)^T and (Qd S)^T)
    D^T = V^T - (Kd S)^T      O^T = (Qd S)^T + D^T N^T      S^T <- S^T diag(gt) + D^T M

with the workspace tiles (Kd, Qd, N, M) the column operands, read by TMA straight into shared memory: no
staging per step. BV = 64 (a wgmma's rows per warp group). The same fp16 operands and power-of-two scales as
the shipped walk. Dense batches of one sequence, fp16 workspaces, a K-first fp32 initial state.

Runs `chunk_kda` once per shape with the workspaces kept (the walk's own arguments recorded), then times the
shipped walk alone (its plain form, no prepare beside it) and the transposed one on them, and compares their
outputs and final states.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kda.ops.common import pow2_of, pow2_scale, round_to  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _walk_t_kernel(o, kd_ws, qd_ws, n_ws, m_ws, v, gt_ws, sc_ws, h0, hT, s_ot, s_vt, NT,
                   HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                   TMA: tl.constexpr):
    """One program per (V block of BV, value head), one dense sequence of NT whole chunks, on the shipped
    workspaces ([tokens, HV, *] fp16; with TMA, descriptors of them with [BT, 1, *] tiles). Four dots a step,
    S^T or D^T the row operand of each (from registers); M's product accumulates into S^T itself, N's into
    (Qd S)^T."""
    i_v = tl.program_id(0)
    i_hv = tl.program_id(1)
    o_v = i_v * BV + tl.arange(0, BV)
    o_k = tl.arange(0, K)
    o_t = tl.arange(0, BT)
    St = tl.load(h0 + i_hv * (K * V) + o_k[None, :] * V + o_v[:, None])  # S^T, K-first plane
    sc = sc_ws + i_hv * 4
    for c in range(NT):
        t0 = c * BT
        gt = tl.load(gt_ws + (c * HV + i_hv) * K + o_k)
        s_m = tl.load(sc + c * (HV * 4))
        s_n = tl.load(sc + c * (HV * 4) + 1)
        v_max = tl.load(sc + c * (HV * 4) + 2)
        vt = tl.load(v + (t0 + o_t[None, :]) * s_vt + i_hv * V + o_v[:, None]).to(tl.float32)  # V^T [BV, BT]
        if TMA:
            kd = tl.reshape(kd_ws.load([t0, i_hv, 0]), [BT, K])
            qd = tl.reshape(qd_ws.load([t0, i_hv, 0]), [BT, K])
            nt = tl.reshape(n_ws.load([t0, i_hv, 0]), [BT, BT])
            mt = tl.reshape(m_ws.load([t0, i_hv, 0]), [BT, K])
        else:
            rows = (t0 + o_t[:, None]) * HV + i_hv
            kd = tl.load(kd_ws + rows * K + o_k[None, :])
            qd = tl.load(qd_ws + rows * K + o_k[None, :])
            nt = tl.load(n_ws + rows * BT + o_t[None, :])
            mt = tl.load(m_ws + rows * K + o_k[None, :])
        ps = pow2_scale(St)
        Sr = (St * ps).to(tl.float16)
        inv_ps = 1.0 / ps
        pd = pow2_of(v_max + (K ** 0.5) * (32768.0 * inv_ps))
        Dr = (vt * pd - tl.dot(Sr, tl.trans(kd)) * (pd * inv_ps)).to(tl.float16)  # D^T, scaled
        inv_pd = 1.0 / pd
        cm = s_m * inv_pd  # powers of two: the accumulators scaled exactly
        cn = s_n * inv_pd
        St = tl.dot(Dr, mt, St * gt[None, :] * (1.0 / cm)) * cm
        Ot = tl.dot(Dr, tl.trans(nt), tl.dot(Sr, tl.trans(qd)) * (inv_ps / cn)) * cn
        tl.store(o + (t0 + o_t[None, :]) * s_ot + i_hv * V + o_v[:, None], round_to(Ot, o.dtype.element_ty))
    tl.store(hT + i_hv * (K * V) + o_k[None, :] * V + o_v[:, None], St)


def run_transposed(o, ws, h0, hT, HV, K, V, BT, tma: bool, warps=4, stages=2):
    n_ws, kd_ws, v, qd_ws, m_ws, gt_ws, sc_ws = ws
    NT = kd_ws.shape[0] // BT
    BV = 64
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        kd_a, qd_a, m_a = (TensorDescriptor.from_tensor(x, [BT, 1, K]) for x in (kd_ws, qd_ws, m_ws))
        n_a = TensorDescriptor.from_tensor(n_ws, [BT, 1, BT])
    else:
        kd_a, qd_a, n_a, m_a = kd_ws, qd_ws, n_ws, m_ws
    return lambda: _walk_t_kernel[(V // BV, HV)](
        o, kd_a, qd_a, n_a, m_a, v, gt_ws, sc_ws, h0, hT, o.stride(1), v.stride(1), NT, HV=HV, K=K, V=V, BT=BT,
        BV=BV, TMA=tma, num_warps=warps, num_stages=stages)


def capture(T, H, dev, seed=0):
    """One `chunk_kda` call (bf16 inputs, Kimi's gate, l2norm, beta sigmoid, K-first fp32 initial state) with the
    walk's arguments recorded: (walk thunk (plain, alone), raw workspaces, o, final state, h0, v)."""
    import kda
    import kda.ops.chunk as chunk

    g = torch.Generator(device="cpu").manual_seed(seed)
    K = V = 128

    def rn(*s, dt=torch.bfloat16):
        return torch.randn(*s, generator=g).to(dev, dt)

    q, k, v = rn(1, T, H, K), rn(1, T, H, K), rn(1, T, H, V)
    gg = rn(1, T, H, K, dt=torch.float32)
    beta = rn(1, T, H)
    h0 = (rn(1, H, K, V, dt=torch.float32) * 0.1).contiguous()
    kept = {}
    real_tiles, real_walk = chunk._walk_tiles, chunk._plain_walk

    def tiles(plan, walk_ws, BK):
        kept["ws"] = walk_ws
        return real_tiles(plan, walk_ws, BK)

    def walk(*a, **kw):
        kept["walk"] = (a, kw)
        return real_walk(*a, **kw)

    chunk._walk_tiles, chunk._plain_walk = tiles, walk
    try:
        from kda import replay

        replay.CAPACITY, cap = 0, replay.CAPACITY
        o, hT = kda.chunk_kda(q, k, v, gg, beta, initial_state=h0, output_final_state=True,
                              use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                              A_log=torch.zeros(H, device=dev), dt_bias=torch.zeros(H * K, device=dev),
                              lower_bound=-5.0)
        replay.CAPACITY = cap
    finally:
        chunk._walk_tiles, chunk._plain_walk = real_tiles, real_walk
    a, kw = kept["walk"]
    a = list(a)
    a[-1] = None  # ready: the walk alone, after the prepare
    return (lambda: real_walk(*a, **kw)), kept["ws"], o, hT, h0, v, a[1]  # a[1]: the plan


def rel(x, y):
    return ((x.float() - y.float()).norm() / y.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x4096x12,1x16384x12,1x65536x12,1x16384x32,1x8192x96")
    ap.add_argument("--check-only", action="store_true")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for spec in a.shapes.split(","):
        B, T, H = (int(x) for x in spec.split("x"))
        walk, ws, o_ref, h_ref, h0, v, st_plan = capture(T, H, dev)
        K = V = 128
        BT = 64
        o_ref = o_ref.clone()
        h_ref = h_ref.clone()
        line = [f"1x{T} H={H}"]
        for tma in ((False, True) if dev == "cuda" else (False,)):
            o = torch.empty_like(o_ref)
            hT = torch.empty_like(h_ref)
            for stages in ((2, 3) if dev == "cuda" else (1,)):
                tag = f"{'tma' if tma else 'ptr'} s{stages}"
                try:
                    f = run_transposed(o, ws, h0, hT, H, K, V, BT, tma, stages=stages)
                    f()
                    errs = f"o {rel(o, o_ref):.2e} state {rel(hT, h_ref):.2e}"
                    if dev == "cuda" and not a.check_only:
                        us = triton.testing.do_bench(f, warmup=25, rep=100) * 1e3
                        line.append(f"{tag} {us:.1f} us ({us / (T // BT):.3f} a step; {errs})")
                    else:
                        line.append(f"{tag}: {errs}")
                except Exception as e:  # noqa: BLE001
                    line.append(f"{tag}: {type(e).__name__}: {str(e)[:300]}")
        if dev == "cuda" and not a.check_only:
            us = triton.testing.do_bench(walk, warmup=25, rep=100) * 1e3
            plan = st_plan
            line.append(f"shipped walk alone (BV {plan.walk_BV}, {plan.walk_stages} stages) {us:.1f} us "
                        f"({us / (T // BT):.3f} a step)")
        print("\n  ".join(line), flush=True)


if __name__ == "__main__":
    main()
