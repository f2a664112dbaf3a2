#!/usr/bin/env bash
# Issue 16 on one H200: the batched-copy GPU tests, the shape matrix with the opt-in batched
# kernel (megatron-core side by side), the per-copy default for comparison, and the batched
# kernel's first use. (Ran at commit afc454d, where the batched kernel was the default,
# with the flags then named: see BENCHMARKS.md.) Run from the
# repo root with megatron-core importable; results and log under $OUT.
set -u -o pipefail
R=${OUT:-benchmarks/results}
mkdir -p "$R"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
step() { echo; echo "=== $* ($(date +%T))"; }
step "batched kernel: first use, Triton cache empty then filled"
export TRITON_CACHE_DIR=$(mktemp -d)
python benchmarks/batched_first_use.py --json "$R/h200_batched_first_use_cold.json"
python benchmarks/batched_first_use.py --json "$R/h200_batched_first_use_warm.json"
step "GPU tests: batched copies, graph path with and without the batch, merged runs"
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_gpu_batched.py tests/test_gpu_refit.py
step "shape matrix, batched copies (opt-in)"
python benchmarks/shape_matrix.py --batched --json "$R/h200_shape_matrix_batched.json"
step "per-copy path (the default), torchrefit only on toy models, same machine"
python benchmarks/shape_matrix.py --no-megatron --only qwen3-30b-a3b --only dense-0.5b \
  --only deepseek-v3-moe --json "$R/h200_shape_matrix_per_copy_toy.json"
step "one-sided GPU tests (pull copies go through compile_copies too)"
timeout 30 python -m pytest -q -p no:cacheprovider -x tests/test_gpu_one_sided.py
step done
