#!/usr/bin/env bash
# After h200_mid_matrix.sh: every GPU test on the final tree, qwen3 in the shape matrix's own
# layout with every plain large copy as a kernel and with none (A/B of the default rule,
# toy models), then the stale-read test with the producer waits removed (must fail).
# Run from the repository root with $OUT set and megatron-core importable.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
echo "=== 1. every GPU test $(date +%T)"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ --timeout 120 -rfs 2>&1 | tail -8 | tee $OUT/gpu_tests.log
echo "=== 2. qwen3 in the matrix's layout: default, all kernels, none $(date +%T)"
M="python3 benchmarks/shape_matrix.py --no-megatron --only qwen3-30b-a3b"
for v in default all none; do
  case $v in default) unset TORCHREFIT_SM_COPY_BELOW;; all) export TORCHREFIT_SM_COPY_BELOW=$((1<<50));;
    none) export TORCHREFIT_SM_COPY_BELOW=0;; esac
  timeout 60 $M --json $OUT/qwen3_toy_$v.json 2>&1 | grep "\[toy\]" | sed "s/^/$v: /"
done
unset TORCHREFIT_SM_COPY_BELOW
echo "=== 3. stale-read test with the producer waits removed: each case must FAIL $(date +%T)"
TORCHREFIT_BREAK_PRODUCER_WAIT=1 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_stale_read.py \
   --timeout 60 2>&1 | grep -E "passed|failed" | tail -3 | tee $OUT/stale_broken.log
echo "=== done $(date +%T)"
