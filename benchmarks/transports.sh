#!/usr/bin/env bash
# The gpt-4b preset refit through CUDA IPC between processes on one GPU, three layouts,
# ROUNDS rounds each (default 3), every result line beside the copy floor of the same run:
#   noncolloc2  TP1 -> TP1, trainer and engine in two processes (non-collocated)
#   colloc2     TP2 -> TP1 collocated, 2 processes
#   colloc4     TP2 -> TP1 collocated, 4 processes
# Usage: bash benchmarks/transports.sh [ROUNDS]   (repo root, one GPU; JSON in $R)
# Other transports run the same bench: --transport nccl | gloo | nvshmem | nixl.
set -u
ROUNDS=${1:-3}
R=${R:-${OUT:-benchmarks/results/$(bash "$(dirname "$0")/card.sh")/transports}}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
for round in $(seq "$ROUNDS"); do
  echo "=== ipc round $round ($(date +%T))"
  for layout in noncolloc2 colloc2 colloc4; do
    case $layout in
      noncolloc2) args="--mode non-collocated --nproc 2" ;;
      colloc2) args="--src tp2 --dst tp1 --nproc 2" ;;
      colloc4) args="--src tp2 --dst tp1 --nproc 4" ;;
    esac
    # shellcheck disable=SC2086
    timeout 120 python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 \
      --transport ipc $args --label "$layout" --json "$R/${layout}_$round.json" 2>&1 | tail -1
  done
done
