#!/usr/bin/env bash
# Issue 11's speed target on one H200: the seed's model (gpt-4b, bf16) from a Megatron-style
# TP1 trainer into a whole Hugging Face-named engine through megatron_to_hf, every projection
# block-FP8 (float8_e4m3fn, 128x128 scale_inv), quantized by the refit; against the floor of
# the bytes it must read (bf16 source) and write (FP8 values and scales, bf16 rest), measured
# in the same run. First the kernel lab (old kernel and every variant of the new one, bit for
# bit against the torch reference, GB/s); the refit then runs with the lab's fastest
# bit-identical variant (TORCHREFIT_FP8_KERNEL); last, the GPU tests that touch FP8.
# Run from the repo root; results go to $OUT (default benchmarks/results/h200).
set -u -o pipefail
R=${OUT:-benchmarks/results/h200}
mkdir -p "$R"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
exec > >(tee "$R/h200_fp8.log") 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
echo "=== fp8 kernel lab ($(date +%T))"
python benchmarks/fp8_kernel_lab.py --json "$R/h200_fp8_kernel_lab.json" | tee /tmp/fp8_lab.out
BEST=$(sed -n 's/^best=//p' /tmp/fp8_lab.out)
export TORCHREFIT_FP8_KERNEL=${BEST:-onepass_w8}
echo "=== gpt-4b megatron -> hf names, bf16 -> block fp8, kernel $TORCHREFIT_FP8_KERNEL ($(date +%T))"
python -m torchrefit bench --model gpt-4b --map hf --fp8 --variant graph --variant plain --warmup 3 --iters 20 \
   --label "gpt-4b megatron->hf fp8" --json "$R/h200_gpt4b_map_hf_fp8.json"
echo "=== GPU tests touching FP8 ($(date +%T))"
python -m pytest -q -m gpu -k "fp8 or quant" -p no:cacheprovider tests 2>&1 | tail -15
echo "=== done ($(date +%T))"
