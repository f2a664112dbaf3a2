#!/usr/bin/env bash
# Twenty-third session's device plan, written when no device was lent (run it in a later
# session, on whichever card comes; say which). Issue 10's ipc after the cold host path
# was trimmed (benchmarks/patches/cold_host_path.patch: the stream's raw handle and the
# driver's query for ipc's words, grad mode switched by hand, set_aside's fast path,
# mailbox words as int64 items (take included), the mailbox switch read once, tables made once), and
# issue 16's views check with its metadata in huge pages (TORCHREFIT_HUGE_PAGES=1 / 0).
# Then the shape matrix: bash benchmarks/h200_twentysecond.sh (carry .whl/megatron; the
# deepseek rows need an H200's memory).
#   bash benchmarks/h200_twentythird.sh labs   # ~4 min: what each step costs, huge pages, timelines
#   bash benchmarks/h200_twentythird.sh bench  # ~6 min: ipc bench, trimmed and not, alternating
# Nothing to carry. Results and log in $OUT.
source benchmarks/_h200_run.sh
h200_run "twentythird_${1:?labs or bench}"
nvidia-smi -q | grep -iE "product name|driver version|virtualization mode|confidential|compute mode|persistence" \
  | sed 's/  */ /g'
python3 -m torchrefit native build >/dev/null && echo "native built" || echo "not built"
BEFORE=$(h200_patched_tree benchmarks/patches/cold_host_path.patch -R) || exit 1
if [ "$1" = labs ]; then
  echo "=== 1. cold host calls ($(date +%T))"
  timeout 120 python3 benchmarks/cold_host_calls.py --json "$R/cold_host_calls.json"
  for t in 1 0; do
    echo "=== 1b. watch_check_lab qwen3, TORCHREFIT_HUGE_PAGES=$t ($(date +%T))"
    TORCHREFIT_HUGE_PAGES=$t timeout 120 python3 benchmarks/watch_check_lab.py --preset qwen3-30b-a3b --layers 8 \
      --json "$R/watch_qwen3_huge$t.json" | tail -1 | cut -c1-600
  done
  echo "=== 2. stream query lab: solo, peer idle, peer busy ($(date +%T))"
  timeout 240 python3 benchmarks/stream_query_lab.py --json "$R/stream_query_lab.json" 2>&1 | grep -E "^peer_"
  for tree in "" "$BEFORE"; do
    for mode in "" --collocated; do
      echo "=== 3. one_sided_first_refit $mode ${tree:+(before the trim)} ($(date +%T))"
      PYTHONPATH=${tree:+$tree/src:}$PYTHONPATH timeout 120 python3 ${tree:-.}/benchmarks/one_sided_first_refit.py \
        --transport ipc $mode 2>&1 | grep -E "^rank [0-9]: (refit wall|left the|construct)" | cut -c1-400
    done
  done
else
  B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc"
  for i in 1 2 3; do
    echo "=== ipc bench round $i ($(date +%T))"
    timeout 50 $B --mode non-collocated --nproc 2 --label noncolloc2 --json "$R/noncolloc2_$i.json" 2>&1 | tail -1
    PYTHONPATH=$BEFORE/src:$PYTHONPATH timeout 50 $B --mode non-collocated --nproc 2 --label noncolloc2_before \
      --json "$R/noncolloc2_before_$i.json" 2>&1 | tail -1
  done
  for i in 1 2; do
    timeout 50 $B --src tp2 --dst tp1 --nproc 2 --label colloc2 --json "$R/colloc2_$i.json" 2>&1 | tail -1
    PYTHONPATH=$BEFORE/src:$PYTHONPATH timeout 50 $B --src tp2 --dst tp1 --nproc 2 --label colloc2_before \
      --json "$R/colloc2_before_$i.json" 2>&1 | tail -1
  done
fi
echo "=== done ($(date +%T))"
