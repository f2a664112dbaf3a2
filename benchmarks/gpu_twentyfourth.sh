#!/usr/bin/env bash
# Twenty-fourth session, on whichever card comes (the log names it). `tests`: every GPU
# test on main (ipc's stream word asking the driver, 95a6461, and the native views' huge
# pages, d4fb7ac, never ran on a GPU before), then the stale-read test with the producer
# wait and the done wait removed (its ipc cases must FAIL). `bench`: issue 10's ipc refit
# of the seed's model, three layouts (TP1 -> TP1 non-collocated, TP2 -> TP1 collocated on
# 2 and on 4 processes), three rounds each, alternating.
#   bash benchmarks/gpu_twentyfourth.sh tests   # ~5 min
#   bash benchmarks/gpu_twentyfourth.sh bench   # ~5 min
#   bash benchmarks/gpu_twentyfourth.sh all     # ~6 min: the one-sided, stale-read and refit GPU
#                                               # tests, both waits removed, then the bench
#   bash benchmarks/gpu_twentyfourth.sh short   # ~4 min: the one-sided and stale-read tests, the
#                                               # producer wait removed, the bench's rounds 1-2
#   bash benchmarks/gpu_twentyfourth.sh min     # ~2.5 min: the one-sided tests and the stale-read
#                                               # test's ipc cases, 4 processes' bench twice
#   bash benchmarks/gpu_twentyfourth.sh helper  # ~4 min: patches/watch_helper_thread.patch (a
#     helper thread checking chunks of the views; on the CPU VM 17% less warm, nothing
#     after a wait) against main: watch_check_lab and qwen3's toy row, alternating
#   bash benchmarks/gpu_twentyfourth.sh dense   # ~2 min: dense-0.5b's toy rows with its small copies
#     in the batched launch (patches/small_batched.patch, TORCHREFIT_SMALL_BATCHED=1: one
#     kernel node, no foreach) against without, alternating
# Nothing to carry. Results and log in $OUT.
source benchmarks/_h200_run.sh
h200_run "twentyfourth_${1:?tests, bench, all, short, min, helper or dense}"
nvidia-smi -q | grep -iE "product name|driver version" | sed 's/  */ /g'
python3 -m torchrefit native build >/dev/null && echo "native built" || echo "not built"
echo "main at $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)')"
k=0
if [ "$1" = helper ]; then
  HELPER=$(h200_patched_tree benchmarks/patches/watch_helper_thread.patch) || exit 1
  PYTHONPATH=$HELPER/src python3 -m torchrefit native build >/dev/null && echo "patched native built"
  for t in 1 0 1 0; do
    k=$((k + 1))  # here, not in the pipeline below (a subshell's count stays there)
    echo "=== watch_check_lab qwen3, TORCHREFIT_WATCH_THREADS=$t ($(date +%T))"
    TORCHREFIT_WATCH_THREADS=$t PYTHONPATH=$HELPER/src timeout 90 python3 benchmarks/watch_check_lab.py \
      --preset qwen3-30b-a3b --layers 8 --json "$R/watch_qwen3_threads${t}_$k.json" | tail -1 | cut -c1-700
  done
  for t in 1 0; do
    echo "=== qwen3 toy row, TORCHREFIT_WATCH_THREADS=$t ($(date +%T))"
    TORCHREFIT_WATCH_THREADS=$t PYTHONPATH=$HELPER/src timeout 90 python3 benchmarks/shape_matrix.py --no-megatron \
      --only qwen3-30b-a3b --json "$R/qwen3_threads$t.json" 2>&1 | grep -E "torchrefit .* floor|Error"
  done
  echo "=== done ($(date +%T))"
  exit 0
fi
if [ "$1" = dense ]; then
  SMALL=$(h200_patched_tree benchmarks/patches/small_batched.patch) || exit 1
  for s in 1 0 1 0; do
    k=$((k + 1))
    echo "=== dense-0.5b toy rows, TORCHREFIT_SMALL_BATCHED=$s ($(date +%T))"
    TORCHREFIT_SMALL_BATCHED=$s PYTHONPATH=$SMALL/src timeout 60 python3 benchmarks/shape_matrix.py --no-megatron \
      --only dense-0.5b --watch-manual-too --json "$R/dense_small_batched${s}_$k.json" 2>&1 \
      | grep -E "torchrefit .* floor|Error"
  done
  echo "=== done ($(date +%T))"
  exit 0
fi
if [ "$1" != bench ]; then
  echo "=== 1. GPU tests ($(date +%T))"
  if [ "$1" = all ]; then
    set -- all tests/test_gpu_one_sided.py tests/test_gpu_stale_read.py tests/test_gpu_refit.py
  elif [ "$1" = short ]; then
    set -- short tests/test_gpu_one_sided.py tests/test_gpu_stale_read.py
  elif [ "$1" = min ]; then
    set -- min tests/test_gpu_one_sided.py tests/test_gpu_stale_read.py -k "ipc or stream_words"
  else
    set -- tests tests
  fi
  timeout $([ "$1" = tests ] && echo 330 || echo 200) python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu "${@:2}" 2>&1 | tail -25
  if [ "$1" != min ]; then
    echo "=== 2. producer wait removed: these must FAIL ($(date +%T))"
    h200_broken_stale_read PRODUCER_WAIT -k ipc
  fi
  if [ "$1" = all ] || [ "$1" = tests ]; then
    echo "=== 3. done wait removed: these must FAIL ($(date +%T))"
    h200_broken_stale_read DONE_WAIT -k ipc
  fi
fi
if [ "$1" != tests ]; then
  B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc"
  for i in $([ "$1" = short ] || [ "$1" = min ] && echo 1 2 || echo 1 2 3); do
    echo "=== ipc bench round $i ($(date +%T))"
    if [ "$1" != min ]; then
      timeout 60 $B --mode non-collocated --nproc 2 --label noncolloc2 --json "$R/noncolloc2_$i.json" 2>&1 | tail -1
      timeout 60 $B --src tp2 --dst tp1 --nproc 2 --label colloc2 --json "$R/colloc2_$i.json" 2>&1 | tail -1
    fi
    timeout 90 $B --src tp2 --dst tp1 --nproc 4 --label colloc4 --json "$R/colloc4_$i.json" 2>&1 | tail -1
  done
fi
echo "=== done ($(date +%T))"
