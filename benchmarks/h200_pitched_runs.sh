#!/usr/bin/env bash
# For the next session with a GPU (written in the nineteenth, not yet run): pitched runs
# (merged in e521b0b: a strided copy planned as one run of rows at a pitch, cut into tiles
# on the device; see BENCHMARKS.md, "Nineteenth session", for the 4-process first refit it
# targets) on main's src ("new") against the same src with benchmarks/patches/pitched_runs.patch
# reverted ("base", one run per row as before):
# 1. GPU tests of the batched kernel, the refit, the one-sided transports and stale reads
#    on main (the expand kernel's table must equal plan_tiles' exactly);
# 2. ipc collocated TP2 -> TP1, 4 and 2 processes, base and new alternating;
# 3. the 4-process delegate's first refit profiled on main;
# 4. capture_end with as many imported allocations as the delegate opens (498 of 20 MiB):
#    is it what makes instantiating its graphs cost 0.1 s each?
# Nothing to carry. Results and log in $OUT. About 7 minutes.
source benchmarks/_h200_run.sh
h200_run pitched_runs
BASE=$(h200_patched_tree benchmarks/patches/pitched_runs.patch -R) || exit 1
grep -q dst_pitch "$BASE/src/torchrefit/execute/copy_kernel.py" && exit 1
NEW=$PWD/src
echo "=== 1. GPU tests, main ($(date +%T))"
PYTHONPATH=$NEW timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_gpu_batched.py \
  tests/test_gpu_refit.py tests/test_gpu_one_sided.py tests/test_gpu_stale_read.py --timeout 120 2>&1 \
  | grep -E "Error|^FAILED|passed|failed" | cut -c1-300 | tail -10
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc --src tp2 --dst tp1"
echo "=== 2. ipc collocated, base / new ($(date +%T))"
for P in "$BASE/src" "$NEW"; do  # each tree's kernel compiled into the disk cache first: no first refit pays NVRTC
  PYTHONPATH=$P python3 -c "import torch; from torchrefit.execute.copy_kernel import copy_kernel; copy_kernel(torch.device('cuda'))"
done
for n in 4 2; do
  for tree in base new; do
    P=$NEW; [ $tree = base ] && P=$BASE/src
    PYTHONPATH=$P timeout 60 $B --nproc $n --label "colloc$n $tree" --json "$R/colloc${n}_$tree.json" 2>&1 | tail -1
  done
done
echo "=== 3. the 4-process delegate's first refit, main, profiled ($(date +%T))"
PYTHONPATH=$NEW timeout 60 python3 benchmarks/one_sided_first_refit.py --transport ipc --collocated --nproc 4 \
  > "$R/first_refit_profile4_new.log" 2>&1
grep -E "^rank 0|capture_end|compile_batch|plan_runs|strided_runs|attach" "$R/first_refit_profile4_new.log" | head -12 | cut -c1-170
echo "=== 4. capture_end over 498 imported allocations ($(date +%T))"
timeout 90 python3 benchmarks/mapped_capture_lab.py --n 498 --mib 20 --json "$R/mapped_capture_498.json" 2>&1 | tail -1 | cut -c1-400
echo "=== done ($(date +%T))"
