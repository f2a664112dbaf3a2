#!/usr/bin/env bash
# Eleventh session: megatron-core's qwen3-shaped models with watch="manual" (host time
# without the per-refit checks) and their first refit after 03f03e3 (the layout detected
# once). megatron-core importable beforehand. Results and log in $OUT.
set -u
R=${OUT:-benchmarks/results/h200/megatron_manual}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
exec > >(tee -a "$R/h200_megatron_manual.log") 2>&1
python3 -m compileall -q src >/dev/null
echo "=== qwen3 (8 layers), megatron-core models, watch=manual ($(date +%T))"
timeout 200 python3 -m torchrefit bench --model qwen3-30b-a3b --layers 8 --compare megatron-core \
  --transport nccl --variant graph --watch manual --warmup 3 --iters 12 \
  --label "qwen3 8 layers megatron-core watch=manual" --json "$R/qwen3_megatron_manual.json" 2>&1 | tail -4
echo "=== first refit, megatron-core qwen3 ($(date +%T))"
timeout 150 python3 benchmarks/first_refit_profile.py --preset qwen3-30b-a3b --layers 8 --megatron \
  --json "$R/qwen3_megatron_first.json" 2>&1 | grep -E "^construct_s"
echo "=== done ($(date +%T))"
