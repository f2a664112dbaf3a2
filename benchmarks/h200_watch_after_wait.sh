#!/usr/bin/env bash
# Twenty-first session: watch="every"'s native checks right after the host waited for the
# device (as the benchmarks time a refit; there the qwen3 toy's every-refit host time was
# 1.3 ms against 0.6 ms warm on an H100 host, call 1 of this session).
# 1. build; the native tests (this machine's Python 3.12 runs the dict-watcher path,
#    which CI's 3.11 cannot);
# 2. watch_check_lab.py per preset: the checks after a wait (call 2 ran this at 4335d9d,
#    where the lab also compared fetching ahead 0/16 and the views split over intra-op
#    threads, --ahead/--grain; both were dropped in 5b0a2c9, slower or no faster);
# 3. the toy matrix rows every vs manual (qwen3, dense-0.5b, gpt-4b);
# 4. ipc non-collocated and collocated TP2 -> TP1 (2 processes), every vs manual.
# Nothing to carry. Results and log in $OUT.
source benchmarks/_h200_run.sh
h200_run watch_after_wait
echo "=== 1. build and tests ($(date +%T))"
python3 -m torchrefit native build || echo "not built"
python3 -c "import sys; print(sys.version)"
PYTHONPATH=src:tests timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_native_watch.py 2>&1 | tail -3
echo "=== 2. watch_check_lab ($(date +%T))"
for p in "qwen3-30b-a3b 8" "gpt-4b 20"; do
  set -- $p
  timeout 90 python3 benchmarks/watch_check_lab.py --preset $1 --layers $2 \
    --json "$R/watch_$1.json" 2>&1 | tail -1 | tr ' ' '\n' | grep -E "after_wait|holders_watched|_us=" | tr '\n' ' '
  echo
done
echo "=== 3. toy matrix, every and manual ($(date +%T))"
timeout 200 python3 benchmarks/shape_matrix.py --no-megatron --watch-manual-too --only qwen3-30b-a3b \
  --only dense-0.5b --only gpt-4b --json "$R/matrix.json" 2>&1 | grep -E "torchrefit .* floor"
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc"
for mode in "--mode non-collocated" "--src tp2 --dst tp1"; do
  echo "=== 4. ipc $mode, 2 processes ($(date +%T))"
  timeout 60 $B $mode --nproc 2 --label every --json "$R/ipc_${mode##* }_every.json" 2>&1 | tail -1
  timeout 60 $B $mode --nproc 2 --watch manual --label manual --json "$R/ipc_${mode##* }_manual.json" 2>&1 | tail -1
done
echo "=== done ($(date +%T))"
