#!/usr/bin/env bash
# Fifteenth session, call 1: (1) the order of the batched kernel's tiles for both TP halves
# of row-parallel weights (benchmarks/halves_order_lab.py, twice); (2) ipc collocated
# TP2 -> TP1 with the delegate, watch "every" against "manual", alternating twice (the
# fourteenth session's one pair said 1.096x against 1.055x); (3) where the delegate's
# first refit goes (the body of benchmarks/h200_delegate_capture.sh). Results and log in $OUT.
source benchmarks/_h200_run.sh
h200_run halves_order
echo "=== halves order lab ($(date +%T))"
for i in 1 2; do timeout 120 python3 benchmarks/halves_order_lab.py --json "$R/halves_order_$i.json"; done
echo "=== delegate, watch every / manual ($(date +%T))"
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc --nproc 2 --src tp2 --dst tp1"
for i in 1 2; do
  for w in every manual; do
    timeout 100 $B --watch $w --label "tp2->tp1 collocated 2 procs delegate watch $w ($i)" \
      --json "$R/colloc2_${w}_$i.json" 2>&1 | tail -1
  done
done
echo "=== delegate first refit, by what its capture holds ($(date +%T))"
P="python3 benchmarks/one_sided_first_refit.py --transport ipc --collocated"
for v in "" TORCHREFIT_BATCHED_COPY=0 TORCHREFIT_SM_COPY_BELOW=0 TORCHREFIT_DELEGATE=0; do
  echo "--- ${v:-as is} ($(date +%T))"
  env $v timeout 100 $P 2>&1 | grep -E "^rank|capture_end|_capture|nvrtc|compile_copies|tiles|strided_runs" | head -24
done
echo "=== done ($(date +%T))"
