#!/usr/bin/env bash
# Nineteenth session, last call: the two GPU tests whose counts assumed cudaMalloc's layout
# (fixed in a26d691) under expandable segments again; where ipc's collocated first refit
# goes (one_sided_first_refit.py --collocated --nproc 4: each rank's profile); then the
# 4-process collocated bench as is and with benchmarks/patches/ipc_no_event_sync.patch
# (handles shared without torch's interprocess event: is opening them what costs?), unless
# NO_BENCH=1. $OUT; ~3 min (2 with NO_BENCH=1).
source benchmarks/_h200_run.sh
h200_run nineteenth_last
echo "=== 1. fixed GPU tests with expandable segments ($(date +%T))"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=line -rf \
  --timeout 90 "tests/test_gpu_refit.py::test_graph_path_with_large_copies_as_kernels_or_not" \
  "tests/test_gpu_one_sided.py::test_one_sided_two_processes_one_gpu[ipc]" 2>&1 | grep -E "Error|^FAILED|passed|failed" | tail -6
echo "=== 2. ipc collocated TP2 -> TP1 first refit, 4 processes, profiled ($(date +%T))"
timeout 90 python3 benchmarks/one_sided_first_refit.py --transport ipc --collocated --nproc 4 > "$R/first_refit_profile.log" 2>&1
grep -E "^rank" "$R/first_refit_profile.log" | cut -c1-200
[ "${NO_BENCH:-0}" = 1 ] && { echo "=== done, no bench (NO_BENCH=1) ($(date +%T))"; exit 0; }
NEW=$(h200_patched_tree benchmarks/patches/ipc_no_event_sync.patch) || exit 1
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc --src tp2 --dst tp1 --nproc 4"
echo "=== 3. ipc collocated 4 procs: as is, no event sync ($(date +%T))"
timeout 60 $B --label "colloc4 as_is" --json "$R/colloc4_as_is.json" 2>&1 | tail -1
PYTHONPATH=$NEW/src timeout 60 $B --label "colloc4 no_event_sync" --json "$R/colloc4_no_event_sync.json" 2>&1 | tail -1
echo "=== done ($(date +%T))"
