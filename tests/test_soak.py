"""A short serving soak: requests are admitted into a poisoned pool, prefilled in chunks,
decoded, preempted and finished over many steps; each step is one `chunk_kda` varlen call (prefill chunks
and one-token decodes mixed, as an engine batches them) or, when only decodes are left, one
`fused_recurrent_kda` call. A float64 shadow pool runs the same calls through the oracle. After every step:
outputs and every live slot within fp32 rounding of the shadow, every free slot bitwise unchanged.

40 steps in the suite; `KDA_SOAK_STEPS=5000` runs the long soak (on the GPU machine)."""

from __future__ import annotations

import os
import random

import torch
from conftest import DEVICE
from helpers import bits, bounds_of, make_inputs, on_cpu, poison_pool, rel_err

import kda
import kda_reference as ref

H, HV, K, V, SLOTS = 1, 2, 16, 16, 6
TOL = 2e-5  # fp32 against float64, after up to a few hundred tokens of recurrence
STEPS = int(os.environ.get("KDA_SOAK_STEPS", "40"))


def test_serving_soak_against_a_float64_shadow():
    rng = random.Random(7)
    pool = poison_pool(SLOTS, (HV, V, K), torch.float32, DEVICE)
    shadow = pool.cpu().double()
    requests = {}  # slot -> [tokens left to prefill, tokens left to decode, started]
    for step in range(STEPS):
        free = [s for s in range(SLOTS) if s not in requests]
        for s in free[: rng.randint(0, 2)]:  # admit
            requests[s] = [rng.randint(1, 150), rng.randint(0, 6), False]
        if requests and rng.random() < 0.1:  # preempt one: its slot is freed, its state no longer live
            del requests[rng.choice(sorted(requests))]
        live = sorted(requests)
        if not live:
            continue
        lengths = [min(requests[s][0], 64) if requests[s][0] > 0 else 1 for s in live]
        prefilling = any(requests[s][0] > 0 for s in live)
        bounds = bounds_of(lengths)
        q, k, v, g, beta, kw = make_inputs(1, bounds[-1], H, HV, K, V, device=DEVICE, seed=step)
        idx = torch.tensor(live, dtype=torch.int32, device=DEVICE)
        has = torch.tensor([requests[s][2] for s in live], device=DEVICE)
        args = dict(state_cache=pool, state_indices=idx, has_initial_state=has, state_v_first=True,
                    cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=DEVICE))
        before = pool.clone()
        if prefilling:
            o, _ = kda.chunk_kda(q, k, v, g, beta, **args, **kw)
        else:  # decodes only: the decode kernel, [N, 1] tokens as an engine lays them out
            dense = {n: x.view(len(live), 1, *x.shape[2:]) for n, x in dict(q=q, k=k, v=v, g=g, beta=beta).items()}
            args.pop("cu_seqlens")
            o, _ = kda.fused_recurrent_kda(**dense, **args, **kw)
            o = o.view(1, len(live), HV, V)
        ro, _ = ref.recurrent_kda(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(),
                                  **{**on_cpu(args), "state_cache": shadow,
                                     "cu_seqlens": torch.tensor(bounds)}, allow_float64=True, **on_cpu(kw))
        assert rel_err(o, ro) < TOL, step
        for s in range(SLOTS):
            if s in requests:
                assert rel_err(pool[s], shadow[s]) < TOL, (step, s)
            else:
                assert torch.equal(bits(pool[s]), bits(before[s])), (step, s)
        for s, n in zip(live, lengths):  # advance, finish
            r = requests[s]
            r[2] = True
            if r[0] > 0:
                r[0] -= n
            else:
                r[1] -= 1
            if r[0] <= 0 and r[1] <= 0:
                del requests[s]
