"""Accuracy of a walk with one dot on the state's chain, emulated on CPU.

Per 64-token chunk (kda_reference.chunk: W, U0, A_qk, Qs = scale exp(b) q, Kr = exp(b_C - b) k, gt = exp(b_C)):
  two-dot walk (today's folded walk):  D = V - Kd S;  O = Qd S + N D;  S' = gt S + M^T D
                                        (Kd = exp(b) k, Xb = INV diag(beta), N = A_qk Xb, M = Xb^T Kr)
  one-dot walk:                         O = Q' S + E;  S' = P S + B
                                        (P = diag(gt) - Kr^T W, B = Kr^T U0, Q' = Qs - A_qk W, E = A_qk U0)
Operands of every dot rounded to fp16 with a power-of-two scale per tile (as the kernels' fp16 workspaces), products
accumulated in fp32; S carried in fp32. Errors: relative L2 against the float64 oracle, output and final state,
one head, K = V = 128, the accuracy harness's regime and adversarial inputs in bf16. Forms: "one" rounds all of P to
fp16; "oner" keeps P's diagonal (the decay) in fp32 and rounds R = -Kr^T W: S' = gt S + R S + B; "B,E fp32/fp16" is
how the additive terms are stored.

    python benchmarks/one_dot_walk_study.py [T] [CASE,...]      (CPU, float64; about 10 s per case at T = 2048)
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kda.accuracy.config import REGIMES  # noqa: E402
from kda.accuracy.inputs import adversarial_inputs, regime_inputs  # noqa: E402
from kda_reference.chunk import chunk_sequence  # noqa: E402
from kda_reference.preprocess import prepare_inputs  # noqa: E402

D64 = torch.float64


def f16(x):
    """x rounded to fp16 after a power-of-two scale that puts its largest entry in [2^14, 2^15)."""
    m = x.abs().max()
    if m == 0:
        return x
    e = torch.floor(torch.log2(m)) - 14
    return (x / 2.0**e).to(torch.float16).to(D64) * 2.0**e


def f32(x):
    return x.to(torch.float32).to(D64)


def dot(a, b):
    return f32(f16(a) @ f16(b))


def chunk_mats(q, k, v, g, beta, scale):
    C = v.shape[0]
    b = torch.cumsum(g, 0)
    tri = torch.ones(C, C, dtype=torch.bool).tril()
    dec = torch.exp((b[:, None, :] - b[None, :, :]).masked_fill(~tri[:, :, None], -torch.inf))
    A_kk = (beta[:, None] * (k[:, None, :] * k[None, :, :] * dec).sum(-1)).tril(-1)
    A_qk = scale * (q[:, None, :] * k[None, :, :] * dec).sum(-1)
    eye = torch.eye(C, dtype=D64)
    INV = torch.linalg.solve_triangular(eye + A_kk, eye, upper=False, unitriangular=True)
    Xb = INV * beta[None, :]
    Kd = torch.exp(b) * k
    W = Xb @ Kd
    U0 = Xb @ v
    Qs = scale * torch.exp(b) * q
    Kr = torch.exp(b[-1] - b) * k
    gt = torch.exp(b[-1])
    return dict(Kd=Kd, Qd=Qs, N=A_qk @ Xb, M=Xb.T @ Kr, gt=gt, P=torch.diag(gt) - Kr.T @ W, R=-(Kr.T @ W), B=Kr.T @ U0,
                Qp=Qs - A_qk @ W, E=A_qk @ U0, v=v)


def walk(q, k, v, g, beta, scale, S, form, b_fp32=True):
    T = v.shape[0]
    o = torch.empty_like(v)
    for s in range(0, T, 64):
        e = min(s + 64, T)
        m = chunk_mats(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], scale)
        if form == "two":
            D = f32(m["v"] - dot(m["Kd"], S))
            o[s:e] = f32(dot(m["Qd"], S) + dot(m["N"], D))
            S = f32(m["gt"][:, None] * S + dot(m["M"].T, D))
        elif form == "oner":
            Bm = f32(m["B"]) if b_fp32 else f16(m["B"])
            Em = f32(m["E"]) if b_fp32 else f16(m["E"])
            o[s:e] = f32(dot(m["Qp"], S) + Em)
            S = f32(m["gt"][:, None] * S + dot(m["R"], S) + Bm)
        else:
            Bm = f32(m["B"]) if b_fp32 else f16(m["B"])
            Em = f32(m["E"]) if b_fp32 else f16(m["E"])
            o[s:e] = f32(dot(m["Qp"], S) + Em)
            S = f32(dot(m["P"], S) + Bm)
    return o, S


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def main():
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    K = V = 128
    cases = [(n, lambda gen, r=r: regime_inputs(r, 1, T, 1, 1, K, V, gen)) for n, r in REGIMES.items()]
    cases += [(n, lambda gen, n=n: adversarial_inputs(n, 1, T, 1, 1, K, V, gen))
              for n in ("weak_decay", "correlated_keys", "large_values", "strong_decay")]
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    for name, make in cases:
        if only and name not in only:
            continue
        gen = torch.Generator().manual_seed(0)
        x = make(gen).cast(torch.bfloat16)
        q, k, v, g, beta = prepare_inputs(x.q, x.k, x.v, x.g, x.beta, **x.opts)
        q, k, v, g, beta = (t[0, :, 0] for t in (q, k, v, g, beta))
        S0 = torch.zeros(K, V, dtype=D64)
        scale = K ** -0.5
        ro, rs = chunk_sequence(q, k, v, g, beta, scale, S0)
        line = [f"{name:15s} T={T}"]
        for form, bf in (("two", True), ("one", True), ("oner", True), ("oner", False)):
            o, s = walk(q, k, v, g, beta, scale, S0, form, bf)
            tag = form + ("" if form == "two" else (" B,E fp32" if bf else " B,E fp16"))
            line.append(f"{tag}: o {rel(o, ro):.2e} s {rel(s, rs):.2e}")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
