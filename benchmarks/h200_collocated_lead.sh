#!/usr/bin/env bash
# Issue 10's lead, in one GPU call (run at 2fbd758: benchmarks/results/h200/collocated_lead_2fbd758/):
# why collocated TP2 -> TP1 through ipc cost 1.8x the floor with two processes as with four
# (BENCHMARKS.md "Transports run 6" and 7). Since 8c3ccea step 5's switch is the default and
# widens to complex128 where it fits (at 2fbd758: int64), and step 1 times more variants.
# 1. the row-parallel halves into strided views, alone (bf16, int64 views, contiguous);
# 2. the same layout non-collocated (two senders, one receiver: pulls into strided views,
#    no local copies in the receiver's context);
# 3. collocated TP2 -> TP1 with gloo (local copies in the same contexts, remote bytes staged);
# 4. collocated TP2 -> TP1 through ipc again, for the same run's comparison;
# 5. the same with TORCHREFIT_STRIDED_WORDS=1 (strided copies on int64 views), 2 and 4 processes;
# 6. the GPU tests that compile local and pulled copies, with that switch on.
# Run from the repository root with $OUT set.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20"
echo "=== 1. strided copies $(date +%T)"
timeout 120 python3 benchmarks/strided_copies.py --json $OUT/strided_copies.json
echo "=== 2. tp2 -> tp1 non-collocated, 3 processes, ipc $(date +%T)"
timeout 120 $B --nproc 3 --mode non-collocated --src tp2 --dst tp1 --transport ipc \
  --label "tp2->tp1 non-collocated 3 procs ipc" --json $OUT/noncolloc3_tp2_tp1_ipc.json 2>&1 | tail -2
echo "=== 3. tp2 -> tp1 collocated, 2 processes, gloo $(date +%T)"
timeout 200 $B --nproc 2 --src tp2 --dst tp1 --transport gloo \
  --label "tp2->tp1 collocated 2 procs gloo" --json $OUT/colloc2_tp2_tp1_gloo.json 2>&1 | tail -2
echo "=== 4. tp2 -> tp1 collocated, 2 processes, ipc $(date +%T)"
timeout 120 $B --nproc 2 --src tp2 --dst tp1 --transport ipc \
  --label "tp2->tp1 collocated 2 procs ipc" --json $OUT/colloc2_tp2_tp1_ipc.json 2>&1 | tail -2
echo "=== 5. tp2 -> tp1 collocated, 2 and 4 processes, ipc, strided copies on int64 views $(date +%T)"
for n in 2 4; do
  TORCHREFIT_STRIDED_WORDS=1 timeout 120 $B --nproc $n --src tp2 --dst tp1 --transport ipc \
    --label "tp2->tp1 collocated $n procs ipc strided-words" --json $OUT/colloc${n}_tp2_tp1_ipc_wide.json 2>&1 | tail -2
done
echo "=== 6. GPU tests with the switch on $(date +%T)"
TORCHREFIT_STRIDED_WORDS=1 timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=line tests/test_gpu_refit.py \
  tests/test_gpu_one_sided.py tests/test_gpu_stale_read.py -k "not overwrites" 2>&1 | tail -3
echo "=== done $(date +%T)"
