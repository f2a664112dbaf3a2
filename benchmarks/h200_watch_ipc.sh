#!/usr/bin/env bash
# Twentieth session: how much of ipc's time above the floor is the per-refit storage check
# (watch="every": data pointers and is_set_to per watched tensor, on the critical path of
# both the sender's header and the receiver's copies; one_sided_first_refit.py showed the
# copies starting ~0.3 ms after the refit on an H100). gpt-4b, ipc, watch every / manual
# alternating, non-collocated TP1 -> TP1 (2 processes), collocated TP2 -> TP1 (2 and 4).
# Nothing to carry. Results in $OUT. About 4 minutes.
source benchmarks/_h200_run.sh
h200_run watch_ipc
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc"
python3 -c "import torch; from torchrefit.execute.copy_kernel import copy_kernel; copy_kernel(torch.device('cuda'))"
for w in every manual every manual; do
  echo "=== watch=$w ($(date +%T))"
  timeout 60 $B --watch $w --nproc 2 --mode non-collocated --label "noncolloc2 $w" --json "$R/noncolloc2_$w.json" 2>&1 | tail -1
done
for n in 2 4; do
  for w in every manual; do
    echo "=== collocated $n procs, watch=$w ($(date +%T))"
    timeout 60 $B --watch $w --src tp2 --dst tp1 --nproc $n --label "colloc$n $w" --json "$R/colloc${n}_$w.json" 2>&1 | tail -1
  done
done
echo "=== done ($(date +%T))"
