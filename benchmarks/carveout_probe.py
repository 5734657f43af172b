"""Does a program join an SM that another kernel's program started with a smaller shared-memory carveout?

Gluon kernels that hold shared memory and spin on the global timer, each program recording its SM and its start
and end: "small" (32 warps, 32 KB: the driver picks its carveout, since Triton asks for the largest only past 48 KB;
its threads allow two an SM, as the fused prepare's registers do), "big" (4 warps, 128 KB: Triton asks for the
largest carveout, as for the walk), and the sizes of the BV-64 walk (96 KB) and of the prepares beside it, Gluon
(84 KB) and `tl` (32 KB), 4 warps each. One program of the first kernel an SM is launched, then one program of the
second an SM on another stream: by threads, registers and shared memory (228 KB an SM) the second fits beside the
first, so it starts at once unless the SM's carveout, set by the first program, leaves it too little. Then the same
with a kernel's carveout preference set to 100% (`cuFuncSetAttribute`).

    python benchmarks/carveout_probe.py [--spin-us 300]      (sm_90, Triton with Gluon)

Prints, per trial, how many programs of the second kernel started while a program of the first ran on their SM,
and the median delay from the first kernel's start to the second's programs' starts.
"""

import argparse
import ctypes
import statistics

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

CARVEOUT_ATTRIBUTE = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT


@gluon.jit
def _clock():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _occupant(out, spin_ns, BLOCKS: gl.constexpr):
    """Holds BLOCKS x 4 KB of shared memory, spins spin_ns, stores (SM, start, end, a sum of the buffer)."""
    L: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [gl.num_warps(), 1], [1, 0])
    S: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    start = _clock()
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
    buf = gl.allocate_shared_memory(gl.float32, [BLOCKS, 16, 64], S)
    for i in gl.static_range(BLOCKS):
        buf.index(i).store((r[:, None] + c[None, :] + i).to(gl.float32))
    now = _clock()
    while now - start < spin_ns:
        now = _clock()
    total = gl.sum(gl.sum(buf.index(0).load(L), 1), 0)
    for i in gl.static_range(1, BLOCKS):
        total += gl.sum(gl.sum(buf.index(i).load(L), 1), 0)
    sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    base = out + gl.program_id(0) * 4
    gl.store(base, sm.to(gl.int64))
    gl.store(base + 1, start)
    gl.store(base + 2, now)
    gl.store(base + 3, total.to(gl.int64))


SMALL = dict(BLOCKS=8, num_warps=32)  # 32 KB, 1024 threads
BIG = dict(BLOCKS=32, num_warps=4)  # 128 KB, 128 threads
# the BV-64 walk (96 KB) and the prepare beside it: Gluon (84 KB), `tl` (32 KB); 4 warps each
WALK = dict(BLOCKS=24, num_warps=4)
GLUON_PREPARE = dict(BLOCKS=21, num_warps=4)
TL_PREPARE = dict(BLOCKS=8, num_warps=4)


def launch(kind: dict, grid: int, spin_ns: int, stream: torch.cuda.Stream):
    out = torch.zeros(grid, 4, dtype=torch.int64, device="cuda")
    with torch.cuda.stream(stream):
        compiled = _occupant[(grid,)](out, spin_ns, **kind)
    return out, compiled


def joined(first: torch.Tensor, second: torch.Tensor) -> tuple[int, float]:
    """(second's programs that started while a first program ran on their SM, median delay in us from the
    first kernel's earliest start to a second program's start)."""
    f, s = first.cpu().tolist(), second.cpu().tolist()
    by_sm = {}
    for sm, a, b, _ in f:
        by_sm.setdefault(sm, []).append((a, b))
    t0 = min(a for _, a, _, _ in f)
    hits = sum(any(a <= st <= b for a, b in by_sm.get(sm, [])) for sm, st, _, _ in s)
    return hits, statistics.median((st - t0) / 1e3 for _, st, _, _ in s)


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/carveout_probe.py")
    p.add_argument("--spin-us", type=float, default=300.0)
    args = p.parse_args()
    spin = int(args.spin_us * 1e3)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuFuncSetAttribute.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int)
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    kinds = {"small": SMALL, "big": BIG, "walk": WALK, "gluon prepare": GLUON_PREPARE, "tl prepare": TL_PREPARE}
    functions = {}
    for name, kind in kinds.items():  # compile and load each first
        functions[name] = launch(kind, 1, 1000, streams[0])[1].function
    torch.cuda.synchronize()
    # (first, second, the kernel whose carveout preference is set to 100% before the pair, or None): a preference
    # once set stays, so each kernel's comes after its pairs without one
    trials = (("small", "big", None), ("big", "small", None), ("small", "big", "small"), ("big", "small", "small"),
              ("walk", "tl prepare", None), ("walk", "gluon prepare", None), ("walk", "gluon prepare", "walk"),
              ("walk", "gluon prepare", "gluon prepare"))
    for a, b, preferred in trials:
        if preferred is not None:
            assert lib.cuFuncSetAttribute(functions[preferred], CARVEOUT_ATTRIBUTE, 100) == 0
        for _ in range(2):
            torch.cuda.synchronize()
            first, _ = launch(kinds[a], sms, spin, streams[0])
            second, _ = launch(kinds[b], sms, spin, streams[1])
            torch.cuda.synchronize()
            hits, delay = joined(first, second)
            print(f"{a} then {b} ({'driver carveouts' if preferred is None else preferred + ' at 100%'}): {hits} of "
                  f"{sms} {b} programs started beside a running {a} program; median start {delay:.1f} us after the "
                  f"{a} kernel's (spin {args.spin_us:.0f} us)", flush=True)


if __name__ == "__main__":
    main()
