#!/usr/bin/env bash
# Nineteenth session, second call: where first refits go on this GPU's host. What each
# kernel family's first use costs in a fresh process (lazy_loading_probe.py); ipc
# collocated TP2 -> TP1 with 4 processes (issue 10's 0.3 s first refit) as is, with
# every copy batched (TORCHREFIT_BATCHED_COPY=1: no torch kernel for strided halves) and
# with every module loaded at start (CUDA_MODULE_LOADING=EAGER); the qwen3 toy's first
# refit as is and EAGER; watch="every"'s check parts (watch_check_lab.py). $OUT; ~4 min.
source benchmarks/_h200_run.sh
h200_run nineteenth_first_refit
echo "=== 1. lazy module loading, per kernel family ($(date +%T))"
timeout 150 python3 benchmarks/lazy_loading_probe.py --json "$R/lazy_loading.json"
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc --src tp2 --dst tp1 --nproc 4"
for case in as_is:X=1 batched:TORCHREFIT_BATCHED_COPY=1 eager:CUDA_MODULE_LOADING=EAGER; do
  echo "=== 2. ipc collocated 4 procs, ${case#*:} ($(date +%T))"
  env "${case#*:}" timeout 100 $B --label "colloc4 ${case%%:*}" --json "$R/colloc4_${case%%:*}.json" 2>&1 | tail -1
done
echo "=== 2b. the same with small copies batched too (benchmarks/patches/small_batched.patch) ($(date +%T))"
NEW=$(h200_patched_tree benchmarks/patches/small_batched.patch) || exit 1
grep -q TORCHREFIT_SMALL_BATCHED "$NEW/src/torchrefit/execute/local.py" || exit 1
for n in 4 2; do
  TORCHREFIT_SMALL_BATCHED=1 PYTHONPATH=$NEW/src timeout 100 ${B/--nproc 4/--nproc $n} --label "colloc$n small_batched" \
    --json "$R/colloc${n}_small_batched.json" 2>&1 | tail -1
done
timeout 100 ${B/--nproc 4/--nproc 2} --label "colloc2 as_is" --json "$R/colloc2_as_is.json" 2>&1 | tail -1
for case in as_is:X=1 eager:CUDA_MODULE_LOADING=EAGER; do
  echo "=== 3. qwen3 toy first refit, ${case#*:} ($(date +%T))"
  env "${case#*:}" timeout 100 python3 benchmarks/first_refit_profile.py --preset qwen3-30b-a3b --layers 8 \
    --json "$R/qwen3_${case%%:*}.json" 2>&1 | grep -E "^construct_s"
done
echo "=== 4. watch check, qwen3 toy ($(date +%T))"
timeout 100 python3 benchmarks/watch_check_lab.py --preset qwen3-30b-a3b --layers 8 --json "$R/watch_qwen3.json" 2>&1 | tail -1
echo "=== done ($(date +%T))"
