#!/usr/bin/env bash
# Eleventh session: where a process's first refit goes (issue 16's 0.2 s bound), qwen3- and
# deepseek-shaped presets, toy and megatron-core models (megatron-core importable
# beforehand), with the copy kernel's disk cache warm as a second process finds it.
# Results and log in $OUT (default benchmarks/results/h200/first_refit).
set -u
R=${OUT:-benchmarks/results/h200/first_refit}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
export TORCHREFIT_KERNEL_CACHE=${TORCHREFIT_KERNEL_CACHE:-$(mktemp -d)}
exec > >(tee -a "$R/first_refit.log") 2>&1
python3 -m compileall -q src >/dev/null
python3 benchmarks/batched_first_use.py >/dev/null  # files the kernel image in the cache
for pl in qwen3-30b-a3b:8 deepseek-v3-moe:2; do  # the shape matrix's layers
  preset=${pl%%:*} layers=${pl##*:}
  for impl in toy megatron; do
    echo; echo "=== $preset $impl ($(date +%T))"
    flag=""; [ $impl = megatron ] && flag=--megatron
    timeout 150 python3 benchmarks/first_refit_profile.py --preset $preset --layers $layers $flag \
      --json "$R/${preset}_${impl}.json" 2>&1 | grep -v -E "Warning|warnings.warn" | head -${LINES_EACH:-75}
  done
done
