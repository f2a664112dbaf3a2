#!/usr/bin/env bash
# Issue 16's mid-sized copies (benchmarks/mid_copy_lab.py) and issue 10's non-collocated
# TP1 -> TP1 through ipc three times (is 1.05x steady?), in one GPU call.
# Run from the repository root with $OUT set.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
echo "=== 1. mid-sized copies $(date +%T)"
timeout 330 python3 benchmarks/mid_copy_lab.py --json $OUT/mid_copy_lab.json
echo "=== 2. tp1 -> tp1 non-collocated through ipc, three runs $(date +%T)"
for i in 1 2 3; do
  timeout 90 python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 50 \
    --nproc 2 --mode non-collocated --transport ipc \
    --label "tp1->tp1 non-collocated 2 procs ipc run $i" --json $OUT/noncolloc2_run$i.json 2>&1 | tail -1
done
echo "=== done $(date +%T)"
