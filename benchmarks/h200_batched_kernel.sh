#!/usr/bin/env bash
# Tenth session: the batched CUDA copy kernel through the executor. GPU tests of the
# batched path and the graph path, the kernel's first-use cost, then the shape matrix
# (megatron-core and toy models) for $ONLY (default: every preset). megatron-core
# importable beforehand. Results and log in $OUT (default benchmarks/results/h200/batched_kernel).
set -u
R=${OUT:-benchmarks/results/h200/batched_kernel}
mkdir -p "$R"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
exec > >(tee -a "$R/h200_batched_kernel.log") 2>&1
step() { echo; echo "=== $* ($(date +%T))"; }
python -m compileall -q src >/dev/null
if [ -z "${SKIP_TESTS:-}" ]; then
  step "GPU tests: batched copies, graph path"
  timeout 200 python -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_batched.py tests/test_gpu_refit.py
  step "the kernel's first use in a process"
  timeout 60 python benchmarks/batched_first_use.py --json "$R/batched_first_use.json"
fi
step "shape matrix ${ONLY:-all presets}"
O=""; for p in ${ONLY:-}; do O="$O --only $p"; done
timeout ${MATRIX_TIMEOUT:-420} python benchmarks/shape_matrix.py --also-toy $O --json "$R/h200_shape_matrix${TAG:-}.json" 2>&1 \
  | grep -v -E "Warning|warnings.warn|^\s+\"\"\"|^\s*$"
