#!/usr/bin/env bash
# Eleventh session call 3: the graph-capture lab, then first-refit profiles of the
# megatron-core models (megatron-core importable beforehand). $OUT as for the others.
set -u
R=${OUT:-benchmarks/results/h200/capture_first}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
exec > >(tee -a "$R/capture_first.log") 2>&1
echo "=== graph capture lab ($(date +%T))"
timeout 150 python3 benchmarks/graph_capture_lab.py --json "$R/graph_capture.json"
OUT=$R bash benchmarks/h200_first_refit.sh >/dev/null 2>&1
grep -E "^===|^construct_s" "$R/first_refit.log"
