#!/usr/bin/env bash
# Twentieth session, second H200 call (carry .whl/nixl): main at c42b6a9 and later
# (0.5 B dense batched from 64 mid-sized copies; test_gpu_batched's pitched-run count):
# 1. GPU tests of the batched kernel, the refit and the one-sided transports;
# 2. tests/test_gpu_expandable.py;
# 3. the dense-0.5b toy, default (now batched) and watch="manual", twice;
# 4. issue 10: ipc non-collocated TP1 -> TP1, 2 processes;
# 5. stale reads with the producer waits removed: each ipc / nixl case must FAIL.
# Results and log in $OUT. About 8 minutes.
source benchmarks/_h200_run.sh
h200_run twentieth
h200_with_nixl || echo "nixl not carried: its cases skip"
echo "=== 1. GPU tests ($(date +%T))"
timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short -rf --timeout 120 tests/test_gpu_batched.py \
  tests/test_gpu_refit.py tests/test_gpu_one_sided.py 2>&1 | grep -E "Error|^E |^FAILED|passed|failed" | cut -c1-300 | tail -14
echo "=== 2. tests/test_gpu_expandable.py ($(date +%T))"
timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short -rf --timeout 80 tests/test_gpu_expandable.py 2>&1 \
  | grep -E "Error|^FAILED|passed|failed|skipped" | cut -c1-300 | tail -8
for i in 1 2; do
  echo "=== 3. dense-0.5b toy, run $i ($(date +%T))"
  timeout 45 python3 benchmarks/shape_matrix.py --no-megatron --only dense-0.5b --watch-manual-too \
    --json "$R/dense_$i.json" 2>&1 | grep -E "torchrefit .* floor" | tail -2
done
echo "=== 4. issue 10: ipc non-collocated TP1 -> TP1, 2 processes ($(date +%T))"
timeout 60 python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc \
  --nproc 2 --mode non-collocated --label "tp1->tp1 2 procs ipc" --json "$R/noncolloc2.json" 2>&1 | tail -1
echo "=== 5. stale reads with the producer waits removed: ipc and nixl cases must FAIL ($(date +%T))"
h200_broken_stale_read PRODUCER_WAIT
echo "=== done ($(date +%T))"
