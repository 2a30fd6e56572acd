#!/usr/bin/env bash
# Run the GPU tests and benchmarks on a CUDA machine in one go.
#   scripts/run_gpu_checks.sh [pytest selection...]
# Installs wheels carried in .whl/ first (e.g. humming-kernels), writes logs
# under $OUT when set (else ./out), and ends with a summary table.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export HUMMING_DISABLE_PARALLEL_BUILD=1
LOG="${OUT:-$PWD/out}"
mkdir -p "$LOG"

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"

declare -a names results
step() {  # step NAME COMMAND...: run, log to $LOG/NAME.log, record the status
    local name="$1"
    shift
    local start=$SECONDS
    "$@" 2>&1 | tee "$LOG/$name.log"
    local rc=${PIPESTATUS[0]}
    names+=("$name")
    results+=("rc=$rc $((SECONDS - start))s $(grep -Eo '[0-9]+ (passed|failed|skipped)' "$LOG/$name.log" | tr '\n' ' ')")
}

step gpu-tests python3 -m pytest -q -m gpu -p no:cacheprovider "${@:-tests}"
for bench in ${GPU_BENCHMARKS:-benchmarks/kernels/benchmark_*.py}; do
    [ -f "$bench" ] || continue
    step "$(basename "$bench" .py)" python3 "$bench" --output-json "$LOG/$(basename "$bench" .py).json"
done

echo
echo "== summary =="
for i in "${!names[@]}"; do
    printf '%-40s %s\n' "${names[$i]}" "${results[$i]}"
done
