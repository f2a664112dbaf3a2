#!/usr/bin/env bash
# Strided copies widened to complex128 views (the default since this script's commit), in
# one GPU call with the re-check: issue 10's collocated TP2 -> TP1 through ipc (1.80x the
# floor as bf16 copies, 1.24x on int64 views: BENCHMARKS.md "Transports run 7").
# 1. the strided copies alone: bf16, int64, complex128 views, contiguous, 2-D memcpy, Triton;
# 2. collocated TP2 -> TP1 through ipc, 2 and 4 processes, widened (default), then not
#    (TORCHREFIT_STRIDED_WORDS=0), in the same run;
# 3. non-collocated TP2 -> TP1 (3 processes) and TP1 -> TP1 (2 processes) through ipc;
# 4. bash benchmarks/h200_recheck.sh (every GPU test, the stale-read break, seed/MoE/FP8).
# Run from the repository root with $OUT set and megatron-core, nvshmem4py importable.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20"
echo "=== 1. strided copies $(date +%T)"
timeout 120 python3 benchmarks/strided_copies.py --json $OUT/strided_copies.json
echo "=== 2. tp2 -> tp1 collocated through ipc $(date +%T)"
for n in 2 4; do
  timeout 120 $B --nproc $n --src tp2 --dst tp1 --transport ipc \
    --label "tp2->tp1 collocated $n procs ipc widened" --json $OUT/colloc${n}_widened.json 2>&1 | tail -1
  TORCHREFIT_STRIDED_WORDS=0 timeout 120 $B --nproc $n --src tp2 --dst tp1 --transport ipc \
    --label "tp2->tp1 collocated $n procs ipc bf16" --json $OUT/colloc${n}_bf16.json 2>&1 | tail -1
done
echo "=== 3. non-collocated through ipc $(date +%T)"
timeout 120 $B --nproc 3 --mode non-collocated --src tp2 --dst tp1 --transport ipc \
  --label "tp2->tp1 non-collocated 3 procs ipc" --json $OUT/noncolloc3_tp2_tp1.json 2>&1 | tail -1
timeout 120 $B --nproc 2 --mode non-collocated --transport ipc --iters 50 \
  --label "tp1->tp1 non-collocated 2 procs ipc" --json $OUT/noncolloc2_tp1_tp1.json 2>&1 | tail -1
echo "=== 4. re-check $(date +%T)"
OUT=$OUT/recheck bash benchmarks/h200_recheck.sh
echo "=== done $(date +%T)"
