#!/usr/bin/env bash
# issue 10, run 6: ipc ordered by stream-written mailbox words (the default) against
# interprocess events, 2 and 4 processes on one GPU; where the time goes; the ipc GPU
# tests in both orders and with each wait removed (those must FAIL). Run from the
# repository root with $OUT set (the device tool sets it).
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,utilization.gpu --format=csv
export PYTHONPATH=$PWD/src
python3 -m compileall -q src >/dev/null
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20"
for order in word event; do
  echo "=== bench 2 procs order=$order $(date +%T)"
  TORCHREFIT_IPC_ORDER=$order timeout 120 $B --nproc 2 --mode non-collocated --transport ipc \
    --label "tp1->tp1 2 procs ipc order=$order" --json $OUT/noncolloc_$order.json
  echo "=== bench 4 procs order=$order $(date +%T)"
  TORCHREFIT_IPC_ORDER=$order timeout 120 $B --nproc 4 --src tp2 --dst tp1 --transport ipc \
    --label "tp2->tp1 4 procs ipc order=$order" --json $OUT/colloc_$order.json
done
echo "=== timeline, order=word $(date +%T)"
timeout 150 python3 benchmarks/ipc_timeline.py --iters 30 --variants word --json $OUT/timeline_word.json
echo "=== tests $(date +%T)"
T="timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=line"
$T tests/test_gpu_one_sided.py tests/test_gpu_stale_read.py -k "ipc"
echo "=== producer wait removed: every ipc stale-read case must FAIL $(date +%T)"
TORCHREFIT_BREAK_PRODUCER_WAIT=1 $T tests/test_gpu_stale_read.py -k "refit_never and ipc"
echo "=== done wait removed: every ipc overwrite case must FAIL $(date +%T)"
TORCHREFIT_BREAK_DONE_WAIT=1 $T tests/test_gpu_stale_read.py -k "overwrites and ipc"
echo "=== done $(date +%T)"
