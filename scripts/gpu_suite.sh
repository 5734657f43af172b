#!/usr/bin/env bash
# One call on the GPU machine does everything: setup, GPU test suite, compute-sanitizer, benchmark, accuracy.
#
#   bash scripts/gpu_suite.sh            (from the repository root, with $OUT set; see benchmarks/README.md)
#
# Environment:
#   OUT                  folder for the files that come back (default ./gpu_out)
#   KDA_SUITE_STEPS      comma list of steps: pytest,sanitizer,bench,accuracy (default: all; setup always runs)
#   KDA_SKIP_ACCURACY=1  skip the accuracy step
#   KDA_SUITE_BUDGET_S   wall-clock budget of the whole script in seconds (default 570: the device tool stops a
#                        command at 600 s); a step gets at most what is left, a step with < 20 s left is skipped
#   KDA_TIMEOUT_PYTEST, KDA_TIMEOUT_SANITIZER, KDA_TIMEOUT_BENCH, KDA_TIMEOUT_ACCURACY
#                        per-step caps in seconds (defaults 480, 150, 400, 400; the budget still applies; on an
#                        H100 at -n 9 the 1464 tests were 97% done after 380 s, the full accuracy preset takes about
#                        230 s)
#   KDA_PYTEST_ARGS      pytest targets and filters instead of "tests", split as a shell would (shlex), e.g.
#                        "tests/test_chunk.py -k 'empty or beside'"
#   KDA_PYTEST_WORKERS   pytest-xdist workers (default: one per 8 GiB of GPU memory, at most 12; at 4 the suite
#                        ran past 420 s, 12 workers ran an 80 GB H100 out of memory)
#   KDA_PLAN_DEVICE      plan kda as this device in the pytest and bench steps (--plan-device; "sm_80": an A100's
#                        plan on this GPU, no TMA, no walk beside the prepare, no PDL, 163 KiB of shared memory;
#                        kda.plan.plan_as). The sanitizer and accuracy steps plan for the GPU itself.
#   KDA_BENCH_ARGS       extra benchmarks/bench.py arguments (default "--shapes all")
#   KDA_ACCURACY_ARGS    kda.accuracy arguments (default "--preset full --device cuda")
#   KDA_SANITIZER_TOOLS  compute-sanitizer tools, space separated (default "memcheck")
#   KDA_COMMIT           commit to print in the benchmark and accuracy headers: pass it from the machine the
#                        tree came from (KDA_COMMIT=<sha> bash scripts/gpu_suite.sh); the GPU machine's copy of
#                        the tree may carry a stale .git (its ignored files are kept between calls)
#
# Files under $OUT (the device tool brings back at most 8 files, 16 MiB each, 2 folders deep):
#   suite.txt  setup log and the summary      pytest.txt     the test run
#   sanitizer.txt                              bench.md       the benchmark table      bench.log  its log
#   bench.json the benchmark's rows (what benchmarks/results/h200-latest.json holds)
#   triton_cache.tar.xz  the kernels this call compiled (scripts/triton_cache.py), with triton_cache.2.tar.xz .. where
#                        files are left: carry them back as .triton_cache.tar.xz, .triton_cache.2.tar.xz, ..
#   accuracy/  the accuracy report (at most 3 files; more are packed into accuracy.tar.gz)
# Every step runs even when an earlier one failed; the exit status is 0 only when every step that ran passed.

set -u
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$SECONDS
BUDGET=${KDA_SUITE_BUDGET_S:-570}
STEPS=${KDA_SUITE_STEPS:-pytest,sanitizer,bench,accuracy}
SUITE_LOG=$OUT/suite.txt
: >"$SUITE_LOG"

SUMMARY=()
FAILED=0

log() { echo "$@" | tee -a "$SUITE_LOG"; }
header() {
    log ""
    log "=================================================================================================="
    log "== $1   (t = $((SECONDS - START)) s of $BUDGET s)"
    log "=================================================================================================="
}
wanted() { [[ ",$STEPS," == *",$1,"* || ",$STEPS," == *",all,"* ]]; }
record() {  # name rc seconds output
    SUMMARY+=("| $1 | $2 | $3 | $4 |")
    case $2 in
        0 | skipped* | "not run"*) ;;
        *) FAILED=1 ;;
    esac
}
# step_timeout CAP -> prints the seconds this step may take (0: no time left)
step_timeout() {
    local left=$((BUDGET - (SECONDS - START) - 10))
    if ((left < 20)); then echo 0; elif (($1 < left)); then echo "$1"; else echo "$left"; fi
}
# cap FILE: keep a log within the device tool's 16 MiB limit (keep its head and tail)
cap() {
    local f=$1 max=$((15 * 1024 * 1024))
    [[ -f $f ]] || return 0
    local size
    size=$(stat -c %s "$f")
    if ((size > max)); then
        { head -c $((max / 4)) "$f"; printf '\n\n[... %s bytes cut by gpu_suite.sh ...]\n\n' "$size"; tail -c $((max / 2)) "$f"; } >"$f.tmp" && mv "$f.tmp" "$f"
    fi
}

# ------------------------------------------------------------------------------------------------------------
header "setup"
if compgen -G ".whl/*.whl" >/dev/null; then
    log "installing carried wheels: $(echo .whl/*.whl)"
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tee -a "$SUITE_LOG"; then
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        log "WARNING: wheel install failed; going on without the carried wheels"
    fi
else
    log "no .whl/*.whl carried (fla will not be importable unless installed; see benchmarks/README.md)"
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
log "PYTHONPATH=$PYTHONPATH"
# the kernels a previous call compiled (kda's, fla's, their launchers and fla's autotuning choices, about 80 s a
# prefill shape on a fresh machine): a carried .triton_cache.tar.xz and its parts .triton_cache.N.tar.xz (a previous
# call's $OUT/triton_cache*.tar.xz) are unpacked into Triton's cache first; with TRITON_CACHE_AUTOTUNING=1 Triton
# keeps each autotuning choice there
export TRITON_CACHE_AUTOTUNING=1
if compgen -G ".triton_cache*.tar.xz" >/dev/null; then
    python3 scripts/triton_cache.py unpack .triton_cache*.tar.xz 2>&1 | tee -a "$SUITE_LOG"
fi
if [[ -z ${KDA_COMMIT:-} ]]; then
    KDA_COMMIT=$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)
fi
export KDA_COMMIT
log "KDA_COMMIT=$KDA_COMMIT"
log "KDA_PLAN_DEVICE=${KDA_PLAN_DEVICE:-unset, the plan of the GPU itself}"
{
    nvidia-smi 2>&1 || echo "nvidia-smi failed"
    uname -a
    python3 - <<'EOF' 2>&1
import sys
print("python", sys.version.split()[0], sys.executable)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except Exception as e:
    print("torch: import failed:", e)
for name in ("triton", "fla", "einops", "pytest", "xdist", "pytest_timeout", "hypothesis", "kda", "kda_reference"):
    try:
        m = __import__(name)
        print(f"{name} {getattr(m, '__version__', '?')} at {getattr(m, '__file__', '?')}")
    except Exception as e:
        print(f"{name}: not importable ({type(e).__name__}: {e})")
EOF
} 2>&1 | tee -a "$SUITE_LOG"
record setup 0 $((SECONDS - START)) suite.txt

# ------------------------------------------------------------------------------------------------------------
step_pytest() {
    # no -x: one device call should see every failure; -v names each failure as it happens, so a run stopped
    # at its time limit still says which tests failed (-q prints them only in the final summary)
    # --durations: the slowest tests named, also when the cap interrupts the run (SIGINT: pytest still summarises)
    local t=$1 args=(-v -rfE -p no:cacheprovider -p no:benchmark --durations=30)
    python3 -c "import pytest_timeout" 2>/dev/null && args+=(--timeout 900)
    local workers=${KDA_PYTEST_WORKERS:-$(python3 -c "import torch
print(max(2, min(12, torch.cuda.get_device_properties(0).total_memory // 2**33)))")}
    # worksteal: an idle worker takes queued tests from a busy one, so the two-minute tests do not end the run alone
    python3 -c "import xdist" 2>/dev/null && args+=(-n "$workers" --dist worksteal)
    [[ -n ${KDA_PLAN_DEVICE:-} ]] && args+=(--plan-device "$KDA_PLAN_DEVICE")
    # split as a shell would (shlex): a -k expression keeps its quoted spaces
    local extra
    mapfile -t extra < <(python3 -c 'import os, shlex; print("\n".join(shlex.split(os.environ.get("KDA_PYTEST_ARGS") or "tests")))')
    args+=("${extra[@]}")
    echo "python3 -m pytest ${args[*]}  (timeout ${t}s)" | tee "$OUT/pytest.txt"
    timeout -s INT -k 30 "$t" python3 -m pytest "${args[@]}" 2>&1 | tee -a "$OUT/pytest.txt"
    return "${PIPESTATUS[0]}"
}

find_sanitizer() {
    local c
    c=$(command -v compute-sanitizer 2>/dev/null) && { echo "$c"; return 0; }
    for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
        [[ -x $c ]] && { echo "$c"; return 0; }
    done
    c=$(find /opt/nvidia /usr/local -maxdepth 6 -name compute-sanitizer -type f -perm -u+x 2>/dev/null | head -n 1)
    [[ -n $c ]] && { echo "$c"; return 0; }
    return 1
}

step_sanitizer() {
    local t=$1 cs rc=0 tool f=$OUT/sanitizer.txt
    : >"$f"
    if ! cs=$(find_sanitizer); then
        echo "compute-sanitizer not found (PATH, /usr/local/cuda, /opt/nvidia)" | tee -a "$f"
        return 127
    fi
    echo "compute-sanitizer: $cs ($("$cs" --version 2>&1 | tail -n 1))" | tee -a "$f"
    # compile the kernels outside the sanitizer first (Triton's cache), and check the case passes plainly
    echo "--- plain run (fills the Triton cache) ---" | tee -a "$f"
    timeout -k 10 "$t" python3 scripts/sanitize_case.py 2>&1 | tee -a "$f"
    local plain=${PIPESTATUS[0]}
    ((plain != 0)) && rc=$plain
    for tool in ${KDA_SANITIZER_TOOLS:-memcheck}; do
        local left=$((t - (SECONDS - STEP_T0)))
        if ((left < 15)); then
            echo "--- $tool: no time left ---" | tee -a "$f"
            ((rc == 0)) && rc=124
            continue
        fi
        echo "--- compute-sanitizer --tool $tool (PYTORCH_NO_CUDA_MEMORY_CACHING=1: one allocation per tensor, so out-of-bounds accesses are not hidden inside the caching allocator's blocks) ---" | tee -a "$f"
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 10 "$left" "$cs" --tool "$tool" --error-exitcode 9 \
            python3 scripts/sanitize_case.py 2>&1 | tee -a "$f"
        local r=${PIPESTATUS[0]}
        echo "--- $tool exit code $r ---" | tee -a "$f"
        ((r != 0 && rc == 0)) && rc=$r
    done
    return "$rc"
}

step_bench() {
    local t=$1
    # shellcheck disable=SC2206
    local args=(${KDA_BENCH_ARGS:---shapes all})
    [[ -n ${KDA_PLAN_DEVICE:-} ]] && args+=(--plan-device "$KDA_PLAN_DEVICE")
    echo "python3 benchmarks/bench.py ${args[*]} --out $OUT/bench.md --json $OUT/bench.json  (timeout ${t}s)" | tee "$OUT/bench.log"
    timeout -k 15 "$t" python3 benchmarks/bench.py "${args[@]}" --out "$OUT/bench.md" --json "$OUT/bench.json" 2>&1 \
        | tee -a "$OUT/bench.log"
    return "${PIPESTATUS[0]}"
}

step_accuracy() {
    local t=$1 tmp=/tmp/kda_accuracy rc
    if [[ ! -f kda/accuracy/__main__.py && ! -f kda/accuracy.py ]]; then
        echo "kda.accuracy (kda/accuracy/__main__.py) not in this tree"
        return 200
    fi
    rm -rf "$tmp"
    mkdir -p "$tmp"
    # shellcheck disable=SC2206
    local args=(${KDA_ACCURACY_ARGS:---preset full --device cuda})
    echo "python3 -m kda.accuracy ${args[*]} --out-dir <accuracy>  (timeout ${t}s)"
    timeout -k 15 "$t" python3 -m kda.accuracy "${args[@]}" --out-dir "$tmp" 2>&1 | tee "$tmp/accuracy_log.txt"
    rc=${PIPESTATUS[0]}
    # bring the report back within the device tool's limits: at most 3 files of <= 15 MiB, no sub-folders
    local n big deep
    n=$(find "$tmp" -type f | wc -l)
    big=$(find "$tmp" -type f -size +15M | wc -l)
    deep=$(find "$tmp" -mindepth 2 -type f | wc -l)
    mkdir -p "$OUT/accuracy"
    if ((n <= 3 && big == 0 && deep == 0)); then
        cp "$tmp"/* "$OUT/accuracy/"
    else
        tar -C "$tmp" -czf "$OUT/accuracy.tar.gz" . && echo "packed $n accuracy files into accuracy.tar.gz"
        # the top-level report and the log, readable without unpacking, when small
        local md
        md=$(find "$tmp" -maxdepth 1 -type f -name '*.md' -size -15M | head -n 1)
        [[ -n $md ]] && cp "$md" "$OUT/accuracy/"
        cp "$tmp/accuracy_log.txt" "$OUT/accuracy/" 2>/dev/null
        cap "$OUT/accuracy/accuracy_log.txt"
    fi
    return "$rc"
}

# name, cap, function, output description
run_step() {
    local name=$1 cap=$2 fn=$3 what=$4 t rc
    if ! wanted "$name"; then
        record "$name" "skipped (KDA_SUITE_STEPS)" 0 "-"
        return
    fi
    t=$(step_timeout "$cap")
    if ((t == 0)); then
        header "$name: skipped, no time left in the budget"
        record "$name" "not run (budget)" 0 "-"
        return
    fi
    header "$name (up to ${t}s)"
    STEP_T0=$SECONDS
    "$fn" "$t"
    rc=$?
    ((rc == 124 || rc == 137)) && log "$name: stopped at its time limit (${t}s)"
    log "$name: exit code $rc after $((SECONDS - STEP_T0)) s"
    record "$name" "$rc" $((SECONDS - STEP_T0)) "$what"
}

run_step pytest "${KDA_TIMEOUT_PYTEST:-480}" step_pytest pytest.txt
cap "$OUT/pytest.txt"
run_step sanitizer "${KDA_TIMEOUT_SANITIZER:-150}" step_sanitizer sanitizer.txt
cap "$OUT/sanitizer.txt"
run_step bench "${KDA_TIMEOUT_BENCH:-400}" step_bench "bench.md, bench.json, bench.log"
cap "$OUT/bench.log"
if [[ ${KDA_SKIP_ACCURACY:-0} == 1 ]]; then
    record accuracy "skipped (KDA_SKIP_ACCURACY=1)" 0 "-"
elif [[ ! -f kda/accuracy/__main__.py && ! -f kda/accuracy.py ]] && wanted accuracy; then
    record accuracy "skipped (no kda/accuracy/__main__.py)" 0 "-"
else
    run_step accuracy "${KDA_TIMEOUT_ACCURACY:-400}" step_accuracy "accuracy/"
fi

# for the next call's carry (see the setup step): in as many parts (at most 3) as the device tool's 8 files leave
parts=$((8 - $(find "$OUT" -type f | wc -l)))
((parts > 3)) && parts=3
((parts < 1)) && parts=1
python3 scripts/triton_cache.py pack "$OUT/triton_cache.tar.xz" --parts "$parts" 2>&1 | tee -a "$SUITE_LOG"

# ------------------------------------------------------------------------------------------------------------
header "summary"
if [[ -f $OUT/bench.md ]]; then
    log "benchmark table ($OUT/bench.md):"
    grep -E '^\|' "$OUT/bench.md" | tee -a "$SUITE_LOG"
    grep -E '^decode N=.* pool time over' "$OUT/bench.md" | tee -a "$SUITE_LOG"
fi
log ""
log "| step | exit code | seconds | output under \$OUT |"
log "|---|---|---|---|"
for line in "${SUMMARY[@]}"; do log "$line"; done
nfiles=$(find "$OUT" -type f | wc -l)
log ""
log "files under \$OUT: $nfiles (the device tool brings back at most 8): $(cd "$OUT" && find . -type f | sort | tr '\n' ' ')"
((nfiles > 8)) && log "WARNING: more than 8 files under \$OUT; some will not come back"
log "total $((SECONDS - START)) s; overall: $([[ $FAILED == 0 ]] && echo PASS || echo FAIL)"
exit "$FAILED"
