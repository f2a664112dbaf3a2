#!/usr/bin/env bash
# Issue 16 after plain copies became SM kernels in mostly-mid-sized programs: the GPU
# tests of the local-copy path, the mid-sized copies lab for qwen3 (hand-captured
# arrangements and the executor's switches), and the shape matrix with megatron-core
# side by side and toy models, in one GPU call.
# Run from the repository root with $OUT set and megatron-core importable.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
echo "=== 1. GPU tests of the local-copy path $(date +%T)"
timeout 200 python3 -m pytest -q tests/test_gpu_refit.py tests/test_gpu_batched.py 2>&1 | tail -3
echo "=== 2. mid-sized copies, qwen3 $(date +%T)"
(cd benchmarks && timeout 150 python3 mid_copy_lab.py --only qwen3 --json $OUT/mid_copy_lab_qwen3.json 2>&1 \
  | grep -v Warn | grep -v "^  return")
echo "=== 3. shape matrix $(date +%T)"
timeout 330 python3 benchmarks/shape_matrix.py --also-toy --json $OUT/h200_shape_matrix.json 2>&1 \
  | grep -v Warn | grep -v "^  return" | tee $OUT/h200_shape_matrix.log
echo "=== done $(date +%T)"
