#!/usr/bin/env bash
# nixl after the thirteenth session (CPU memory, registrations that follow storages, a WRITE
# request per table and local views): the seed's model TP1 -> TP1 over nixl, two processes on
# the one GPU, with UCX's memory hooks (the default) and without (UCX_MEM_MMAP_HOOK_MODE=none:
# 0.43 s of a process's first NIXL agent on CPU, is it the first refit's 1.3 s here?); then
# every nixl test that runs here: the GPU one-sided, stale-read and one-GPU layout suites and
# the CPU-memory one; and the stale-read test with the producer waits removed (must fail).
# Carry .whl/nixl alone (59 MB). Results and log in $OUT.
source benchmarks/_h200_run.sh
h200_run nixl_registrations
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/nixl/*.whl
export PYTHONPATH=$PYTHONPATH:/tmp/site
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport nixl --nproc 2 --mode non-collocated"
echo "=== nixl refits: UCX memory hooks on (default), then off ($(date +%T))"
for i in 1 2; do
  timeout 120 $B --label "nixl tp1->tp1 hooks on #$i" --json "$R/hooks_on_$i.json" 2>&1 | tail -1
  UCX_MEM_MMAP_HOOK_MODE=none timeout 120 $B --label "nixl tp1->tp1 hooks off #$i" \
    --json "$R/hooks_off_$i.json" 2>&1 | tail -1
done
echo "=== nixl tests ($(date +%T))"
timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short -k nixl tests/test_gpu_one_sided.py \
  tests/test_gpu_stale_read.py tests/test_nixl_dram.py tests/test_gpu_layouts.py --timeout 240 2>&1 | tail -8
echo "=== stale-read with the producer waits removed: nixl cases must FAIL ($(date +%T))"
h200_broken_stale_read PRODUCER_WAIT -k nixl
echo "=== done ($(date +%T))"
