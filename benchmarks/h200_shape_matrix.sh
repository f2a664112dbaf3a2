#!/usr/bin/env bash
# Issue 16 on one H200: where a refit's wall time goes phase by phase (diagnose_refit_phases),
# the shape matrix with megatron-core side by side and toy models
# of each shape (wall, device time, flat copy of the same bytes), then where a qwen3
# refit's host time goes (construction + first refit profiled, warm host time split).
# Run from the repo root with megatron-core importable; results and log under $OUT.
set -u -o pipefail
R=${OUT:-benchmarks/results}
mkdir -p "$R"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
step() { echo; echo "=== $* ($(date +%T))"; }
step "refit phases, storage/binding checks, branches and copy kinds (toy models)"
python benchmarks/diagnose_refit_phases.py --json "$R/h200_refit_phases.json" 2>&1 | tee "$R/h200_refit_phases.log"
step "shape matrix: megatron-core GPTModels and toy models"
python benchmarks/shape_matrix.py --also-toy --json "$R/h200_shape_matrix.json"
step "host time of qwen3-30b-a3b (8 layers, toy models)"
python benchmarks/diagnose_host.py --preset qwen3-30b-a3b --layers 8 --no-stale > "$R/h200_diagnose_host_qwen3.log" 2>&1
grep -E "^host ms|construction|watched" "$R/h200_diagnose_host_qwen3.log"
step done
