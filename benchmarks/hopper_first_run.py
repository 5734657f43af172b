"""First GPU run of a Gluon prepare form (default v8): where it disagrees with its tl twin, by name. GPU (sm_90).

    python3 benchmarks/hopper_first_run.py [--form v8] [--timeout 240] [--budget 540] [--only prims,dense-1x1024,...]
    python3 benchmarks/hopper_first_run.py --compile-only   # no GPU: the prims kernel compiled for sm_90

Every case runs in its own subprocess with a timeout (a hung kernel costs one case, never the GPU call), and prints
one block:
- `prims`: v8's building blocks alone in one small kernel, each against torch: the B tiles stored from the
  tensor-core operand layout (stmatrix) and read back (`rt_b32`, `rt_b16`), the tf32 product with register A
  (`mma_tf32`), the fp16 product against the sliced B tile (`mma_f16_slice`), `_v8_cat` (`cat`), `_v8_row`
  (`row`). A wrong one names the primitive behind any workspace failure below.
- the prepare cases (dense, a partial last chunk, a one-token chunk, varlen with routed sequences with and
  without host bounds, H = 32 beside the walk), FOLD off and on: the same call under the twin's plan and the
  Gluon one, the prepare's workspaces captured (filled with NaN before it, so a row one kernel writes and the
  other does not shows up), compared per tensor and per (chunk, head) tile, the scales divided out (a power of
  two that differs only rescales): Qd, Kd, and with FOLD off Kr (M's rows), A_qk (N's rows), Xb (x_ws),
  with FOLD on M, N; the scale words sc0, sc1, sc2 (max|V|). A tile's error is max|gluon - twin| / max|twin|
  over the tile; per region (row half x column half of a [BT, BT] tile, row half x K slice of a [BT, K] one).
Reading it: `OK` under TOL everywhere; `BAD` gives the worst region, the count of bad tiles, and the first bad
tile (sequence, chunk, head, region) with its worst elements. `one-sided` counts elements written by one
kernel only (a store mask or a missed store). The last line says ALL OK or lists the failing (case, tensor)s.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kda.ops import hopper_prepare as hp  # noqa: E402

FORMS = {"v4": {}, "v5": {"num_warps": 8}, "v6": {"num_warps": 8, "maxnreg": 128},
         "v7": {"num_warps": 8, "programs": 132}, "v8": {"form": "v8"}}  # as tests/test_gpu_hopper.py's
# KDA_FIRST_RUN_DRY=1 (a check of this harness on the CPU, under TRITON_INTERPRET=1): inputs on the CPU and the
# twin on both sides, so every tensor must compare exactly
DRY = os.environ.get("KDA_FIRST_RUN_DRY") == "1"
DEV = "cpu" if DRY else "cuda"
TOL = 1e-2  # tile-relative; the forms that ran were ~1e-3 at most at this level (fp16 workspaces, tf32 products)
BT = 64
CASES = {  # name: (B, T, H, lengths, host bounds), in the order they run
    "dense-1x1024": (1, 1024, 4, None, False),
    "one-token-1x65": (1, 65, 4, None, False),  # the last chunk one token
    "dense-2x1000": (2, 1000, 4, None, False),  # a partial last chunk (40 rows) in each sequence
    "varlen-routed": (1, 2900, 4, [1, 0, 700, 5, 64, 65, 1000, 1, 17, 1047], False),
    "varlen-routed-host": (1, 2900, 4, [1, 0, 700, 5, 64, 65, 1000, 1, 17, 1047], True),  # SHORT > 0: _kept_chunk
    "beside-walk-h32": (1, 4096, 32, None, False),
}


# ---------------------------------------------------------------------------------------------------------- prims
@gluon.jit
def _prims_kernel(x_ptr, y_ptr, kk_ptr, ll_ptr, rt_ptr, rt16_ptr, cat_ptr, row_ptr):
    """v8's primitives on one [64, 32] pair x, y (fp32, tf32-exact; the layouts and helpers are v8's)."""
    BT: gl.constexpr = 64
    BK: gl.constexpr = 32
    HALF: gl.constexpr = 32
    P: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
                                                 lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                                 warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BT, BK])
    PROW: gl.constexpr = gl.SliceLayout(1, P)
    PCOL: gl.constexpr = gl.SliceLayout(0, P)
    PA: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 0]],
                                                  lane_bases=[[0, 8], [0, 16], [0, 0], [0, 0], [0, 0]],
                                                  warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[1, BK])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 8])
    MMA16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 16])
    A16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA16, k_width=2)
    MMA64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 8])
    A64: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA64, k_width=1)
    S_SLICE: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    S_SLICE16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    S_ANC: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    ANC: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [1, 4], [1, 0])

    r = gl.arange(0, BT, layout=PROW)[:, None]
    c = gl.arange(0, BK, layout=PCOL)[None, :]
    x = gl.load(x_ptr + r * BK + c)
    y = gl.load(y_ptr + r * BK + c)
    b_s = gl.allocate_shared_memory(gl.float32, [BT, BK], S_SLICE)
    b16_s = gl.allocate_shared_memory(gl.float16, [BT, BK], S_SLICE16)
    b_s.store(hp._v8_op(y, A64))
    b16_s.store(hp._v8_op16(y.to(gl.float16), A16))
    fence_async_shared()
    kk = warpgroup_mma(hp._v8_op(x, A64), b_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, layout=MMA64),
                       is_async=True)
    ll = warpgroup_mma(hp._v8_op16(x.to(gl.float16), A16), b16_s.slice(0, HALF).permute((1, 0)),
                       gl.zeros([BT, HALF], gl.float32, layout=MMA16), is_async=True)
    kk, ll = warpgroup_mma_wait(num_outstanding=0, deps=(kk, ll))
    rm = gl.arange(0, BT, layout=gl.SliceLayout(1, MMA64))[:, None]
    cm = gl.arange(0, BT, layout=gl.SliceLayout(0, MMA64))[None, :]
    gl.store(kk_ptr + rm * BT + cm, kk)
    r16 = gl.arange(0, BT, layout=gl.SliceLayout(1, MMA16))[:, None]
    c16 = gl.arange(0, HALF, layout=gl.SliceLayout(0, MMA16))[None, :]
    gl.store(ll_ptr + r16 * HALF + c16, ll)
    gl.store(rt_ptr + r * BK + c, b_s.load(P))
    gl.store(rt16_ptr + r * BK + c, b16_s.load(P))
    cat = hp._v8_cat(gl.convert_layout(ll, MMA), gl.zeros([BT, HALF], gl.float32, layout=MMA), MMA64)
    gl.store(cat_ptr + rm * BT + cm, cat)
    a_s = gl.allocate_shared_memory(gl.float32, [8, BK], S_ANC)
    ra = gl.arange(0, 8, layout=gl.SliceLayout(1, ANC))[:, None]
    ca = gl.arange(0, BK, layout=gl.SliceLayout(0, ANC))[None, :]
    a_s.store(gl.load(x_ptr + ra * BK + ca))
    for i in gl.static_range(4):
        row = hp._v8_row(a_s, i, PA, PCOL)[None, :] + gl.zeros([BT, BK], gl.float32, layout=P)
        gl.store(row_ptr + i * BK + c + r * 0, row, mask=(r == 0) & (c >= 0))


def _perm32(col):
    """`_v8_op`'s relabelling: channel 8 t + j at column 4 j + t."""
    t, j = divmod(col, 8)
    return 4 * j + t


def _perm16(col):
    """`_v8_op16`'s: channel 16 a + 8 b + 4 c + 2 d + e at column 16 c + 8 d + 4 a + 2 b + e."""
    a, b, c, d, e = (col >> 4) & 1, (col >> 3) & 1, (col >> 2) & 1, (col >> 1) & 1, col & 1
    return 16 * c + 8 * d + 4 * a + 2 * b + e


def prims() -> list[str]:
    import torch

    gen = torch.Generator().manual_seed(0)

    def tf32(t):  # exact in tf32 and fp16 (integers over 64): every product below is exact
        return (torch.randint(-512, 512, t, generator=gen).double() / 64).float()

    x, y = tf32((64, 32)).cuda(), tf32((64, 32)).cuda()
    out = {n: torch.full(s, float("nan"), device="cuda", dtype=d) for n, s, d in (
        ("kk", (64, 64), torch.float32), ("ll", (64, 32), torch.float32), ("rt", (64, 32), torch.float32),
        ("rt16", (64, 32), torch.float16), ("cat", (64, 64), torch.float32), ("row", (4, 32), torch.float32))}
    _prims_kernel[(1,)](x, y, out["kk"], out["ll"], out["rt"], out["rt16"], out["cat"], out["row"], num_warps=4)
    torch.cuda.synchronize()
    xd, yd = x.double().cpu(), y.double().cpu()
    p32 = torch.tensor([_perm32(c) for c in range(32)])
    p16 = torch.tensor([_perm16(c) for c in range(32)])
    rt_want, rt16_want = torch.empty_like(yd), torch.empty_like(yd)
    rt_want[:, p32] = yd
    rt16_want[:, p16] = yd
    ll_want = xd @ yd[:32].T
    want = {"rt_b32": (out["rt"], rt_want), "rt_b16": (out["rt16"], rt16_want), "mma_tf32": (out["kk"], xd @ yd.T),
            "mma_f16_slice": (out["ll"], ll_want), "cat": (out["cat"], torch.cat([ll_want, 0 * ll_want], 1)),
            "row": (out["row"], xd[:4])}
    bad = []
    for name, (got, ref) in want.items():
        got = got.double().cpu()
        err = (got - ref).abs()
        wrong = ~(err <= 1e-6 * (1 + ref.abs()))  # NaN counts as wrong
        if wrong.any():
            i, j = [int(v) for v in wrong.nonzero()[0]]
            rows = sorted({int(v) for v in wrong.nonzero()[:, 0]})
            cols = sorted({int(v) for v in wrong.nonzero()[:, 1]})
            print(f"  {name:14s} BAD: {int(wrong.sum())}/{wrong.numel()} wrong; rows {_ranges(rows)} cols "
                  f"{_ranges(cols)}; first ({i}, {j}) got {got[i, j].item():.6g} want {ref[i, j].item():.6g}")
            bad.append(f"prims:{name}")
        else:
            print(f"  {name:14s} OK (exact)")
    return bad


def _ranges(v: list[int]) -> str:
    out, s = [], None
    for a, b in zip(v, v[1:] + [None]):
        s = a if s is None else s
        if b != a + 1:
            out.append(f"{s}" if s == a else f"{s}-{a}")
            s = None
    return ",".join(out[:8]) + (",..." if len(out) > 8 else "")


# ---------------------------------------------------------------------------------------------- prepare workspaces
def _inputs(B, T, H, lengths, host, seed):
    import torch
    from helpers import make_inputs

    q, k, v, g, beta, kw = make_inputs(B, T, H, H, 128, 128, dtype=torch.bfloat16, gate="lower_bound", device=DEV,
                                       seed=seed, normalize_k=False, beta_sigmoid=True)
    kw["use_qk_l2norm_in_kernel"] = True
    N = B
    if lengths is not None:
        N = len(lengths)
        cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=DEV)
        if host:
            kw["cu_seqlens_cpu"] = torch.tensor(cu, dtype=torch.int32)
    h0 = 0.1 * torch.randn(N, H, 128, 128, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed))
    return (q, k, v, g, beta), h0, kw


def _sync():
    import torch

    if not DRY:
        torch.cuda.synchronize()


def _captured_run(args, h0, kw, overrides):
    """The call under `overrides`, its prepare's workspaces captured (NaN-filled before the gate pass)."""
    from helpers import run_planned

    import kda
    import kda.ops.chunk as C

    got = {}
    real = C._prepare

    def capture(call, plan, inputs, ws, *a, **k):
        for t in ws:
            if t.is_floating_point():
                t.fill_(float("nan"))
        real(call, plan, inputs, ws, *a, **k)
        _sync()
        got["ws"] = [t.clone() for t in ws]
        got["plan"] = plan

    C._prepare = capture
    try:
        o, s, plan = run_planned(kda.chunk_kda, *args, overrides, initial_state=h0, output_final_state=True, **kw)
        _sync()
    finally:
        C._prepare = real
    return got, o, s, plan


def _tiles(B, T, lengths):
    """Per token row of the workspaces: (sequence, chunk in it, row in chunk, sc row), and the varlen flag."""
    import torch

    if lengths is None:
        NT = -(-T // BT)
        t = torch.arange(B * T)
        seq, pos = t // T, t % T
        return seq, pos // BT, pos % BT, seq * NT + pos // BT
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    seq = torch.empty(cu[-1], dtype=torch.long)
    pos = torch.empty(cu[-1], dtype=torch.long)
    prog = torch.empty(cu[-1], dtype=torch.long)
    for n in range(len(lengths)):
        a, b = cu[n], cu[n + 1]
        seq[a:b] = n
        pos[a:b] = torch.arange(b - a)
        prog[a:b] = a // BT + n + torch.arange(b - a) // BT
    return seq, pos // BT, pos % BT, prog


def compare(name, a, b, seq, chk, row, width_bt) -> bool:
    """a (gluon), b (twin): [tokens, HV, C] float64 on the CPU, unscaled. Prints one line (and the first bad tile);
    returns whether it is OK."""
    import warnings

    import torch

    warnings.filterwarnings("ignore", message="index_reduce")
    na, nb = torch.isnan(a), torch.isnan(b)
    one_sided = int((na ^ nb).sum())
    both = ~(na | nb)
    err = torch.where(both, (a - b).abs(), torch.zeros_like(a))
    err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)  # inf - inf
    ref = torch.where(both, b.abs(), torch.zeros_like(b))
    C = a.shape[2]
    # tile id per token: (sequence, chunk); per (tile, head) the scale max|twin|
    key = seq * 100000 + chk
    uniq, tid = torch.unique(key, return_inverse=True)
    nt, HV = len(uniq), a.shape[1]
    scale = torch.zeros(nt, HV, dtype=torch.float64).index_reduce_(0, tid, ref.amax(2), "amax", include_self=True)
    rel = err / scale[tid].clamp_min(1e-30)[:, :, None]
    rel = torch.where(err == 0, torch.zeros_like(rel), rel)
    half = (row >= BT // 2).long()
    cols = torch.arange(C)
    cgrp = (cols >= BT // 2).long() if width_bt else cols // 32
    ncg = 2 if width_bt else C // 32
    reg_names = [f"{'top' if h == 0 else 'bottom'} rows x {('left' if g == 0 else 'right') if width_bt else f'K{g}'}"
                 for h in range(2) for g in range(ncg)]
    worst = []
    for h in range(2):
        for g in range(ncg):
            sel = rel[half == h][:, :, cgrp == g]
            worst.append(sel.max().item() if sel.numel() else 0.0)
    tile_err = torch.zeros(nt, HV, dtype=torch.float64).index_reduce_(0, tid, rel.amax(2), "amax",
                                                                      include_self=True)
    onesided_tok = (na ^ nb).any(2).any(1)
    n_bad = int((tile_err > TOL).sum())
    ok = n_bad == 0 and one_sided == 0
    per = " ".join(f"{w:.1e}" for w in worst)
    print(f"  {name:8s} {'OK ' if ok else 'BAD'} worst {max(worst):.2e} | by region [{', '.join(reg_names)}]: {per}"
          f" | bad tiles {n_bad}/{nt * HV} | one-sided {one_sided}", flush=True)
    if not ok:
        bad_tok = ((rel > TOL).any(2).any(1)) | onesided_tok
        t0 = int(bad_tok.nonzero()[0])
        sel = (seq == seq[t0]) & (chk == chk[t0])
        toks = sel.nonzero()[:, 0]
        hv = int(((rel[t0] > TOL).any(1) | (na[t0] ^ nb[t0]).any(1)).nonzero()[0])
        sub_rel, sub_a, sub_b = rel[toks, hv], a[toks, hv], b[toks, hv]
        bad_rows = sorted({int(row[toks[i]]) for i in ((sub_rel > TOL) | (torch.isnan(sub_a) ^ torch.isnan(sub_b)))
                           .any(1).nonzero()[:, 0]})
        bad_cols = sorted({int(c) for c in ((sub_rel > TOL) | (torch.isnan(sub_a) ^ torch.isnan(sub_b)))
                           .any(0).nonzero()[:, 0]})
        tile_reg = []
        for h in range(2):
            for g in range(ncg):
                sel = sub_rel[(row[toks] >= BT // 2) == bool(h)][:, cgrp == g]
                tile_reg.append(f"{sel.max().item():.1e}" if sel.numel() else "-")
        print(f"    first bad tile: sequence {int(seq[t0])} chunk {int(chk[t0])} head {hv} ({len(toks)} rows): "
              f"bad rows {_ranges(bad_rows)}, bad columns {_ranges(bad_cols)}; by region {' '.join(tile_reg)}",
              flush=True)
        side = (torch.isnan(sub_a) ^ torch.isnan(sub_b)).nonzero()[:3].tolist()
        worst_el = [divmod(f, C) for f in sub_rel.flatten().argsort(descending=True)[:3].tolist()]
        for i, j in [*side, *worst_el][:4]:
            print(f"      row {int(row[toks[i]])} col {j}: gluon {sub_a[i, j].item():.6g} "
                  f"twin {sub_b[i, j].item():.6g}", flush=True)
    return ok


def prepare_case(name: str, form: str) -> list[str]:
    import torch
    from helpers import rel_err

    import kda.ops.chunk as C

    B, T, H, lengths, host = CASES[name]
    args, h0, kw = _inputs(B, T, H, lengths, host, seed=T)
    seq, chk, row, prog = _tiles(B, T, lengths)
    bad = []
    for fold in (False, True):
        twin, o_t, s_t, tplan = _captured_run(args, h0, kw, {"fold": fold})
        assert tplan.prepare == "fused", tplan.prepare
        C.HOPPER_VARIANT.clear()
        C.HOPPER_VARIANT.update(FORMS[form])
        try:
            t_start = time.time()
            glu, o_h, s_h, hplan = _captured_run(args, h0, kw, {"fold": fold} if DRY else
                                                 {"prepare": "hopper", "fold": fold})
        finally:
            C.HOPPER_VARIANT.clear()
        print(f" fold={'on' if fold else 'off'} (BT {hplan.BT} BC {hplan.BC} BK {hplan.prepare_BK} wait_chunks "
              f"{hplan.wait_chunks} late {hplan.late_chunks}; gluon call {time.time() - t_start:.1f} s with compile): "
              f"o vs twin {rel_err(o_h, o_t):.2e}, state vs twin {rel_err(s_h, s_t):.2e}, nan "
              f"{bool(torch.isnan(o_h).any() or torch.isnan(s_h).any())}", flush=True)
        kd_g, qd_g, m_g, n_g, _, sc_g, x_g = (t.double().cpu() for t in glu["ws"])
        kd_t, qd_t, m_t, n_t, _, sc_t, x_t = (t.double().cpu() for t in twin["ws"])
        sc_g_tok, sc_t_tok = sc_g[prog], sc_t[prog]  # [tokens, HV, 4]: the chunk's scale words per token row
        if fold:  # M = ws * sc0, N = ws * sc1
            items = [("Qd", qd_g, qd_t, False), ("Kd", kd_g, kd_t, False),
                     ("M", m_g * sc_g_tok[:, :, :1], m_t * sc_t_tok[:, :, :1], False),
                     ("N", n_g * sc_g_tok[:, :, 1:2], n_t * sc_t_tok[:, :, 1:2], True)]
        else:  # Kr in M's rows, A_qk in N's, Xb px in x_ws (1 / px in sc0)
            items = [("Qd", qd_g, qd_t, False), ("Kd", kd_g, kd_t, False), ("Kr", m_g, m_t, False),
                     ("A_qk", n_g, n_t, True), ("Xb", x_g * sc_g_tok[:, :, :1], x_t * sc_t_tok[:, :, :1], True)]
        for nm, a, b, wide in items:
            if not compare(nm, a, b, seq, chk, row, wide):
                bad.append(f"{name}:fold={fold}:{nm}")
        # the scale words of the chunks that have programs (NaN in both where none wrote)
        for w, what in ((0, "1/pm" if fold else "1/px"), (1, "1/pn" if fold else "max row sum |Xb|"), (2, "max|V|")):
            a, b = sc_g[:, :, w], sc_t[:, :, w]
            both = ~(torch.isnan(a) | torch.isnan(b))
            one = int((torch.isnan(a) ^ torch.isnan(b)).sum())
            r = (a[both] / b[both]).abs()
            r = r[torch.isfinite(r)]
            lo, hi = (r.min().item(), r.max().item()) if r.numel() else (float("nan"), float("nan"))
            pow2 = w == 0 or (w == 1 and fold)  # a power of two: a factor 2 off is a rounding at a boundary
            ok = one == 0 and (r.numel() == 0 or (0.25 <= lo and hi <= 4.0 if pow2 else
                                                   1 - TOL <= lo and hi <= 1 + TOL))
            print(f"  sc{w} ({what}) {'OK ' if ok else 'BAD'} gluon/twin ratio in [{lo:.4g}, {hi:.4g}] over "
                  f"{int(both.sum())} chunk-heads, one-sided {one}", flush=True)
            if not ok:
                bad.append(f"{name}:fold={fold}:sc{w}")
    return bad


# ------------------------------------------------------------------------------------------------------- drivers
def child(case: str, form: str) -> int:
    import torch
    import triton

    print(f"[{case}] torch {torch.__version__} triton {triton.__version__} "
          f"{'DRY (CPU, the twin both sides)' if DRY else torch.cuda.get_device_name()} form "
          f"{form}", flush=True)
    bad = prims() if case == "prims" else prepare_case(case, form)
    print(f"[{case}] RESULT {'OK' if not bad else 'BAD ' + ' '.join(bad)}", flush=True)
    return 0 if not bad else 1


def compile_only() -> None:
    """The prims kernel compiled for sm_90 without a GPU (a check of this file where there is none)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {n: "*fp32" for n in ("x_ptr", "y_ptr", "kk_ptr", "ll_ptr", "rt_ptr", "cat_ptr", "row_ptr")}
    sig["rt16_ptr"] = "*fp16"
    sig = {n: sig[n] for n in _prims_kernel.arg_names}
    k = triton.compile(GluonASTSource(_prims_kernel, sig), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4})
    print("prims kernel compiled for sm_90:", k.metadata.num_regs if hasattr(k.metadata, "num_regs") else "",
          "registers;", k.metadata.shared, "bytes of shared memory")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--form", default="v8")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds a case may take (compiles included)")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for all cases: none starts past it")
    ap.add_argument("--only", default="", help="comma-separated cases (prims, " + ", ".join(CASES) + ")")
    ap.add_argument("--child", default="")
    ap.add_argument("--compile-only", action="store_true")
    a = ap.parse_args()
    if a.compile_only:
        compile_only()
        return 0
    if a.child:
        return child(a.child, a.form)
    cases = a.only.split(",") if a.only else ["prims", *CASES]
    failed, start = [], time.time()
    for case in cases:
        t0 = time.time()
        left = a.budget - (t0 - start)
        if left < 20:
            print(f"[{case}] SKIPPED: the budget of {a.budget:.0f} s is spent", flush=True)
            failed.append(f"{case}(skipped)")
            continue
        try:
            p = subprocess.run([sys.executable, __file__, "--child", case, "--form", a.form],
                               timeout=min(a.timeout, left), cwd=ROOT)
            if p.returncode:
                failed.append(f"{case}(rc {p.returncode})")
        except subprocess.TimeoutExpired:
            print(f"[{case}] TIMEOUT after {min(a.timeout, left):.0f} s: killed (a hang: a wait, a barrier or a spin)",
                  flush=True)
            failed.append(f"{case}(timeout)")
        print(f"[{case}] {time.time() - t0:.1f} s", flush=True)
    print("ALL OK" if not failed else "FAILED: " + " ".join(failed), flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
