"""Quick GPU check of chunk_kda: accuracy at the issue-3 shape against a float64 recurrence, and the eager
time of that call. Kernel times: scripts/profile_chunk.py; beside fla: python -m kda.bench."""

import torch
import triton

import kda


def oracle(q, k, v, g, beta, scale, h0):
    # vectorised float64 recurrence over heads: q,k [T,H,K] (already normalised), g [T,HV,K] log-decay
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    rep = HV // H
    q, k = q.double().repeat_interleave(rep, 1), k.double().repeat_interleave(rep, 1)
    v, g, beta = v.double(), g.double(), beta.double()
    S = h0.double().clone()
    o = torch.empty(T, HV, V, dtype=torch.float64, device=q.device)
    for t in range(T):
        S = S * g[t].exp()[..., None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
        S = S + k[t][..., None] * u[:, None, :]
        o[t] = torch.einsum("hkv,hk->hv", S, q[t] * scale)
    return o, S


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def case(T, H, dtype=torch.bfloat16, lb=-5.0):
    torch.manual_seed(0)
    K = V = 128
    dev = "cuda"
    q = torch.randn(1, T, H, K, device=dev, dtype=dtype)
    k = torch.randn(1, T, H, K, device=dev, dtype=dtype)
    v = torch.randn(1, T, H, V, device=dev, dtype=dtype)
    graw = torch.randn(1, T, H, K, device=dev)
    A_log = torch.randn(H, device=dev) * 0.5
    dt_bias = torch.randn(H * K, device=dev) * 0.5
    beta = torch.randn(1, T, H, device=dev)
    h0 = torch.randn(1, H, K, V, device=dev) * 0.1
    kw = dict(
        use_gate_in_kernel=True,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lb,
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
    )
    o, s = kda.chunk_kda(q, k, v, graw, beta, initial_state=h0, output_final_state=True, **kw)
    torch.cuda.synchronize()
    qn = q[0].double() / (q[0].double().pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    kn = k[0].double() / (k[0].double().pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    x = graw[0].double() + dt_bias.double().view(H, K)
    g = lb * torch.sigmoid(A_log.double().exp()[:, None] * x)
    ro, rs = oracle(qn, kn, v[0], g, torch.sigmoid(beta[0].double()), K**-0.5, h0[0])
    floor = rel(ro.to(dtype), ro)
    print(f"T={T} H={H}: out rel {rel(o[0], ro):.3e} (floor {floor:.3e})  state rel {rel(s[0], rs):.3e}", flush=True)
    ms = triton.testing.do_bench(
        lambda: kda.chunk_kda(q, k, v, graw, beta, initial_state=h0, output_final_state=True, **kw),
        return_mode="median",
    )
    print(f"   eager median {ms * 1000:.0f} us", flush=True)


if __name__ == "__main__":
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    case(1024, 4)
    case(16384, 4)
