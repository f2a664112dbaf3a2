#!/usr/bin/env bash
# ipc with one copier per shared GPU (transport/delegates.py, TORCHREFIT_DELEGATE=1) against
# turns (the default), same call: collocated TP2 -> TP1 with 2 and 4 processes
# (2 also with watch="manual"); then the GPU tests of the one-sided path, the stale-read
# test, and the stale-read test with the producer and done waits removed (must fail).
# Results and log in $OUT.
source benchmarks/_h200_run.sh
h200_run delegate
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc"
echo "=== ipc refits, delegate then turns ($(date +%T))"
for n in 2 4; do
  TORCHREFIT_DELEGATE=1 timeout 100 $B --nproc $n --src tp2 --dst tp1 --label "tp2->tp1 collocated $n procs ipc delegate" \
    --json "$R/colloc${n}_delegate.json" 2>&1 | tail -1
  timeout 100 $B --nproc $n --src tp2 --dst tp1 \
    --label "tp2->tp1 collocated $n procs ipc turns" --json "$R/colloc${n}_turns.json" 2>&1 | tail -1
done
TORCHREFIT_DELEGATE=1 timeout 100 $B --nproc 2 --src tp2 --dst tp1 --watch manual --label "tp2->tp1 collocated 2 procs ipc delegate manual" \
  --json "$R/colloc2_delegate_manual.json" 2>&1 | tail -1
echo "=== GPU tests: one-sided, stale reads ($(date +%T))"
timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_one_sided.py \
  tests/test_gpu_stale_read.py --timeout 120 2>&1 | tail -6
echo "=== stale-read test with the producer waits removed: ipc cases must FAIL ($(date +%T))"
h200_broken_stale_read PRODUCER_WAIT
echo "=== ... and with the done waits removed ($(date +%T))"
h200_broken_stale_read DONE_WAIT
echo "=== done ($(date +%T))"
