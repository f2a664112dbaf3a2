#!/usr/bin/env bash
# ipc's collocated layouts after one copier per shared GPU became the default
# (transport/delegates.py): TP2 -> TP1 with 2 and 4 processes as a user runs it (no
# variable set), and with TORCHREFIT_DELEGATE=0 (turns) in the same call; then the GPU
# one-sided tests (ipc with turns and ipc:delegate) and stale-read tests, and the
# stale-read test's delegate cases with the producer waits removed (must FAIL); then,
# with .whl/nixl carried, where nixl's first refit goes with UCX's memory hooks off
# (one_sided_first_refit.py: profiles of both ranks). Results and log in $OUT.
source benchmarks/_h200_run.sh
h200_run delegate_default
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc --src tp2 --dst tp1"
echo "=== ipc collocated TP2 -> TP1, default then turns ($(date +%T))"
for n in 2 4; do
  timeout 100 $B --nproc $n --label "tp2->tp1 collocated $n procs ipc default" --json "$R/colloc${n}_default.json" 2>&1 | tail -1
  TORCHREFIT_DELEGATE=0 timeout 100 $B --nproc $n --label "tp2->tp1 collocated $n procs ipc turns" \
    --json "$R/colloc${n}_turns.json" 2>&1 | tail -1
done
echo "=== GPU tests: one-sided, stale reads ($(date +%T))"
timeout 260 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_one_sided.py \
  tests/test_gpu_stale_read.py --timeout 120 2>&1 | tail -8
echo "=== stale-read delegate cases with the producer waits removed: must FAIL ($(date +%T))"
h200_broken_stale_read PRODUCER_WAIT -k delegate
if h200_with_nixl; then
  echo "=== nixl first refit, hooks off, profiled ($(date +%T))"
  UCX_MEM_MMAP_HOOK_MODE=none timeout 150 python3 benchmarks/one_sided_first_refit.py --transport nixl 2>&1 | head -110
fi
echo "=== done ($(date +%T))"
