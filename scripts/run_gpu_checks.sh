#!/usr/bin/env bash
# Run the GPU tests and benchmarks on a CUDA machine in one go.
#   scripts/run_gpu_checks.sh [pytest selection...]
# Installs wheels carried in .whl/ first (e.g. humming-kernels), writes logs
# under $OUT when set (else ./out), and ends with a summary table.
# Knobs: SKIP_TESTS=1, GPU_TESTS_ONLY (1, the default: skip the tests that
# never touch the GPU, CI runs them; 0: all), GPU_BENCHMARKS="<files>" (empty: none),
# SKIP_MEMORY_REPORT=1, TUNING="<benchmarks/tuning script names>" (default none),
# TEST_TIMEOUT_S (480), BENCH_TIMEOUT_S (150 each),
# PYTEST_WORKERS (16). The whole run takes more than one 10-minute device
# command: run the tests and the benchmarks as two commands.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export HUMMING_DISABLE_PARALLEL_BUILD=1 GPU_TESTS_ONLY="${GPU_TESTS_ONLY-1}"
LOG="${OUT:-$PWD/out}"
mkdir -p "$LOG"

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"

declare -a names results
step() {  # step NAME LOGFILE COMMAND...: run, append to LOGFILE, record the status
    local name="$1" log="$2"
    shift 2
    local start=$SECONDS
    echo "== $name" >>"$log"
    "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    names+=("$name")
    results+=("rc=$rc $((SECONDS - start))s $(tail -n 3 "$log" | grep -Eo '[0-9]+ (passed|failed|skipped|errors?)' | tr '\n' ' ')")
}

own_group() {  # own_group COMMAND...: run it as a process group of its own, then
    # end whatever is left of that group (stray pytest-xdist workers), and
    # nothing else on the machine.
    set -m
    "$@" &
    local pid=$!
    set +m
    wait "$pid"
    local rc=$?
    kill -9 -- "-$pid" 2>/dev/null || true
    return "$rc"
}

# At most a handful of files come back from the device: one log for the
# tests, one for all benchmarks, and a JSON per benchmark.
# Tests compile many Triton/humming kernels (CPU-bound): spread them over
# workers when pytest-xdist is there.
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n "${PYTEST_WORKERS:-16}")
if [ -z "${SKIP_TESTS:-}" ]; then
    # The tests that touch the GPU (all with GPU_TESTS_ONLY=0): those
    # marked gpu and the shared tests, which the `device` fixture runs on
    # the GPU here. Bounded, and its xdist workers are
    # killed afterwards so no straggler shares the GPU with the benchmarks.
    step gpu-tests "$LOG/gpu_tests.log" own_group timeout -k 10 \
        "${TEST_TIMEOUT_S:-480}" python3 -m pytest -q -p no:cacheprovider \
        -p no:benchmark --tb=short -rfE "${workers[@]}" "${@:-tests}"
fi
for bench in ${GPU_BENCHMARKS-benchmarks/kernels/benchmark_*.py}; do
    [ -f "$bench" ] || continue
    name="$(basename "$bench" .py)"
    step "$name" "$LOG/benchmarks.log" timeout -k 5 "${BENCH_TIMEOUT_S:-150}" \
        python3 -m "benchmarks.kernels.$name" --output-json "$LOG/$name.json"
done
# Tuning scripts (full-size checks and launch-config sweeps) only when named,
# e.g. TUNING="tune_moe_permute tune_marlin check_humming".
for name in ${TUNING-}; do
    step "$name" "$LOG/tuning.log" timeout -k 5 "${BENCH_TIMEOUT_S:-150}" \
        python3 "benchmarks/tuning/$name.py"
done
if [ -z "${SKIP_MEMORY_REPORT:-}" ]; then
    step moe-memory-report "$LOG/benchmarks.log" python3 -m benchmarks.moe_memory_report \
        --preset qwen3.6-35b-a3b --tokens 8192 1024 1 --intermediate-size 16 \
        --output-json "$LOG/moe_memory.json" --plot "$LOG/moe_memory.png"
fi

echo
echo "== summary =="
for i in "${!names[@]}"; do
    printf '%-40s %s\n' "${names[$i]}" "${results[$i]}"
done
