#!/usr/bin/env bash
# Nineteenth session, first H200 call (carry .whl/nixl): the expandable-segments fixes
# (1432fcb .. c370d82) on a GPU for the first time, then issue 10's ipc figures on main
# (non-collocated TP1 -> TP1 with 2 processes, collocated TP2 -> TP1 with 2 and 4), then
# the stale-read tests with the producer waits removed (each transport's cases must FAIL).
# Results and log in $OUT. About 7 minutes.
source benchmarks/_h200_run.sh
h200_run nineteenth_first
h200_with_nixl || echo "nixl not carried: its cases skip"
E="expandable_segments:True"
echo "=== 1. tests/test_gpu_expandable.py ($(date +%T))"
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short -rf --timeout 120 tests/test_gpu_expandable.py 2>&1 \
  | grep -E "Error|^FAILED|passed|failed|skipped" | cut -c1-400 | tail -12
echo "=== 2. GPU tests with PYTORCH_CUDA_ALLOC_CONF=$E ($(date +%T))"
PYTORCH_CUDA_ALLOC_CONF=$E timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=line -rf --timeout 120 \
  tests/test_gpu_refit.py tests/test_gpu_batched.py tests/test_gpu_one_sided.py tests/test_gpu_stale_read.py \
  tests/test_caller_state.py 2>&1 | grep -E "Error|^FAILED|passed|failed" | cut -c1-300 | tail -16
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc"
echo "=== 3. issue 10: ipc on main, default allocator ($(date +%T))"
timeout 100 $B --nproc 2 --mode non-collocated --label "tp1->tp1 2 procs ipc" --json "$R/noncolloc2.json" 2>&1 | tail -1
for n in 2 4; do
  timeout 100 $B --src tp2 --dst tp1 --nproc $n --label "tp2->tp1 collocated $n procs ipc" \
    --json "$R/colloc$n.json" 2>&1 | tail -1
done
echo "=== 4. stale reads with the producer waits removed: ipc and nixl cases must FAIL ($(date +%T))"
h200_broken_stale_read PRODUCER_WAIT
echo "=== done ($(date +%T))"
