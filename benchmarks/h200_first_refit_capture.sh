#!/usr/bin/env bash
# Where the qwen3 toy's first refit goes on the GPU side (issue 16's 0.2 s bound): the
# host seconds of graph capture, its end (instantiation), the batched kernel's table and
# run merging, per timed Refitter (first_refit_profile.py's *_s parts), as is, with
# every CUDA kernel loaded at start (CUDA_MODULE_LOADING=EAGER: is the capture's end
# loading kernels lazily?) and without the batched kernel; the deepseek and gpt-4b toys
# as is for comparison; dense-0.5b and gpt-4b with every copy batched against the
# default, twice; watch="every"'s per-refit check on this host (watch_check_lab.py);
# then the same Python work without the GPU (first_refit_cpu.py).
# Written in the sixteenth session (no device lent); main at or after b558604. The
# seventeenth session (no device either) added, for its identity memos and caller state:
# whether this host's Python has an audit hook once megatron-core is imported (filelock
# 4 adds one on Python 3.12; each id() then ran it), megatron-core's qwen3 first refit
# (with .whl/megatron carried), and the GPU cases of tests/test_caller_state.py. Results
# and log in $OUT. One call, about 8 minutes.
source benchmarks/_h200_run.sh
h200_run first_refit_capture
P="benchmarks/first_refit_profile.py"
for case in as_is:X=1 eager:CUDA_MODULE_LOADING=EAGER unbatched:TORCHREFIT_BATCHED_COPY=0; do
  echo "=== qwen3 toy, 8 layers, ${case#*:} ($(date +%T))"
  env "${case#*:}" timeout 120 python3 $P --preset qwen3-30b-a3b --layers 8 \
    --json "$R/qwen3_${case%%:*}.json" 2>&1 | grep -E "^construct_s"
done
for preset in "deepseek-v3-moe --layers 2" "gpt-4b"; do
  echo "=== toy $preset, as is ($(date +%T))"
  timeout 120 python3 $P --preset $preset --json "$R/${preset%% *}.json" 2>&1 | grep -E "^construct_s"
done
# dense-0.5b's device time is 1.056-1.068x (its large copies are memcpy nodes: batching
# them is "auto"'s choice only for MoE-like programs); never measured with the NVRTC
# kernel taking every copy (--batched, TORCHREFIT_BATCHED_COPY=1): one ramp and one drain
for i in 1 2; do
  for mode in default batched; do
    echo "=== dense-0.5b and gpt-4b toys, $mode ($(date +%T))"
    timeout 150 python3 benchmarks/shape_matrix.py --no-megatron --only dense-0.5b --only gpt-4b \
      $([ $mode = batched ] && echo --batched) --json "$R/matrix_${mode}_$i.json" 2>&1 | grep -E "torchrefit .* floor" | tail -4
  done
done
# what watch="every" costs on this host since the view comparison joined the pointer read
for preset in "qwen3-30b-a3b --layers 8" "gpt-4b --layers 20"; do
  echo "=== watch check, toy $preset ($(date +%T))"
  timeout 120 python3 benchmarks/watch_check_lab.py --preset $preset --json "$R/watch_${preset%% *}.json" 2>&1 | tail -1
done
echo "=== audit hooks after importing megatron-core; megatron-core's qwen3 first refit ($(date +%T))"
if ls .whl/megatron/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mcore .whl/megatron/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/mcore
  timeout 120 python3 - <<'PY' 2>&1 | grep -v -i warn
import timeit
objs = [object() for _ in range(4000)]
t = lambda: round(min(timeit.repeat(lambda: [id(o) for o in objs], number=20, repeat=5)) / 20 / 4000 * 1e9)
before = t()
import filelock, megatron.core  # noqa: E401
print(f"filelock {filelock.__version__}: id() {before} ns before importing megatron.core, {t()} ns after")
PY
  timeout 150 python3 $P --preset qwen3-30b-a3b --layers 8 --megatron --json "$R/qwen3_megatron.json" 2>&1 \
    | grep -E "^construct_s"
else
  echo "megatron-core wheel not carried (.whl/megatron): skipped"
fi
echo "=== GPU cases of tests/test_caller_state.py ($(date +%T))"
timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_caller_state.py --timeout 180 2>&1 | tail -4
echo "=== the Python work alone, CPU seconds ($(date +%T))"
timeout 120 python3 benchmarks/first_refit_cpu.py --preset qwen3-30b-a3b --layers 8 --json "$R/cpu_qwen3.json"
echo "=== done ($(date +%T))"
