#!/usr/bin/env bash
# The twelfth session's first-refit changes (812899a, c0389b4: the loop walk, layer numbers
# from the instance, no-op renames skipped, no new boxes for whole tensors) on an H200
# host: first_refit_profile.py for the qwen3 and deepseek toys, and megatron-core's qwen3
# (installed here from .whl/megatron when not importable: pass carry [".whl/megatron"]);
# then the same Python work without the GPU (first_refit_cpu.py). Results and log in $OUT.
source benchmarks/_h200_run.sh
h200_run first_refit_cpu_changes
if ! python3 -c "import megatron.core" 2>/dev/null && ls .whl/megatron/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/megatron/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
for preset in "qwen3-30b-a3b --layers 8" "deepseek-v3-moe --layers 2"; do
  echo "=== first refit, toy $preset ($(date +%T))"
  timeout 120 python3 benchmarks/first_refit_profile.py --preset $preset \
    --json "$R/first_${preset%% *}.json" 2>&1 | grep -E "^construct_s"
done
echo "=== first refit, megatron-core qwen3 ($(date +%T))"
timeout 150 python3 benchmarks/first_refit_profile.py --preset qwen3-30b-a3b --layers 8 --megatron \
  --json "$R/first_qwen3_megatron.json" 2>&1 | grep -E "^construct_s"
echo "=== the Python work alone, CPU seconds ($(date +%T))"
timeout 120 python3 benchmarks/first_refit_cpu.py --preset qwen3-30b-a3b --layers 8 --json "$R/cpu_qwen3.json"
echo "=== done ($(date +%T))"
