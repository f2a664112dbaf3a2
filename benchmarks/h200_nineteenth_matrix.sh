#!/usr/bin/env bash
# Nineteenth session, third call (carry .whl/megatron): issue 16's shape matrix on main,
# megatron-core side by side, toy models with watch="every" (default) and "manual". $OUT; ~6 min.
source benchmarks/_h200_run.sh
h200_run nineteenth_matrix
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mcore .whl/megatron/*.whl
export PYTHONPATH=$PYTHONPATH:/tmp/mcore
timeout 420 python3 benchmarks/shape_matrix.py --watch-manual-too --json "$R/h200_shape_matrix.json" 2>&1 \
  | grep -v -i "warn\|^ *\"\"\"\|Evict"
# dense-0.5b's device time was 1.056-1.065x on an H200 (eleventh session): its ~100 large
# copies are under KERNEL_MIN_COPIES, so memcpy nodes; on an H100 batching them all gave 1.010x
for i in 1 2; do
  for mode in default batched; do
    echo "=== dense-0.5b toy, $mode ($(date +%T))"
    timeout 60 python3 benchmarks/shape_matrix.py --no-megatron --only dense-0.5b $([ $mode = batched ] && echo --batched) \
      --json "$R/dense_${mode}_$i.json" 2>&1 | grep -E "torchrefit .* floor" | tail -2
  done
done
echo "=== done ($(date +%T))"
