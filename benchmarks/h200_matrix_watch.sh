#!/usr/bin/env bash
# Eleventh session: the shape matrix (megatron-core and toy models, every preset) with the
# toy rows also measured with Refitter(watch="manual") (host time without the per-refit
# tensor checks), after the strided batch, the per-branch queuing and the one-detection
# construction. megatron-core importable beforehand. Results and log in $OUT.
set -u
R=${OUT:-benchmarks/results/h200/matrix_watch}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
exec > >(tee -a "$R/h200_matrix_watch.log") 2>&1
python3 -m compileall -q src >/dev/null
echo "=== GPU tests: batched copies, one-sided pulls ($(date +%T))"
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_batched.py \
  tests/test_gpu_one_sided.py 2>&1 | tail -4
echo "=== shape matrix ${ONLY:-all presets} ($(date +%T))"
O=""; for p in ${ONLY:-}; do O="$O --only $p"; done
timeout ${MATRIX_TIMEOUT:-440} python3 benchmarks/shape_matrix.py --watch-manual-too $O \
  --json "$R/h200_shape_matrix.json" 2>&1 | grep -v -E "Warning|warnings.warn|return func|ProcessGroupNCCL|^\s*$"
echo "=== done ($(date +%T))"
