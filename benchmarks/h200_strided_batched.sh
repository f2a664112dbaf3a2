#!/usr/bin/env bash
# Eleventh session: large strided copies batched row by row in the one-launch copy kernel
# (execute.batched.strided_runs), with the kernel's disk cache and device guard checked on
# a GPU for the first time. One call:
# 1. GPU tests of the batched path, the graph path, the one-sided (ipc) pulls;
# 2. the kernel's first use in a fresh process with an empty disk cache, then again (read back);
# 3. the seed's 40 row-parallel halves alone (benchmarks/strided_copies.py), every variant;
# 4. ipc TP2 -> TP1 collocated (2 and 4 processes), batched (default) and not
#    (TORCHREFIT_BATCHED_COPY=0: the widened elementwise copies of before), non-collocated
#    TP2 -> TP1 (3 processes) and TP1 -> TP1 (2 processes).
# Run from the repository root; results and log in $OUT (default benchmarks/results/h200/strided_batched).
set -u
R=${OUT:-benchmarks/results/h200/strided_batched}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
exec > >(tee -a "$R/run.log") 2>&1
step() { echo; echo "=== $* ($(date +%T))"; }
python3 -m compileall -q src >/dev/null
step "1. GPU tests: batched copies, graph path, one-sided pulls"
timeout 260 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_batched.py \
  tests/test_gpu_refit.py tests/test_gpu_one_sided.py tests/test_kernel_cache.py 2>&1 | tail -15
step "2. the kernel's first use: empty disk cache, then read back"
export TORCHREFIT_KERNEL_CACHE=$(mktemp -d)
timeout 60 python3 benchmarks/batched_first_use.py --json "$R/first_use_cold.json"
timeout 60 python3 benchmarks/batched_first_use.py --json "$R/first_use_cached.json"
step "3. strided copies alone"
timeout 120 python3 benchmarks/strided_copies.py --json "$R/strided_copies.json"
step "4. ipc refits"
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc"
for n in 2 4; do
  timeout 100 $B --nproc $n --src tp2 --dst tp1 --label "tp2->tp1 collocated $n procs ipc batched" \
    --json "$R/colloc${n}_batched.json" 2>&1 | tail -1
  TORCHREFIT_BATCHED_COPY=0 timeout 100 $B --nproc $n --src tp2 --dst tp1 \
    --label "tp2->tp1 collocated $n procs ipc widened" --json "$R/colloc${n}_widened.json" 2>&1 | tail -1
done
timeout 100 $B --nproc 3 --mode non-collocated --src tp2 --dst tp1 \
  --label "tp2->tp1 non-collocated 3 procs ipc batched" --json "$R/noncolloc3_tp2_tp1.json" 2>&1 | tail -1
timeout 100 $B --nproc 2 --mode non-collocated --iters 50 \
  --label "tp1->tp1 non-collocated 2 procs ipc" --json "$R/noncolloc2_tp1_tp1.json" 2>&1 | tail -1
step done
