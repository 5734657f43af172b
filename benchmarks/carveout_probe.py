"""Does a program join an SM that another kernel's program started with a smaller shared-memory carveout?

Two Gluon kernels that hold shared memory and spin on the global timer, each program recording its SM and its start
and end: "small" (32 warps, 32 KB: the driver picks its carveout, since Triton asks for the largest only past 48 KB;
its threads allow two an SM, as the fused prepare's registers do) and "big" (4 warps, 128 KB: Triton asks for the
largest carveout, as for the walk). One small program an SM is launched, then one big program an SM on another
stream: by threads, registers and shared memory a big program fits beside a small one, so it starts at once unless
the SM's carveout, set by the small program, leaves it too little. Then the same with the small kernel's carveout
preference set to 100% (`cuFuncSetAttribute`, as `kda.ops.launch.prefer_shared` would), and in the other order.

    python benchmarks/carveout_probe.py [--spin-us 300]      (sm_90, Triton with Gluon)

Prints, per trial, how many big (or small) programs started while a program of the other kernel ran on their SM,
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
def _occupant(out, spin_ns, ROWS: gl.constexpr):
    """Holds ROWS x 64 fp32 of shared memory, spins spin_ns, stores (SM, start, end, a sum of the buffer)."""
    L: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [gl.num_warps(), 1], [1, 0])
    S: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    start = _clock()
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
    buf = gl.allocate_shared_memory(gl.float32, [ROWS, 64], S)
    buf.store((r[:, None] + c[None, :]).to(gl.float32))
    now = _clock()
    while now - start < spin_ns:
        now = _clock()
    total = gl.sum(gl.sum(buf.load(L), 1), 0)
    sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    base = out + gl.program_id(0) * 4
    gl.store(base, sm.to(gl.int64))
    gl.store(base + 1, start)
    gl.store(base + 2, now)
    gl.store(base + 3, total.to(gl.int64))


SMALL = dict(ROWS=128, num_warps=32)  # 32 KB, 1024 threads
BIG = dict(ROWS=512, num_warps=4)  # 128 KB, 128 threads


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
    for kind in (SMALL, BIG):  # compile and load both first
        launch(kind, 1, 1000, streams[0])
    torch.cuda.synchronize()
    small_fn = launch(SMALL, 1, 1000, streams[0])[1].function
    for carve in (None, 100):
        if carve is not None:
            assert lib.cuFuncSetAttribute(small_fn, CARVEOUT_ATTRIBUTE, carve) == 0
        for order in ((SMALL, BIG), (BIG, SMALL)):
            names = ["small" if k is SMALL else "big" for k in order]
            for _ in range(2):
                torch.cuda.synchronize()
                first, _ = launch(order[0], sms, spin, streams[0])
                second, _ = launch(order[1], sms, spin, streams[1])
                torch.cuda.synchronize()
                hits, delay = joined(first, second)
                print(f"small carveout {'driver' if carve is None else f'{carve}%'}: {names[0]} then {names[1]}: "
                      f"{hits} of {sms} {names[1]} programs started beside a running {names[0]} program; median "
                      f"start {delay:.1f} us after the {names[0]} kernel's (spin {args.spin_us:.0f} us)", flush=True)


if __name__ == "__main__":
    main()
