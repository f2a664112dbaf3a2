#!/usr/bin/env bash
# Twenty-sixth session, on whichever card comes (the log names it), about 3 minutes:
# 1. where `watch="every"`'s cold host time goes: `watch_check_lab.py` on qwen3 (8 layers)
#    with tiny tensors after a 7 ms and a 20 ms wait, then with the preset's own sizes (the
#    shape matrix's toy row), each also timed as the matrix's host columns time it
#    (`every_refit_host_matrix_cold_us`): the H200 matrix's cold host time was 3-6x the lab's;
# 2. issue 10's two 2-process ipc layouts (TP1 -> TP1 non-collocated, TP2 -> TP1
#    collocated), two rounds each, alternating.
#   bash benchmarks/gpu_twentysixth.sh
#   bash benchmarks/gpu_twentysixth.sh short   # ~1.5 min: no 20 ms wait, one bench round
#   bash benchmarks/gpu_twentysixth.sh deepseek   # (not run yet) an H200 (needs_h200): the lab on
#     deepseek-v3-moe (2 layers) at its own sizes, then its toy row under watch="every"
# Nothing to carry. Results and log in $OUT (at most 8 files come back: 3 labs, 4 benches, the log).
source benchmarks/_h200_run.sh
h200_run twentysixth
h200_card
if [ "${1:-}" = deepseek ]; then
  timeout 120 python3 benchmarks/watch_check_lab.py --preset deepseek-v3-moe --layers 2 --full-size \
    --json "$R/lab_deepseek_full.json" 2>&1 | tail -1 | tr ' ' '\n' | grep -E "after_wait|matrix|native_views_us|every_refit_host_us"
  timeout 90 python3 benchmarks/shape_matrix.py --no-megatron --only deepseek-v3-moe --json "$R/deepseek_row.json" \
    2>&1 | grep -E "torchrefit .* floor|Error"
  echo "=== done ($(date +%T))"
  exit 0
fi
L="python3 benchmarks/watch_check_lab.py --preset qwen3-30b-a3b --layers 8"
RUNS=("tiny_wait7 --wait-ms 7" "tiny_wait20 --wait-ms 20" "full_wait7 --wait-ms 7 --full-size") ROUNDS=2
[ "${1:-}" = short ] && RUNS=("${RUNS[0]}" "${RUNS[2]}") ROUNDS=1
for run in "${RUNS[@]}"; do
  set -- $run
  name=$1
  shift
  echo "=== lab $name ($(date +%T))"
  timeout 120 $L "$@" --json "$R/lab_$name.json" 2>&1 | tail -1 | tr ' ' '\n' \
    | grep -E "after_wait|matrix|native_views_us|every_refit_host_us|manual_refit_host_us"
done
for ((i = 1; i <= ROUNDS; i++)); do
  echo "=== ipc bench round $i ($(date +%T))"
  h200_ipc_bench noncolloc2 "$i"
  h200_ipc_bench colloc2 "$i"
done
echo "=== done ($(date +%T))"
