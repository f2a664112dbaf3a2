#!/usr/bin/env bash
# Nineteenth session, third call (carry .whl/megatron): issue 16's shape matrix on main,
# megatron-core side by side, toy models with watch="every" (default) and "manual". $OUT; ~6 min.
source benchmarks/_h200_run.sh
h200_run nineteenth_matrix
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mcore .whl/megatron/*.whl
export PYTHONPATH=$PYTHONPATH:/tmp/mcore
timeout 560 python3 benchmarks/shape_matrix.py --watch-manual-too --json "$R/h200_shape_matrix.json" 2>&1 \
  | grep -v -i "warn\|^ *\"\"\"\|Evict"
echo "=== done ($(date +%T))"
