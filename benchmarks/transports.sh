#!/usr/bin/env bash
# The gpt-4b preset refit through each one-host transport, three layouts, ROUNDS rounds
# each (default 3), every result line beside the copy floor of the same run:
#   noncolloc2  TP1 -> TP1, trainer and engine in two processes (non-collocated)
#   colloc2     TP2 -> TP1 collocated, 2 processes
#   colloc4     TP2 -> TP1 collocated, 4 processes
# Usage: bash benchmarks/transports.sh [ROUNDS] [TRANSPORT...]   (repo root; JSON in $R)
# Transports (default: ipc nixl nvshmem): ipc and nixl run with the processes sharing one
# GPU; nvshmem needs one GPU per PE, so a layout runs only where there are that many GPUs
# (on one GPU it says so and runs nothing: see benchmarks/multi_gpu_suite.sh). A transport
# that cannot run here (nixl-cu13 or nvshmem4py-cu13 not installed) says why and is skipped.
# Files: ipc's as <layout>_<round>.json, the others' as <transport>_<layout>_<round>.json.
set -u
ROUNDS=${1:-3}
shift $(($# > 0 ? 1 : 0))
TRANSPORTS=${*:-ipc nixl nvshmem}
R=${R:-${OUT:-benchmarks/results/$(bash "$(dirname "$0")/card.sh")/transports}}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
for t in $TRANSPORTS; do
  why=$(python3 -c "from torchrefit.transport.base import transport_class as c; ok = c('$t').available(); print('' if ok else ok.reason)")
  if [ -n "$why" ]; then echo "=== $t: not run here: $why"; continue; fi
  for round in $(seq "$ROUNDS"); do
    echo "=== $t round $round ($(date +%T))"
    for layout in noncolloc2 colloc2 colloc4; do
      case $layout in
        noncolloc2) args="--mode non-collocated --nproc 2"; n=2 ;;
        colloc2) args="--src tp2 --dst tp1 --nproc 2"; n=2 ;;
        colloc4) args="--src tp2 --dst tp1 --nproc 4"; n=4 ;;
      esac
      if [ "$t" = nvshmem ] && [ "$GPUS" -lt "$n" ]; then
        echo "$layout: nvshmem needs $n GPUs (one PE per GPU), $GPUS here: not run"
        continue
      fi
      out="$R/${layout}_$round.json"
      [ "$t" = ipc ] || out="$R/${t}_${layout}_$round.json"
      # shellcheck disable=SC2086
      timeout 180 python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 \
        --transport "$t" $args --label "$t $layout" --json "$out" 2>&1 | tail -1
    done
  done
done
