#!/usr/bin/env bash
# issue 10, run 5 (as run from a copy of the branch under .dev/transports of main): the timeline variants, the benches, the ipc GPU tests
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,utilization.gpu --format=csv
cd .dev/transports
python3 -m compileall -q src >/dev/null
export PYTHONPATH=$PWD/src
echo "=== branch timeline variants $(date +%T)"
timeout 150 python3 benchmarks/ipc_timeline.py --iters 30 --variants host:host,stream:host,host:stream --json $OUT/timeline_branch.json
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20"
for ready in host stream; do
  echo "=== bench 2 procs ready=$ready $(date +%T)"
  TORCHREFIT_IPC_READY=$ready timeout 90 $B --nproc 2 --mode non-collocated --transport ipc --label "tp1->tp1 2 procs ipc ready=$ready done=host" --json $OUT/noncolloc_ready_$ready.json
  echo "=== bench 4 procs ready=$ready $(date +%T)"
  TORCHREFIT_IPC_READY=$ready timeout 90 $B --nproc 4 --src tp2 --dst tp1 --transport ipc --label "tp2->tp1 4 procs ipc ready=$ready done=host" --json $OUT/colloc_ready_$ready.json
done
echo "=== tests $(date +%T)"
T="env TORCHREFIT_IPC_READY=host timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=line"
$T tests/test_gpu_stale_read.py -k "ipc"
$T tests/test_gpu_one_sided.py -k "ipc"
echo "=== producer wait removed: ipc cases must FAIL $(date +%T)"
TORCHREFIT_BREAK_PRODUCER_WAIT=1 $T tests/test_gpu_stale_read.py -k "refit_never and ipc"
echo "=== done $(date +%T)"
