#!/usr/bin/env bash
# One device call around any command: the carried wheels installed, the carried compiled kernels unpacked, the
# command run under a time limit that leaves room to pack what it compiled into $OUT for the next call.
#
#   bash scripts/device_call.sh [SECONDS] 'COMMAND'      (from the repository root, $OUT set by the device tool)
#
# SECONDS: the command's limit (default 540: the device tool stops a call at 600 s; the pack takes seconds).
# The command runs in bash with PYTHONPATH holding the repository (and the wheels of .whl/, as gpu_suite.sh
# installs them), PYTHONUNBUFFERED=1 and TRITON_CACHE_AUTOTUNING=1; its output goes to $OUT/call.txt and, its
# last 60 lines, to the terminal. A carried .triton_cache.tar.xz (and its parts .triton_cache.N.tar.xz) is unpacked
# first; $OUT/triton_cache.tar.xz and up to two parts come back (benchmarks/README.md, "GPU machine"). Exits with
# the command's status (124: it ran out of time).

set -u
cd "$(dirname "$0")/.." || exit 1
limit=540
if [[ $# -gt 1 ]]; then
    limit=$1
    shift
fi
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" >/dev/null \
        && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl; then
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
compgen -G ".triton_cache*.tar.xz" >/dev/null && python3 scripts/triton_cache.py unpack .triton_cache*.tar.xz
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
timeout -s INT -k 15 "$limit" bash -c "$1" >"$OUT/call.txt" 2>&1
rc=$?
tail -n 60 "$OUT/call.txt"
echo "device_call.sh: the command exited with $rc"
python3 scripts/triton_cache.py pack "$OUT/triton_cache.tar.xz" --parts 3
exit "$rc"
