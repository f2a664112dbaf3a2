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
#   bash benchmarks/gpu_twentyfourth.sh issue10 # ~4 min: min's tests and bench, and its ipc cases with
#                                               # each wait removed
#   bash benchmarks/gpu_twentyfourth.sh helper  # ~5 min: patches/watch_helper_thread.patch (a
#     helper thread checking chunks of the views; on the CPU VM 17% less warm, nothing
#     after a wait) against main: watch_check_lab, then qwen3's toy row, each twice, alternating
#   bash benchmarks/gpu_twentyfourth.sh dense   # ~2 min: dense-0.5b's toy rows with its small copies
#     in the batched launch (patches/small_batched.patch, TORCHREFIT_SMALL_BATCHED=1: one
#     kernel node, no foreach) against without, alternating
# Nothing to carry. Results and log in $OUT.
source benchmarks/_h200_run.sh
h200_run "twentyfourth_${1:?tests, bench, all, short, min, issue10, helper or dense}"
h200_card
# What each mode runs: GPU tests (pytest arguments; none: no tests) and their limit, the
# stale-read test's waits removed, ipc bench rounds (0: none), and whether the 2-process
# layouts run beside the 4-process one.
TESTS=() LIMIT=200 BROKEN="" ROUNDS=0 PAIRS=1
case $1 in
  tests) TESTS=(tests) LIMIT=330 BROKEN="PRODUCER_WAIT DONE_WAIT" ;;
  bench) ROUNDS=3 ;;
  all) TESTS=(tests/test_gpu_one_sided.py tests/test_gpu_stale_read.py tests/test_gpu_refit.py)
       BROKEN="PRODUCER_WAIT DONE_WAIT" ROUNDS=3 ;;
  short) TESTS=(tests/test_gpu_one_sided.py tests/test_gpu_stale_read.py) BROKEN=PRODUCER_WAIT ROUNDS=2 ;;
  min | issue10) TESTS=(tests/test_gpu_one_sided.py tests/test_gpu_stale_read.py -k "ipc or stream_words")
                 ROUNDS=2 PAIRS=0
                 [ "$1" = issue10 ] && BROKEN="PRODUCER_WAIT DONE_WAIT" ;;
  helper | dense) ;;
  *) echo "unknown mode: $1"; exit 2 ;;
esac

# `ab PATCH KNOB NAME ARGS...`: python3 ARGS on the tree with PATCH applied, KNOB=1 then 0,
# twice each, alternating; results $R/NAME_KNOB<v>_<k>.json
ab() {
  local patch=$1 knob=$2 name=$3 tree k=0 v
  shift 3
  tree=$(h200_patched_tree "$patch") || exit 1
  PYTHONPATH=$tree/src python3 -m torchrefit native build >/dev/null && echo "patched native built"
  for v in 1 0 1 0; do
    k=$((k + 1))
    echo "=== $name, $knob=$v ($(date +%T))"
    env "$knob=$v" PYTHONPATH="$tree/src" timeout 90 python3 "$@" --json "$R/${name}_$knob${v}_$k.json" 2>&1 \
      | grep -E "^preset=|torchrefit .* floor|Error" | cut -c1-700
  done
}

if [ "$1" = helper ]; then
  ab benchmarks/patches/watch_helper_thread.patch TORCHREFIT_WATCH_THREADS watch_qwen3 \
    benchmarks/watch_check_lab.py --preset qwen3-30b-a3b --layers 8
  ab benchmarks/patches/watch_helper_thread.patch TORCHREFIT_WATCH_THREADS qwen3_row \
    benchmarks/shape_matrix.py --no-megatron --only qwen3-30b-a3b
elif [ "$1" = dense ]; then
  ab benchmarks/patches/small_batched.patch TORCHREFIT_SMALL_BATCHED dense_rows \
    benchmarks/shape_matrix.py --no-megatron --only dense-0.5b --watch-manual-too
fi
if [ ${#TESTS[@]} -gt 0 ]; then
  echo "=== GPU tests ($(date +%T))"
  timeout "$LIMIT" python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu "${TESTS[@]}" 2>&1 | tail -25
fi
for wait in $BROKEN; do
  echo "=== $wait removed: these must FAIL ($(date +%T))"
  h200_broken_stale_read "$wait" -k ipc
done
for ((i = 1; i <= ROUNDS; i++)); do
  echo "=== ipc bench round $i ($(date +%T))"
  if [ "$PAIRS" = 1 ]; then
    h200_ipc_bench noncolloc2 "$i"
    h200_ipc_bench colloc2 "$i"
  fi
  h200_ipc_bench colloc4 "$i"
done
echo "=== done ($(date +%T))"
