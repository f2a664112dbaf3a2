#!/usr/bin/env bash
# The GPU paths under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which RL stacks often
# set: the allocator then maps memory in pages of one reserved range (CUDA VMM), so what
# torchrefit takes for an allocation (runs merged across tensors, ipc's segments, a
# peer's storage opened through torch's expandable-segment IPC) differs from cudaMalloc's.
# Written in the seventeenth session (no device lent). Its first run (eighteenth session, an
# H100) found every graph-path test failing with the setting ("span outside its allocation");
# fixed on main after it (1432fcb, ipc's export after it), not yet re-run. Nothing to carry
# (nixl cases run where .whl/nixl is carried). Results and log in $OUT. About 6 minutes.
# 1. the GPU tests of the refit, the batched kernel, the one-sided transports, stale reads
#    and the caller's state, with the setting;
# 2. ipc collocated TP2 -> TP1 (2 processes, the delegate) and the qwen3 toy, with and
#    without it, alternating: what it does to the floor ratio and the first refit.
source benchmarks/_h200_run.sh
h200_run expandable_segments
h200_with_nixl || echo "nixl not carried: its cases skip"
export PYTORCH_CUDA_ALLOC_CONF_SET="expandable_segments:True"
echo "=== 1. GPU tests with expandable segments ($(date +%T))"
timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=line -rf --timeout 150 tests/test_gpu_expandable.py 2>&1 \
  | grep -E "Error|^FAILED|passed|failed" | cut -c1-300 | tail -12
PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF_SET timeout 330 python3 -m pytest -q -p no:cacheprovider \
  --tb=line -rf --timeout 120 tests/test_gpu_refit.py tests/test_gpu_batched.py tests/test_gpu_one_sided.py \
  tests/test_gpu_stale_read.py tests/test_caller_state.py 2>&1 | grep -E "Error|^FAILED|passed|failed" | cut -c1-300 | tail -16
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc --src tp2 --dst tp1 --nproc 2"
Q="python3 -m torchrefit bench --model qwen3-30b-a3b --layers 8 --variant graph --warmup 3 --iters 20"
for i in 1 2; do
  for conf in default expandable; do
    echo "=== 2. ipc collocated and qwen3 toy, $conf, round $i ($(date +%T))"
    env $([ $conf = expandable ] && echo PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF_SET) \
      timeout 100 $B --label ipc_${conf}_$i --json "$R/ipc_${conf}_$i.json" 2>&1 | tail -1
    env $([ $conf = expandable ] && echo PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF_SET) \
      timeout 100 $Q --label qwen3_${conf}_$i --json "$R/qwen3_${conf}_$i.json" 2>&1 | tail -1
  done
done
echo "=== done ($(date +%T))"
