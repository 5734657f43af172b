"""What slows the walk when another program shares its SM?

The walk of one `chunk_kda` call (1x16384 H=32 by default: 64 programs at V blocks of 64, one an SM), run after
the prepare (the walk beside the prepare switched off), is timed alone and beside a co-runner: a kernel holding one
program on every SM (extra programs exit at once) that, until a deadline on the global timer, does one kind of
work in a loop: nothing (`nanosleep`), tf32, fp16 or bf16 dots (64 x 64 x 64, one accumulator chain; the tf32 dot
reads both operands from shared memory, the 16-bit ones B alone), FMA chains, loads from global memory that miss L2,
loads from shared memory (16 bytes a thread each, `ld.shared.v4`), exponentials (`exp2`), transposes of a register
tile (through shared memory), 16-bit dots with both operands in shared memory, TMA copies or gpu-scope acquire polls.
Every co-runner program first forms one tf32 dot (at least 32 KB of shared memory, 48 KB for some kinds) and leaves room
beside it for a walk program (registers and shared memory): a co-runner holding less sets its SM's carveout too small
for the program beside it, which then starts only after it (its kernel time its time alone; the call's time, printed,
gives it away). On an H100 the co-runners moving shared memory slow the walk (tf32 dots 2.25-2.6x, shared loads or
transposes 1.23x at V blocks of 64: the 2026-12-06-345660f results file, whose other kinds held little or no shared
memory and say nothing).

    python benchmarks/interference_probe.py [--shape 1x16384x32] [--repeats 3]      (a CUDA GPU)

(Through a pipe, keep it line-buffered, `grep --line-buffered`: a first run killed at 130 s printed nothing.)

Prints the walk kernel's time (torch profiler) and its time a chunk, per co-runner, and the co-runner's work
done (loop trips a program). Which co-runner slows the walk as the prepare does (about 1.6x a step beside it on
an H100) says which of the SM's units the two contend for.

`--victim prepare` times the call's prepare kernel instead (the `tl` one, or the Gluon one where the plan takes it:
1x8192 H=96 on sm_90): a co-runner's program costs the prepare one of its two slots an SM whatever it does, so
compare each kind with `sleep` (the Gluon prepare: 1.17x). A Gluon prepare program runs 2.9x its time beside a walk
program, a `tl` one 1.0x (the d609590 results file): which kind of work slows it says what the two contend for.
"""

import argparse
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
import bench  # noqa: E402

KINDS = {"alone": None, "sleep": 0, "tf32 dots": 1, "fp16 dots": 2, "fma": 3, "loads": 4, "bf16 dots": 5,
         "smem loads": 6, "exp2": 7, "transposes": 8, "fp16 smem dots": 9, "polls": 10,
         "tma loads": 11}
LOAD_ELEMS = 1 << 27  # 512 MiB of fp32 for the loads co-runner: well past L2


@triton.jit
def _clock():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _corunner(x, x16, big, big_desc, claim, stats, out, spin_ns, KIND: tl.constexpr):
    """One program an SM (the first to claim its SM; the others return): KIND's work until spin_ns have passed."""
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    if tl.atomic_cas(claim + sm, 0, 1) != 0:
        return
    start = _clock()
    r = tl.arange(0, 64)
    a = tl.load(x + r[:, None] * 64 + r[None, :])
    a16 = tl.load(x16 + r[:, None] * 64 + r[None, :])  # a loaded 16-bit operand: both read from shared memory
    # a dot ahead of the loop in every kind: at least 32 KB of shared memory (the smem loads read it), so that no
    # kind's program sets its SM's carveout too small (a kernel with less left a Gluon prepare no room beside it)
    acc = tl.dot(a, a, input_precision="tf32")
    offs = (r[:, None] * 64 + r[None, :]) * 16 % 32640  # 16 bytes an element, i * 16 more: within 32 KB
    now = start
    trips = 0
    while now - start < spin_ns:
        for i in tl.static_range(8):
            tile = ((trips * 8 + i) * 1024 + sm) % 32768  # one of the LOAD_ELEMS / 4096 tiles (loads, TMA copies)
            if KIND == 0:
                tl.inline_asm_elementwise("nanosleep.u32 500; mov.b32 $0, 0;", "=r", [], dtype=tl.int32,
                                          is_pure=False, pack=1)
            elif KIND == 1:
                acc = tl.dot(a, a, acc, input_precision="tf32")
            elif KIND == 2:
                acc = tl.dot(a.to(tl.float16), a.to(tl.float16), acc)
            elif KIND == 3:
                acc = acc * 0.9990234375 + a
            elif KIND == 5:
                acc = tl.dot(a.to(tl.bfloat16), a.to(tl.bfloat16), acc)
            elif KIND == 6:
                acc += tl.inline_asm_elementwise(
                    "{ .reg .b32 b, x, y, z, w; mov.b32 b, global_smem; add.u32 b, b, $1; "
                    "ld.volatile.shared.v4.b32 {x, y, z, w}, [b]; add.u32 x, x, w; mov.b32 $0, x; }",
                    "=r,r", [offs + i * 16], dtype=tl.int32, is_pure=False, pack=1).to(tl.float32)
            elif KIND == 7:  # MUFU.EX2 a element
                acc = tl.exp2(-acc) + a
            elif KIND == 8:  # a layout change through shared memory a trip, as the prepare's transposes
                acc = tl.trans(acc) * 0.9990234375 + a
            elif KIND == 9:  # the walk's dots: fp16 operands both in shared memory
                acc = tl.dot(a16, a16, acc)
            elif KIND == 10:  # the walk's polls: a gpu-scope acquire load (it invalidates the SM's L1)
                acc += tl.inline_asm_elementwise("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", [claim + sm],
                                                 dtype=tl.int32, is_pure=False, pack=1).to(tl.float32)
            elif KIND == 11:  # the walk's tiles: TMA copies into shared memory (64 x 64 fp32, past L2)
                acc += big_desc.load([tile * 64, 0])
            else:
                acc += tl.load(big + tile.to(tl.int64) * 4096 + r[:, None] * 64 + r[None, :])
        now = _clock()
        trips += 1
    tl.store(out + sm * 4096 + r[:, None] * 64 + r[None, :], acc)
    tl.store(stats + sm * 2, trips.to(tl.int64))
    tl.store(stats + sm * 2 + 1, now - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--shape", default="1x16384x32", help="BxTxH")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated co-runners (alone: none)")
    p.add_argument("--spin-us", type=float, default=8000.0, help="the co-runner's deadline (covers the whole call)")
    p.add_argument("--victim", choices=("walk", "prepare"), default="walk", help="the kernel timed (default walk)")
    a = p.parse_args()
    names = a.kinds.split(",")
    unknown = sorted(set(names) - set(KINDS))
    if unknown:
        p.error(f"--kinds: unknown {', '.join(unknown)} (known: {', '.join(KINDS)})")
    import kda
    import kda.plan as P
    import kda.replay as R

    R.CAPACITY = 0  # every call takes the full path (no recorded call)
    P._may_wait = lambda call, device: False  # the walk after the prepare: alone on its SMs but for the co-runner
    B, T, H = (int(v) for v in a.shape.split("x"))
    dev = "cuda"
    torch.manual_seed(0)
    q, k, v, g, beta, A_log, dt_bias = bench._tokens(B, T, H, H, dev)
    flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                 A_log=A_log, dt_bias=dt_bias, lower_bound=bench.LOWER_BOUND)
    h0 = torch.randn(B, H, 128, 128, device=dev) * 0.1
    call = lambda: kda.chunk_kda(q, k, v, g, beta, None, h0, True, **flags)  # noqa: E731
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(64, 64, device=dev) * 0.01
    x16 = x.half()
    from triton.tools.tensor_descriptor import TensorDescriptor
    big = torch.randn(LOAD_ELEMS, device=dev)
    big_desc = TensorDescriptor.from_tensor(big.view(-1, 64), [64, 64])
    claim = torch.zeros(sms, dtype=torch.int32, device=dev)
    stats = torch.zeros(sms, 2, dtype=torch.int64, device=dev)
    out = torch.empty(sms, 64, 64, device=dev)
    side = torch.cuda.Stream()
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    print("kda compiled and warm", flush=True)
    for kind in {KINDS[n] for n in names} - {None}:  # compile the co-runners
        claim.zero_()
        _corunner[(sms,)](x, x16, big, big_desc, claim, stats, out, 1000, KIND=kind, num_warps=4)
    torch.cuda.synchronize()
    print("co-runners compiled", flush=True)
    nchunks = triton.cdiv(T, 64)
    victims = ("_chunk_state_kernel",)
    if a.victim == "prepare":
        victims = ("_chunk_prepare_kernel", "_chunk_prepare_hopper_kernel")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        ran = [e.key for e in prof.key_averages() if e.key in victims]
        print(f"the prepare: {', '.join(ran)}; a chunk below is a chunk of every head")
    print(f"{torch.cuda.get_device_name(0)}, {a.shape}: the walk after the prepare, {nchunks} chunks a sequence")
    for name in names:
        kind = KINDS[name]
        walks, trips, calls = [], [], []
        for _ in range(a.repeats):
            claim.zero_()
            stats.zero_()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                if kind is not None:
                    with torch.cuda.stream(side):
                        _corunner[(4 * sms,)](x, x16, big, big_desc, claim, stats, out, int(a.spin_us * 1000),
                                              KIND=kind, num_warps=4)
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                call()
                t1.record()
                torch.cuda.synchronize()
            calls.append(t0.elapsed_time(t1) * 1000)
            walk = [e for e in prof.key_averages() if e.key in victims]
            if walk:
                walks.append(walk[0].device_time_total / max(1, walk[0].count))
            if kind is not None:
                st = stats.cpu()
                held = int((st[:, 0] > 0).sum())
                trips.append((held, statistics.median(st[:, 0].tolist())))
        w = statistics.median(walks) if walks else float("nan")
        extra = f"; co-runner on {trips[-1][0]} SMs, median {trips[-1][1]:.0f} trips" if trips else ""
        # the whole call: a kernel that found no room beside the co-runner started after it (spin-us later)
        print(f"{name:10s}: {a.victim} {w:8.1f} us, {w / nchunks:5.2f} us a chunk, call {statistics.median(calls):.0f} "
              f"us{extra}", flush=True)


if __name__ == "__main__":
    main()
