#!/usr/bin/env bash
# Tenth session, second call: the batched CUDA copy kernel (execute/copy_kernel.py) in
# copy_kernel_lab.py, then the nixl refit with this session's defaults (no progress
# thread, polled waits) and its GPU tests, with the producer wait removed too.
# nixl-cu13 importable beforehand. Results and log in $OUT (default benchmarks/results/h200/copy_kernel).
set -u
R=${OUT:-benchmarks/results/h200/copy_kernel}
mkdir -p "$R"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
exec > >(tee -a "$R/h200_copy_kernel.log") 2>&1
step() { echo; echo "=== $* ($(date +%T))"; }
python -m compileall -q src >/dev/null
step "copy kernels against memcpy"
timeout 200 python benchmarks/copy_kernel_lab.py --json "$R/copy_kernel_lab.json"
B="python -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --nproc 2 --mode non-collocated --transport nixl"
for i in 1 2; do
  step "nixl refit, defaults, run $i"
  timeout 150 $B --json "$R/bench_nixl_$i.json"
done
T="python -m pytest -q -p no:cacheprovider --tb=line"
step "nixl GPU tests"
timeout 200 $T tests/test_gpu_one_sided.py tests/test_gpu_stale_read.py -k nixl
step "nixl stale reads with the producer wait removed: must FAIL"
TORCHREFIT_BREAK_PRODUCER_WAIT=1 timeout 200 $T tests/test_gpu_stale_read.py -k "refit_never and nixl"
