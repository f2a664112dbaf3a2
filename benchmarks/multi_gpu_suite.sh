#!/usr/bin/env bash
# Refits between GPUs of one host with 2, 4 or 8 GPUs (nccl, gloo, ipc), and the GPU tests.
# Usage: bash benchmarks/multi_gpu_suite.sh N   (N = number of GPUs on this machine)
# Each bench run also measures the NCCL link between GPUs 0 and 1 and reports the floor per
# GPU (remote bytes / link bandwidth vs local bytes / HBM copy bandwidth) and link utilization.
set -u
N=${1:?number of GPUs}
R=${OUT:-benchmarks/results}
mkdir -p "$R"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
exec > >(tee "$R/multi_gpu_${N}.log") 2>&1
B="python -m torchrefit bench --model gpt-4b --variant graph"
run() { echo; echo "=== $* ($(date +%T))"; $B "$@"; }

for t in nccl gloo ipc; do
  run --nproc 2 --src tp2 --dst tp1 --transport $t --label "tp2->tp1 $t" --json "$R/gpu${N}_tp2_tp1_$t.json"
  run --nproc 2 --src tp1 --dst tp2 --transport $t --label "tp1->tp2 $t" --json "$R/gpu${N}_tp1_tp2_$t.json"
done
if [ "$N" -ge 4 ]; then
  run --nproc 4 --src tp2pp2 --dst tp4 --transport nccl --label "tp2pp2->tp4" --json "$R/gpu${N}_tp2pp2_tp4.json"
  run --nproc 4 --src tp2 --dst tp2 --mode non-collocated --transport nccl \
      --label "tp2(0-1)->tp2(2-3) non-collocated" --json "$R/gpu${N}_noncolloc_tp2_tp2.json"
fi
if [ "$N" -ge 8 ]; then
  run --nproc 8 --src tp8 --dst tp4 --transport nccl --label "tp8->tp4xdp2" --json "$R/gpu${N}_tp8_tp4dp2.json"
fi
echo; echo "=== correctness on the GPUs (nccl, gloo, ipc)"
python -m pytest -q -p no:cacheprovider tests/test_gpu_stale_read.py tests/test_gpu_layouts.py tests/test_gpu_ipc.py tests/test_gpu_refit.py
