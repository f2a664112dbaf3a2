#!/usr/bin/env bash
# A short one-GPU re-check of main (about 2.5 minutes on an H200): every GPU test, then the
# seed's model against megatron-core and the 16-expert MoE shape, as in h200_suite.sh.
# Run from the repo root with megatron-core (and optionally nvshmem4py) importable;
# results go to $OUT (default benchmarks/results/h200/recheck).
set -o pipefail
R=${OUT:-benchmarks/results/h200/recheck}
mkdir -p "$R"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider -m gpu tests/ -x --timeout 180 2>&1 | tail -25 | tee "$R/gpu_tests.log"
B="python3 -m torchrefit bench"
$B --model gpt-4b --compare megatron-core --transport nccl --variant plain --variant graph --variant share \
   --label "gpt-4b tp1->tp1 nccl" --json "$R/h200_gpt4b_tp1_nccl.json" 2>&1 | tail -22 | tee "$R/suite.log"
$B --model gpt-4b --layers 4 --experts 16 --expert-ffn 4096 --variant plain --variant graph \
   --label "moe-16x tp1->tp1" --json "$R/h200_moe16_tp1.json" 2>&1 | tail -8 | tee -a "$R/suite.log"
