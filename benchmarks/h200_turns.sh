#!/usr/bin/env bash
# Eleventh session: ipc with turns on the shared GPU (transport/turns.py) against without
# (TORCHREFIT_DEVICE_TURNS=0), same call: collocated TP2 -> TP1 with 2 and 4 processes,
# non-collocated TP2 -> TP1 (3) and TP1 -> TP1 (2); then the GPU tests of the one-sided
# path and the stale-read test. Results and log in $OUT.
set -u
R=${OUT:-benchmarks/results/h200/turns}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
exec > >(tee -a "$R/h200_turns.log") 2>&1
python3 -m compileall -q src >/dev/null
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc"
echo "=== ipc refits, turns then none ($(date +%T))"
for n in 2 4; do
  timeout 100 $B --nproc $n --src tp2 --dst tp1 --label "tp2->tp1 collocated $n procs ipc turns" \
    --json "$R/colloc${n}_turns.json" 2>&1 | tail -1
  TORCHREFIT_DEVICE_TURNS=0 timeout 100 $B --nproc $n --src tp2 --dst tp1 \
    --label "tp2->tp1 collocated $n procs ipc no turns" --json "$R/colloc${n}_noturns.json" 2>&1 | tail -1
done
timeout 100 $B --nproc 3 --mode non-collocated --src tp2 --dst tp1 \
  --label "tp2->tp1 non-collocated 3 procs ipc" --json "$R/noncolloc3_tp2_tp1.json" 2>&1 | tail -1
timeout 100 $B --nproc 2 --mode non-collocated --iters 50 \
  --label "tp1->tp1 non-collocated 2 procs ipc" --json "$R/noncolloc2_tp1_tp1.json" 2>&1 | tail -1
echo "=== GPU tests: one-sided, stale reads ($(date +%T))"
timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_one_sided.py \
  tests/test_gpu_stale_read.py --timeout 120 2>&1 | tail -6
echo "=== stale-read test with the producer waits removed: cases must FAIL ($(date +%T))"
TORCHREFIT_BREAK_PRODUCER_WAIT=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_stale_read.py \
  --timeout 60 2>&1 | grep -E "^FAILED|passed|failed" | tail -16
echo "=== done ($(date +%T))"
