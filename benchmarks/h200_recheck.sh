#!/usr/bin/env bash
# A short one-GPU re-check of main (under ten minutes on an H200): every GPU test (one pytest
# process, 120 s per test), the stale-read test with the producer waits removed (must fail),
# the seed's model against megatron-core, the 16-expert MoE shape and the Megatron -> HF
# block-FP8 refit. Run from the repo root with megatron-core (and nvshmem4py for the nvshmem
# tests) importable; results go to $OUT (default benchmarks/results/h200/recheck).
set -o pipefail
R=${OUT:-benchmarks/results/h200/recheck}
mkdir -p "$R"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
step() { echo; echo "=== $* ($(date +%T))"; }
step "every GPU test"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ --timeout 120 -rfs 2>&1 | tail -40 | tee "$R/gpu_tests.log"
step "stale-read test with the producer waits removed: each case must FAIL"
TORCHREFIT_BREAK_PRODUCER_WAIT=1 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_stale_read.py \
   --timeout 60 2>&1 | grep -E "PASS|FAIL|passed|failed" | tail -20 | tee "$R/stale_broken.log"
B="python3 -m torchrefit bench"
step "seed model vs megatron-core"
$B --model gpt-4b --compare megatron-core --transport nccl --variant plain --variant graph --variant share \
   --label "gpt-4b tp1->tp1 nccl" --json "$R/h200_gpt4b_tp1_nccl.json" 2>&1 | tail -9 | tee "$R/suite.log"
step "MoE 16 experts"
$B --model gpt-4b --layers 4 --experts 16 --expert-ffn 4096 --variant plain --variant graph \
   --label "moe-16x tp1->tp1" --json "$R/h200_moe16_tp1.json" 2>&1 | tail -6 | tee -a "$R/suite.log"
step "megatron -> hf names, bf16 -> block fp8"
$B --model gpt-4b --map hf --fp8 --variant graph --warmup 3 --iters 20 \
   --label "gpt-4b megatron->hf fp8" --json "$R/h200_gpt4b_map_hf_fp8.json" 2>&1 | tail -6 | tee -a "$R/suite.log"
step done
