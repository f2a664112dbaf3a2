#!/usr/bin/env bash
# Issue 11's speed target on one H200: the seed's model (gpt-4b, bf16) from a Megatron-style
# TP1 trainer into a whole Hugging Face-named engine through megatron_to_hf, every projection
# block-FP8 (float8_e4m3fn, 128x128 scale_inv), quantized by the refit; against the floor of
# the bytes it must read (bf16 source) and write (FP8 values and scales, bf16 rest), measured
# in the same run. Also the same engine in bf16 (map only) for the cost of the map alone.
# Run from the repo root; results go to $OUT (default benchmarks/results/h200).
set -u
R=${OUT:-benchmarks/results/h200}
mkdir -p "$R"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
exec > >(tee "$R/h200_fp8.log") 2>&1
B="python -m torchrefit bench"
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
echo "=== fp8 kernel lab: the seed's projections, torch reference vs one Triton launch ($(date +%T))"
python benchmarks/fp8_kernel_lab.py --json "$R/h200_fp8_kernel_lab.json"
echo "=== gpt-4b megatron -> hf names, bf16 -> block fp8 ($(date +%T))"
$B --model gpt-4b --map hf --fp8 --variant plain --variant graph --warmup 3 --iters 20 \
   --label "gpt-4b megatron->hf fp8" --json "$R/h200_gpt4b_map_hf_fp8.json"
echo "=== gpt-4b megatron -> hf names, bf16 -> bf16 ($(date +%T))"
$B --model gpt-4b --map hf --variant plain --variant graph --warmup 3 --iters 20 \
   --label "gpt-4b megatron->hf bf16" --json "$R/h200_gpt4b_map_hf_bf16.json"
