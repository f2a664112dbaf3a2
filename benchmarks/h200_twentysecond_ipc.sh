#!/usr/bin/env bash
# Twenty-second session, call 2: issue 10's ipc at main's head (gpt-4b, --variant graph,
# watch every): the timeline non-collocated and collocated (no profiler; on the host clock
# the processes share, when each rank passed each step of its refit), then torchrefit bench:
# non-collocated TP1 -> TP1 with 2 processes three times, collocated TP2 -> TP1 with 2
# processes alternating main and main without its adaptive spin
# (benchmarks/patches/adaptive_spin.patch reverted), and with 4 processes.
# Nothing to carry. Results and log in $OUT. About 5 minutes.
source benchmarks/_h200_run.sh
h200_run twentysecond_ipc
python3 -m torchrefit native build >/dev/null && echo "native built" || echo "not built"
BEFORE=$(h200_patched_tree benchmarks/patches/adaptive_spin.patch -R) || exit 1
for mode in "" --collocated; do
  echo "=== 1. one_sided_first_refit $mode ($(date +%T))"
  timeout 120 python3 benchmarks/one_sided_first_refit.py --transport ipc $mode 2>&1 \
    | grep -E "^rank [0-9]: (refit wall|left the|construct|[0-9.]+ GB)" | cut -c1-300 | head -20
done
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc"
echo "=== 2. ipc bench ($(date +%T))"
for i in 1 2 3; do
  timeout 50 $B --mode non-collocated --nproc 2 --label noncolloc2 --json "$R/noncolloc2_$i.json" 2>&1 | tail -1
done
for i in 1 2; do
  timeout 50 $B --src tp2 --dst tp1 --nproc 2 --label colloc2 --json "$R/colloc2_$i.json" 2>&1 | tail -1
  PYTHONPATH=$BEFORE/src timeout 50 $B --src tp2 --dst tp1 --nproc 2 --label colloc2_before \
    --json "$R/colloc2_before_$i.json" 2>&1 | tail -1
done
timeout 60 $B --src tp2 --dst tp1 --nproc 4 --label colloc4 --json "$R/colloc4.json" 2>&1 | tail -1
echo "=== done ($(date +%T))"
