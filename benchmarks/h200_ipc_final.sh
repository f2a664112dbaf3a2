#!/usr/bin/env bash
# issue 10, after the re-check in the same call: ipc's two orders with more iterations, four
# processes also eagerly (no CUDA graph), the four-process physical floor without torchrefit,
# and the done wait removed (every ipc overwrite case must FAIL). $OUT must be set.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
B="python3 -m torchrefit bench --model gpt-4b --warmup 5 --iters 50"
for order in word event; do
  echo "=== 2 procs order=$order $(date +%T)"
  TORCHREFIT_IPC_ORDER=$order timeout 100 $B --variant graph --nproc 2 --mode non-collocated --transport ipc \
    --label "tp1->tp1 2 procs ipc order=$order" --json $OUT/final_noncolloc_$order.json 2>&1 | tail -2
done
echo "=== 4 procs order=word, graph and eager $(date +%T)"
timeout 150 $B --variant graph --variant plain --nproc 4 --src tp2 --dst tp1 --transport ipc \
  --label "tp2->tp1 4 procs ipc order=word" --json $OUT/final_colloc_word.json 2>&1 | tail -3
echo "=== 4 processes copying 8.88 GB each, no torchrefit $(date +%T)"
timeout 120 python3 benchmarks/shared_gpu_copies.py --nproc 4 --gb 8.88 --json $OUT/final_shared_gpu_copies_4.json 2>&1 | tail -6
echo "=== done wait removed: every ipc overwrite case must FAIL $(date +%T)"
TORCHREFIT_BREAK_DONE_WAIT=1 timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=no \
  tests/test_gpu_stale_read.py -k "overwrites and ipc" 2>&1 | tail -5
echo "=== done $(date +%T)"
