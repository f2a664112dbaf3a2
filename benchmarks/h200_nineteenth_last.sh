#!/usr/bin/env bash
# Nineteenth session, last call: the two GPU tests whose counts assumed cudaMalloc's layout
# (fixed in a26d691) under expandable segments again, then where ipc's collocated first
# refit goes (one_sided_first_refit.py --collocated: the delegate's profile). $OUT; ~2.5 min.
source benchmarks/_h200_run.sh
h200_run nineteenth_last
echo "=== 1. fixed GPU tests with expandable segments ($(date +%T))"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=line -rf \
  --timeout 90 "tests/test_gpu_refit.py::test_graph_path_with_large_copies_as_kernels_or_not" \
  "tests/test_gpu_one_sided.py::test_one_sided_two_processes_one_gpu[ipc]" 2>&1 | grep -E "Error|^FAILED|passed|failed" | tail -6
echo "=== 2. ipc collocated TP2 -> TP1 first refit, profiled ($(date +%T))"
timeout 90 python3 benchmarks/one_sided_first_refit.py --transport ipc --collocated > "$R/first_refit_profile.log" 2>&1
grep -E "^rank|cumtime" "$R/first_refit_profile.log" | head -8
grep -E "ipc|open|capture|export|compile|plan|Refitter|refit" "$R/first_refit_profile.log" | head -40 | cut -c1-160
echo "=== done ($(date +%T))"
