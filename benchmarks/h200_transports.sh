#!/usr/bin/env bash
# Issue 10 on one H200: the one-sided transports and nvshmem measured against the copy floor
# of the same run, their GPU tests, and the stale-read tests with the waits removed.
# Run from the repo root on the GPU machine. Optional packages importable beforehand:
# nixl-cu13 and/or nvshmem4py-cu13 (pip install --no-deps --target /tmp/site X.whl;
# PYTHONPATH=/tmp/site). Results go to $OUT (default benchmarks/results/h200); the log
# to $OUT/h200_transports.log.
# Usage: bash benchmarks/h200_transports.sh [PARTS]   PARTS: comma list of
#        bench,nvshmem,diagnose,tests,layouts (default: all but layouts)
# Benches, then the tests: as they are (STALE selects the stale-read cases), with every
# producer wait removed, with every done wait removed (the last two must FAIL in each
# one-sided and nvshmem case they name).
set -u
R=${OUT:-benchmarks/results/h200}
WHAT=${1:-bench,nvshmem,diagnose,tests}
has() { case ",$WHAT," in *",$1,"*) return 0;; *) return 1;; esac; }
mkdir -p "$R"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
exec > >(tee -a "$R/h200_transports.log") 2>&1
step() { echo; echo "=== $* ($(date +%T))"; }
B="python -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20"
# an installed package has its bytecode; a copied tree does not (seconds of the first refit)
python -m compileall -q src >/dev/null

step environment
python - <<'PY'
import torch
from torchrefit.transport.base import registered
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for c in registered():
    ok = c.available()
    print(f"transport {c.name:<8} {c.protocol:<10} {'available' if ok else 'unavailable: ' + ok.reason}")
PY

if has bench; then
  for done in ${IPC_DONE:-host stream}; do
    step "seed model TP1 -> TP1, 2 processes non-collocated on one GPU, ipc, done wait on the $done"
    TORCHREFIT_IPC_DONE=$done $B --nproc 2 --mode non-collocated --transport ipc \
      --label "gpt-4b tp1->tp1 2 procs non-collocated ipc done=$done" --json "$R/h200_transports_noncolloc_ipc_$done.json"
    step "seed model TP2 -> TP1, 4 processes collocated on one GPU, ipc, done wait on the $done"
    TORCHREFIT_IPC_DONE=$done $B --nproc 4 --src tp2 --dst tp1 --transport ipc \
      --label "gpt-4b tp2->tp1 4 procs collocated ipc done=$done" --json "$R/h200_transports_colloc_tp2_tp1_ipc_$done.json"
  done
  for t in ${TRANSPORTS:-nixl}; do  # TRANSPORTS=" " for none
    python -c "from torchrefit.transport.base import transport_class as c; import sys; sys.exit(not c('$t').available())" || continue
    step "seed model TP1 -> TP1, 2 processes non-collocated on one GPU, $t"
    $B --nproc 2 --mode non-collocated --transport $t --label "gpt-4b tp1->tp1 2 procs non-collocated $t" \
       --json "$R/h200_transports_noncolloc_$t.json"
  done
fi
if has nvshmem && python -c "import nvshmem" 2>/dev/null; then
  step "nvshmem: seed model TP1 -> TP1 in one process (one PE: local copies only)"
  $B --nproc 1 --transport nvshmem --label "gpt-4b tp1->tp1 1 proc nvshmem" --json "$R/h200_transports_nvshmem_1proc.json"
  step "nvshmem: one PE putting to itself through its inbox, 512 MiB messages"
  python benchmarks/nvshmem_one_gpu.py --puts --json "$R/h200_transports_nvshmem_puts.json"
  step "nvshmem: two PEs sharing the one GPU (probe; may be refused without MPS)"
  TORCHREFIT_NVSHMEM_SHARED_GPU=1 timeout 45 python benchmarks/nvshmem_one_gpu.py --probe || echo "probe exit $?"
fi
if has diagnose; then
  step "where the first refit and the copies spend their time, ipc, 2 processes"
  python benchmarks/one_sided_first_refit.py --transport ipc
  step "a refit's timeline on both ranks and raw protocols over its copies, ipc, 2 processes"
  python benchmarks/ipc_timeline.py --iters 30 --json "$R/h200_ipc_timeline.json"
  step "4 and 2 processes copying on the one GPU, no torchrefit (time slicing's floor)"
  python benchmarks/shared_gpu_copies.py --nproc 4 --json "$R/h200_shared_gpu_copies_4.json"
  python benchmarks/shared_gpu_copies.py --nproc 2 --json "$R/h200_shared_gpu_copies_2.json"
fi
if has tests; then
  # one pytest at a time: four at once (run 3) left a world waiting until its timeout
  T="python -m pytest -q -p no:cacheprovider --tb=line"
  step "GPU tests as they are: must pass"
  $T tests/test_gpu_one_sided.py tests/test_gpu_nvshmem.py
  $T tests/test_gpu_stale_read.py -k "${STALE:-ipc or nixl or nvshmem or overwrite}"
  step "stale reads with every producer wait removed: each case must FAIL"
  TORCHREFIT_BREAK_PRODUCER_WAIT=1 $T tests/test_gpu_stale_read.py -k "refit_never and (ipc or nixl or nvshmem)"
  step "early overwrites with every done wait removed: each case must FAIL"
  TORCHREFIT_BREAK_DONE_WAIT=1 $T tests/test_gpu_stale_read.py -k overwrite
fi
if has layouts; then
  step "layout suite, 8 processes on one GPU, every one-sided transport"
  python -m pytest -q -p no:cacheprovider tests/test_gpu_layouts.py -k one_gpu
fi
step done
