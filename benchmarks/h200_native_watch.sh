#!/usr/bin/env bash
# For the next session with a GPU (written in the twentieth, not yet run): the optional
# native watch check (3ba490d, `torchrefit native build`) on a GPU machine's host.
# 1. build it (the machine's C++ compiler; ~25 s) and say whether refits use it;
# 2. watch_check_lab.py per preset (the check's parts, Python and native, and a whole
#    refit's host time with watch="every");
# 3. the toy shape matrix with the default watch="every" (native) and "manual" side by
#    side, then qwen3 and dense-0.5b again with it off (TORCHREFIT_NATIVE_WATCH=0): issue
#    16's wall-time and host targets under the default;
# 4. ipc non-collocated TP1 -> TP1 and collocated TP2 -> TP1 (2 processes), every with
#    native / every without / manual (issue 10).
# Nothing to carry. Results and log in $OUT. About 8 minutes.
source benchmarks/_h200_run.sh
h200_run native_watch
echo "=== 1. build ($(date +%T))"
python3 -m torchrefit native build || echo "not built: every row below runs the Python checks"
echo "=== 2. watch_check_lab ($(date +%T))"
for p in "qwen3-30b-a3b 8" "gpt-4b 20" "dense-0.5b 24"; do
  set -- $p
  timeout 60 python3 benchmarks/watch_check_lab.py --preset $1 --layers $2 --json "$R/watch_$1.json" 2>&1 | tail -1
done
echo "=== 3. toy shape matrix, every (native) and manual ($(date +%T))"
timeout 240 python3 benchmarks/shape_matrix.py --no-megatron --watch-manual-too --json "$R/matrix_native.json" 2>&1 \
  | grep -E "torchrefit .* floor"
echo "=== 3b. the same without it ($(date +%T))"
TORCHREFIT_NATIVE_WATCH=0 timeout 90 python3 benchmarks/shape_matrix.py --no-megatron --only qwen3-30b-a3b \
  --only dense-0.5b --json "$R/matrix_python.json" 2>&1 | grep -E "torchrefit .* floor"
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc"
for mode in "--mode non-collocated" "--src tp2 --dst tp1"; do
  echo "=== 4. ipc $mode, 2 processes ($(date +%T))"
  timeout 60 $B $mode --nproc 2 --label "every native" --json "$R/ipc_${mode##* }_native.json" 2>&1 | tail -1
  TORCHREFIT_NATIVE_WATCH=0 timeout 60 $B $mode --nproc 2 --label "every python" \
    --json "$R/ipc_${mode##* }_python.json" 2>&1 | tail -1
  timeout 60 $B $mode --nproc 2 --watch manual --label manual --json "$R/ipc_${mode##* }_manual.json" 2>&1 | tail -1
done
echo "=== done ($(date +%T))"
