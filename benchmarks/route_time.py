"""The threshold of `kda.plan.Tuning.short_len`: a mixed step of 256 sequences of L tokens and two of 2048 (H = 32,
K = V = 128, bf16 inputs, Kimi's gate, paged fp32 V-first pool of 4N slots, host bounds given), one
`chunk_kda` call with nothing routed (`short_len=0`) against every sequence of at most 64 tokens through
the recurrent loop kernel (`short_len=64`), for L = 1 to 64; CUDA-graph replay (`bench.Timer.graph`).
Also prints the relative difference of the two outputs (fp32 rounding, with bf16 outputs).

    python benchmarks/route_time.py      (a CUDA device)
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402

import kda  # noqa: E402
from kda.api import check_call_args  # noqa: E402
from kda.contract import check_call  # noqa: E402
from kda.ops.chunk import chunk_kda_fwd  # noqa: E402
from kda.plan import prefill_plan  # noqa: E402

H, N_SHORT, LONG = 32, 256, 2048


def main() -> None:
    dev = "cuda"
    timer = bench.Timer(warmup_ms=25, rep_ms=100)
    print("| L | nothing routed us | routed us | routed / nothing routed | rel diff of o |")
    print("|---|---|---|---|---|")
    for L in (1, 2, 4, 8, 16, 32, 64):
        lengths = [L] * N_SHORT + [LONG, LONG]
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        N = len(lengths)
        torch.manual_seed(0)
        q, k, v, g, beta, A_log, dt_bias = bench._tokens(1, bounds[-1], H, H, dev)
        pool = 0.1 * torch.randn(4 * N, H, 128, 128, device=dev)
        pool0 = pool.clone()
        kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                  A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                  cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=dev), cu_seqlens_cpu=bounds,
                  state_cache=pool, state_indices=torch.arange(0, 4 * N, 4, dtype=torch.int32, device=dev),
                  has_initial_state=torch.ones(N, dtype=torch.bool, device=dev), state_v_first=True)
        positional, keywords = check_call_args(kda.chunk_kda, q, k, v, g, beta, **kw)
        call = check_call(*positional, **keywords)
        plans = [prefill_plan(call, short_len=s) for s in (0, 64)]
        outs = []
        for plan in plans:  # each from the same pool
            pool.copy_(pool0)
            outs.append(chunk_kda_fwd(call, *plan)[0].float())
        times = [timer.graph(lambda plan=plan, call=call: chunk_kda_fwd(call, *plan)) for plan in plans]
        diff = ((outs[0] - outs[1]).norm() / outs[0].norm()).item()
        print(f"| {L} | {times[0]:.1f} | {times[1]:.1f} | {times[1] / times[0]:.2f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
