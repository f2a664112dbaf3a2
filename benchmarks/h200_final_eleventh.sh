#!/usr/bin/env bash
# Eleventh session, last call: ipc with turns after the first-refit fix (collocated TP2 ->
# TP1, 2 and 4 processes; 2 processes also with watch="manual"), then the GPU tests of the
# batched, graph and one-sided paths on this code. Results and log in $OUT.
set -u
R=${OUT:-benchmarks/results/h200/final_eleventh}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
exec > >(tee -a "$R/h200_final.log") 2>&1
python3 -m compileall -q src >/dev/null
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc"
echo "=== ipc refits with turns ($(date +%T))"
for n in 2 4; do
  timeout 100 $B --nproc $n --src tp2 --dst tp1 --label "tp2->tp1 collocated $n procs ipc turns" \
    --json "$R/colloc${n}_turns.json" 2>&1 | tail -1
done
timeout 100 $B --nproc 2 --src tp2 --dst tp1 --watch manual --label "tp2->tp1 collocated 2 procs ipc turns manual" \
  --json "$R/colloc2_turns_manual.json" 2>&1 | tail -1
echo "=== GPU tests ($(date +%T))"
timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_one_sided.py \
  tests/test_gpu_batched.py tests/test_gpu_refit.py --timeout 120 2>&1 | tail -6
echo "=== done ($(date +%T))"
