"""CPU check (no GPU) of hopper_prepare v8's register relabellings under Triton 3.6's own layouts:

    /work/venv36/bin/python benchmarks/v8_layouts.py

Each layout's (register, lane, warp) -> (row, column) map is taken from Triton (`GluonOpBuilder.to_linear_layout`),
the logical permutations of `_v8_op` (channel 8 t + j -> column 4 j + t), `_v8_op16` and `_v8_cat` applied to the
elementwise layout P, and the result compared thread by thread with the tensor-core operand / accumulator layout it
is converted to. Equal sets per thread: the conversion is a register rename (no data moves). The values are right
either way (a reshape, a permute and a convert_layout are exact whatever the registers); this checks that the
A operands are formed in the registers the tensor cores read, and that the row vectors (SliceLayout(1, P)) and
column vectors (`_v8_row`) need no exchange.
"""
from triton._C.libtriton import gluon_ir, ir
from triton.experimental.gluon import language as gl

ctx = ir.context()
ir.load_dialects(ctx)
B = gluon_ir.GluonOpBuilder(ctx)


def ll(layout, shape):
    return layout if isinstance(layout, gl.DistributedLinearLayout) else B.to_linear_layout(layout._to_ir(B),
                                                                                          list(shape))


def table(L):
    """{(lane, warp): [(row, col) of each register]}"""
    out = {}
    for w in range(1 << len(L.warp_bases)):
        for lane in range(1 << len(L.lane_bases)):
            regs = []
            for r in range(1 << len(L.reg_bases)):
                c = [0] * len(L.shape)
                for bases, idx in ((L.reg_bases, r), (L.lane_bases, lane), (L.warp_bases, w)):
                    for i, bv in enumerate(bases):
                        if idx >> i & 1:
                            c = [x ^ y for x, y in zip(c, bv)]
                regs.append(tuple(c))
            out[(lane, w)] = regs
    return out


def rename(src, dst, perm) -> bool:
    """Thread by thread, dst holds exactly the relabelled elements src holds, each once."""
    ts, td = table(src), table(dst)
    return all(sorted({perm(c) for c in ts[k]}) == sorted(td[k]) and len(set(td[k])) == len(td[k]) for k in ts)


def perm32(c):
    t, j = divmod(c[1], 8)
    return (c[0], 4 * j + t)


def perm16(c):
    col = c[1]
    a, b, cc, d, e = (col >> 4) & 1, (col >> 3) & 1, (col >> 2) & 1, (col >> 1) & 1, col & 1
    return (c[0], 16 * cc + 8 * d + 4 * a + 2 * b + e)


P = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
                               lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                               warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 32])
PA = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 0]],
                                lane_bases=[[0, 8], [0, 16], [0, 0], [0, 0], [0, 0]],
                                warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[1, 32])
MMA = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 8])
MMA16 = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16])
A16 = gl.DotOperandLayout(operand_index=0, parent=MMA16, k_width=2)
MMA64 = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 8])
A64 = gl.DotOperandLayout(operand_index=0, parent=MMA64, k_width=1)

if __name__ == "__main__":
    for name, lay, shape in (("P", P, [64, 32]), ("A64 (tf32 A)", A64, [64, 32]), ("A16 (fp16 A)", A16, [64, 32]),
                             ("MMA [64, 32]", MMA, [64, 32]), ("MMA16 [64, 32]", MMA16, [64, 32]),
                             ("MMA64 [64, 64]", MMA64, [64, 64])):
        print(f"{name}: {ll(lay, shape)}")
    tp = table(P)
    t_lo, t_64 = table(ll(MMA, [64, 32])), table(ll(MMA64, [64, 64]))
    checks = {
        "_v8_op: P -> A64": rename(P, ll(A64, [64, 32]), perm32),
        "_v8_op16: P -> A16": rename(P, ll(A16, [64, 32]), perm16),
        "MMA16 -> MMA accumulator [64, 32]": rename(ll(MMA16, [64, 32]), ll(MMA, [64, 32]), lambda c: c),
        "_v8_cat: [lo | hi] of MMA [64, 32] -> MMA64": all(
            sorted(set(t_lo[k]) | {(r, c + 32) for r, c in t_lo[k]}) == sorted(t_64[k]) for k in t_lo),
        "_v8_row: PA's columns per thread == SliceLayout(0, P)'s": all(
            sorted({c for _, c in tp[k]}) == sorted({c for _, c in table(PA)[k]}) for k in tp),
    }
    for name, lay, shape in (("A64", A64, [64, 32]), ("A16", A16, [64, 32]), ("MMA64", MMA64, [64, 64])):
        tt = table(ll(lay, shape))
        checks[f"SliceLayout(1, P) rows per thread == {name}'s"] = all(
            sorted({r for r, _ in tp[k]}) == sorted({r for r, _ in tt[k]}) for k in tp)
    for name, ok in checks.items():
        print(f"{'OK  ' if ok else 'FAIL'} {name}")
    raise SystemExit(0 if all(checks.values()) else 1)
