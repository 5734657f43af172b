"""One 1x16384 H=32 call twice in mode argv[1] (tl, v4 .. v7) for Nsight Compute (benchmarks/hopper_ncu.sh)."""
import sys

sys.argv = [sys.argv[0], sys.argv[1]]
src = open("benchmarks/hopper_probe.py").read().split('print("== accuracy')[0]
exec(src)
mode = sys.argv[1]
args, h0, kw = inputs(1, 16384, 32, seed=3)  # noqa: F821
for _ in range(2):
    run(mode, args, h0, kw)  # noqa: F821
torch.cuda.synchronize()  # noqa: F821
