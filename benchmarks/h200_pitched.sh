#!/usr/bin/env bash
# Strided copies as 2-D memcpys (execute.pitched_copies), in one GPU call: issue 10's
# collocated TP2 -> TP1 through ipc (1.80x the floor as torch copies, 1.24x with
# TORCHREFIT_STRIDED_WORDS=1: BENCHMARKS.md "Transports run 7").
# 1. the strided copies alone: torch bf16, int64 views, contiguous, 2-D memcpy;
# 2. the GPU tests that run local copies and pulls (2-D memcpys on by default);
# 3. collocated TP2 -> TP1 through ipc, 2 and 4 processes: 2-D memcpys (default), then
#    without them (TORCHREFIT_PITCHED_COPIES=0) on int64 views, in the same run;
# 4. non-collocated TP2 -> TP1 (3 processes) and TP1 -> TP1 (2 processes) through ipc.
# Run from the repository root with $OUT set.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20"
echo "=== 1. strided copies $(date +%T)"
timeout 120 python3 benchmarks/strided_copies.py --json $OUT/strided_copies.json
echo "=== 2. GPU tests $(date +%T)"
timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_refit.py \
  tests/test_gpu_one_sided.py tests/test_gpu_stale_read.py -k "not overwrites" 2>&1 | tail -15
echo "=== 3. tp2 -> tp1 collocated through ipc $(date +%T)"
for n in 2 4; do
  timeout 120 $B --nproc $n --src tp2 --dst tp1 --transport ipc \
    --label "tp2->tp1 collocated $n procs ipc 2-D memcpy" --json $OUT/colloc${n}_pitched.json 2>&1 | tail -1
  TORCHREFIT_PITCHED_COPIES=0 TORCHREFIT_STRIDED_WORDS=1 timeout 120 $B --nproc $n --src tp2 --dst tp1 \
    --transport ipc --label "tp2->tp1 collocated $n procs ipc int64 views" --json $OUT/colloc${n}_words.json 2>&1 | tail -1
done
echo "=== 4. non-collocated through ipc $(date +%T)"
timeout 120 $B --nproc 3 --mode non-collocated --src tp2 --dst tp1 --transport ipc \
  --label "tp2->tp1 non-collocated 3 procs ipc" --json $OUT/noncolloc3_pitched.json 2>&1 | tail -1
timeout 120 $B --nproc 2 --mode non-collocated --transport ipc --iters 50 \
  --label "tp1->tp1 non-collocated 2 procs ipc" --json $OUT/noncolloc2_tp1.json 2>&1 | tail -1
echo "=== done $(date +%T)"
