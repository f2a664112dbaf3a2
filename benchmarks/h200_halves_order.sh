#!/usr/bin/env bash
# The order of the batched kernel's tiles, and a delegate's own local copies in its members'
# batch: benchmarks/patches/halves_order.patch (written in the fifteenth session, not yet
# measured, so not on main's src) applied to this copy of the tree (new) against main's src
# as it came (base). Nothing to carry.
# Run in the eighteenth session on an H100 (BENCHMARKS.md, "Eighteenth session"): no win
# in the floor ratio and a slower first refit; the patch stays off main.
# One call:
# 1. benchmarks/halves_order_lab.py twice (both TP halves of the seed's row-parallel
#    weights: shard by shard, by destination, two launches; independent of src/);
# 2. ipc collocated TP2 -> TP1 (delegate), base then new, 2 processes twice, 4 processes once;
#    new with watch "manual" (the fourteenth session's one pair: 1.096x every, 1.055x manual);
# 3. the qwen3-shaped toy (8 layers, one process, batched dense copies): base then new;
# 4. where the delegate's first refit goes, new (one_sided_first_refit.py --collocated), also
#    with CUDA_MODULE_LOADING=EAGER (is it torch's kernels loaded at capture?) and no SM copies;
# 5. GPU tests of the batched, one-sided and stale-read paths, new.
# Results and log in $OUT.
source benchmarks/_h200_run.sh
h200_run halves_order
BASE=$(mktemp -d)/src
cp -r src "$BASE"
git apply benchmarks/patches/halves_order.patch 2>/dev/null || patch -p1 < benchmarks/patches/halves_order.patch || exit 1
grep -q "destination address" src/torchrefit/execute/copy_kernel.py || exit 1
echo "=== 1. halves order lab ($(date +%T))"
for i in 1 2; do timeout 100 python3 benchmarks/halves_order_lab.py --json "$R/halves_order_$i.json"; done
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc --src tp2 --dst tp1"
bench() {  # bench NAME PYTHONPATH ARGS...
  local name=$1 path=$2; shift 2
  PYTHONPATH=$path timeout 100 "$@" --label "$name" --json "$R/$name.json" 2>&1 | tail -1
}
echo "=== 2. ipc collocated TP2 -> TP1, delegate: base / new ($(date +%T))"
for i in 1 2; do
  bench colloc2_base_$i $BASE $B --nproc 2
  bench colloc2_new_$i $PWD/src $B --nproc 2
done
bench colloc4_base $BASE $B --nproc 4
bench colloc4_new $PWD/src $B --nproc 4
bench colloc2_new_manual $PWD/src $B --nproc 2 --watch manual
echo "=== 3. qwen3 toy, one process: base / new ($(date +%T))"
Q="python3 -m torchrefit bench --model qwen3-30b-a3b --layers 8 --variant graph --warmup 3 --iters 20"
bench qwen3_base $BASE $Q
bench qwen3_new $PWD/src $Q
echo "=== 4. delegate first refit, new: as is, kernels loaded at start, no SM copies ($(date +%T))"
for v in "" CUDA_MODULE_LOADING=EAGER TORCHREFIT_SM_COPY_BELOW=0; do
  echo "--- ${v:-as is} ($(date +%T))"
  env $v timeout 60 python3 benchmarks/one_sided_first_refit.py --transport ipc --collocated 2>&1 \
    | grep -E "^rank|capture_end|_capture|nvrtc|compile_copies|tiles|strided_runs|plan_runs" | head -24
done
echo "=== 5. GPU tests ($(date +%T))"
timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_batched.py \
  tests/test_gpu_one_sided.py tests/test_gpu_stale_read.py --timeout 120 2>&1 | tail -8
echo "=== done ($(date +%T))"
