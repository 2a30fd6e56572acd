set -x
nvidia-smi --query-gpu=name,clocks.sm --format=csv
export PYTHONPATH=.
GPU_TESTS_ONLY=1 timeout 420 python3 -m pytest -q -p no:cacheprovider -n 14 -W ignore \
  tests/model_executor/kernels/common tests/model_executor/layers/test_linear.py \
  tests/model_executor/layers/fused_moe/test_layer.py tests/model_executor/layers/fused_moe/test_routing.py \
  tests/model_executor/models tests/v1/worker 2>&1 | tail -25
timeout 150 python3 -m benchmarks.kernels.benchmark_skinny_gemm --rows 1 2 --layers router qkv_proj o_proj
