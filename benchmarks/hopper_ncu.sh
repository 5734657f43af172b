# Nsight Compute on the prepare of one 1x16384 H=32 call per mode: bash benchmarks/hopper_ncu.sh tl v4
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for m in "$@"; do
  echo "== $m"
  $NCU --clock-control none -k regex:prepare --launch-skip 1 --launch-count 1 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    python3 benchmarks/hopper_ncu_case.py "$m" 2>&1 | grep -v "^==PROF==" | grep -E "Registers Per|Dynamic Shared|Achieved Occupancy|Duration|Warp Cycles Per Issued|Eligible Warps|Block Limit Reg|Block Limit Shared|Memory Throughput|Compute \(SM\)|stalled|This stall type"
done
