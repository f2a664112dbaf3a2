#!/usr/bin/env bash
# Issue 10 lab on one H200 (tenth session): NIXL alone under UCX settings (nixl_lab.py),
# and the nixl refit with and without NIXL's progress thread. (Its run in BENCHMARKS.md,
# call 1, also ran a draft of copy_kernel_lab.py first, not quoted; the committed lab runs
# in h200_copy_kernel.sh.) nixl-cu13 importable beforehand
# (pip install --no-deps --target /tmp/site .whl/nixl/*.whl; PYTHONPATH=/tmp/site).
# Results and log go to $OUT (default benchmarks/results/h200/nixl_lab).
set -u
R=${OUT:-benchmarks/results/h200/nixl_lab}
mkdir -p "$R"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
exec > >(tee -a "$R/h200_nixl_lab.log") 2>&1
step() { echo; echo "=== $* ($(date +%T))"; }
python -m compileall -q src >/dev/null
step "nixl alone, default UCX, protocols used"
UCX_PROTO_INFO=used timeout 90 python benchmarks/nixl_lab.py --json "$R/nixl_default.json"
i=0
for v in "LAB_PROGRESS_THREAD=0" "UCX_CUDA_IPC_MAX_STREAMS=1" "UCX_CUDA_IPC_BW=4000GBps" \
         "UCX_TLS=cuda_ipc,cuda_copy,sm,self" "UCX_CUDA_IPC_CACHE=n"; do
  i=$((i+1))
  step "nixl alone, $v"
  env $v timeout 90 python benchmarks/nixl_lab.py --port $((29540+i)) --json "$R/nixl_$i.json"
done
B="python -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --nproc 2 --mode non-collocated --transport nixl"
# the thread named both ways: its default was on when this ran first, off since fa4f94c
step "nixl refit, with NIXL's progress thread"
TORCHREFIT_NIXL_PROGRESS_THREAD=1 timeout 150 $B --json "$R/bench_nixl_default.json"
step "nixl refit, no progress thread"
TORCHREFIT_NIXL_PROGRESS_THREAD=0 timeout 150 $B --json "$R/bench_nixl_nothread.json"
