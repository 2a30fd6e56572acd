#!/usr/bin/env bash
# Set up (or reuse) the local virtualenv, then run one job:
#   scripts/dev.sh test   ruff, ruff format --check, mypy, pytest
#   scripts/dev.sh run    the main job: vllm serve + one chat request (see README)
#   scripts/dev.sh offline   offline generation with LLM.generate
#   scripts/dev.sh memory-report   the MoE memory report
# Idempotent: a second call reuses .venv and installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
job="${1:-test}"
shift || true

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" 2>/dev/null; then
    # Without a GPU this takes the CPU build (on our machines from local disk).
    "$VPY" -m pip install -q torch==2.13.0
fi
if ! "$VPY" -c "import vllm, safetensors, pytest, hypothesis, ruff, mypy, tqdm, matplotlib, transformers, fastapi, uvicorn, prometheus_client, openai, httpx" 2>/dev/null; then
    "$VPY" -m pip install -q -e ".[dev]"
fi

case "$job" in
test)
    "$VPY" -m ruff check .
    "$VPY" -m ruff format --check .
    "$VPY" -m mypy
    "$VPY" -m pytest -q "$@"
    ;;
run)
    PYTHONPATH="$PWD" "$VPY" examples/online_serving.py "$@"
    ;;
offline)
    PYTHONPATH="$PWD" "$VPY" examples/offline_inference.py "$@"
    ;;
memory-report)
    PYTHONPATH="$PWD" "$VPY" -m benchmarks.moe_memory_report "$@"
    ;;
*)
    echo "usage: scripts/dev.sh {test|run|offline|memory-report} [args...]" >&2
    exit 2
    ;;
esac
