#!/usr/bin/env bash
# Twenty-second session, call 1: main with the two-pass native views check (3bda1a4) and
# the holders check made at construction (6684d0e, b888801), neither timed on a GPU host
# before: the whole shape matrix with megatron-core side by side (toy rows with
# watch="every" and "manual"), then the checks' host time right after a wait.
# Carry .whl/megatron. Results and log in $OUT. About 6 minutes.
source benchmarks/_h200_run.sh
h200_run twentysecond
h200_with_megatron || echo "megatron-core not carried: toy models only"
echo "=== 1. build ($(date +%T))"
python3 -m torchrefit native build || echo "not built"
echo "=== 2. watch_check_lab ($(date +%T))"
timeout 60 python3 benchmarks/watch_check_lab.py --preset qwen3-30b-a3b --layers 8 --json "$R/watch_qwen3.json" 2>&1 | tail -1
timeout 60 python3 benchmarks/watch_check_lab.py --preset deepseek-v3-moe --layers 2 --json "$R/watch_deepseek.json" 2>&1 | tail -1
echo "=== 3. shape matrix ($(date +%T))"
timeout 420 python3 benchmarks/shape_matrix.py --watch-manual-too --json "$R/h200_shape_matrix.json" 2>&1 \
  | grep -E "torchrefit .* floor|Error"
echo "=== done ($(date +%T))"
