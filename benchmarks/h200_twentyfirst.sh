#!/usr/bin/env bash
# Twenty-first session, main with the dict-watching native holders check (Python 3.12
# here): the whole shape matrix with megatron-core side by side, toy rows with
# watch="every" (native) and "manual"; then the checks' host time right after a wait.
# Carry .whl/megatron. Results and log in $OUT. About 7 minutes.
source benchmarks/_h200_run.sh
h200_run twentyfirst
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mcore .whl/megatron/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/mcore
echo "=== 1. build ($(date +%T))"
python3 -m torchrefit native build || echo "not built"
echo "=== 2. shape matrix ($(date +%T))"
timeout 420 python3 benchmarks/shape_matrix.py --watch-manual-too --json "$R/h200_shape_matrix.json" 2>&1 \
  | grep -E "torchrefit .* floor|Error"
echo "=== 3. watch_check_lab ($(date +%T))"
timeout 60 python3 benchmarks/watch_check_lab.py --preset qwen3-30b-a3b --layers 8 --json "$R/watch_qwen3.json" 2>&1 | tail -1
echo "=== done ($(date +%T))"
