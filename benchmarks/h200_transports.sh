#!/usr/bin/env bash
# Issue 10 on one H200: the one-sided transports (ipc, nixl) measured against the copy floor
# of the same run, their GPU tests, and the stale-read test with the producer waits removed.
# Run from the repo root on the GPU machine; nixl needs the nixl-cu13 wheel importable
# (e.g. pip install --no-deps --target /tmp/site nixl_cu13-*.whl; PYTHONPATH=/tmp/site).
# Results go to $OUT (default benchmarks/results/h200); the log to $OUT/h200_transports.log.
# Usage: bash benchmarks/h200_transports.sh [PARTS]   PARTS: comma list of tests,bench,diagnose,layouts
#        (default: all four)
set -u
R=${OUT:-benchmarks/results/h200}
WHAT=${1:-tests,bench,diagnose,layouts}
has() { case ",$WHAT," in *",$1,"*) return 0;; *) return 1;; esac; }
mkdir -p "$R"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
exec > >(tee -a "$R/h200_transports.log") 2>&1
step() { echo; echo "=== $* ($(date +%T))"; }
B="python -m torchrefit bench --model gpt-4b --variant graph"

step environment
python - <<'PY'
import torch
from torchrefit.transport.base import registered
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for c in registered():
    ok = c.available()
    print(f"transport {c.name:<6} {c.protocol:<10} {'available' if ok else 'unavailable: ' + ok.reason}")
PY

if has tests; then
  step "one-sided transports, two processes on one GPU; stale reads: must pass"
  python -m pytest -q -p no:cacheprovider tests/test_gpu_one_sided.py tests/test_gpu_stale_read.py
  step "stale-read test with every producer wait removed: each case must FAIL"
  TORCHREFIT_BREAK_PRODUCER_WAIT=1 python -m pytest -q -p no:cacheprovider tests/test_gpu_stale_read.py
fi
if has bench; then
  for t in ${TRANSPORTS:-ipc nixl}; do
    step "seed model TP1 -> TP1, 2 processes non-collocated on one GPU, $t"
    $B --nproc 2 --mode non-collocated --transport $t --label "gpt-4b tp1->tp1 2 procs non-collocated $t" \
       --json "$R/h200_transports_noncolloc_$t.json"
  done
  step "seed model TP2 -> TP1, 4 processes collocated on one GPU, ipc"
  $B --nproc 4 --src tp2 --dst tp1 --transport ipc --label "gpt-4b tp2->tp1 4 procs collocated ipc" \
     --json "$R/h200_transports_colloc_tp2_tp1_ipc.json"
fi
if has diagnose; then
  step "where the first refit and the copies spend their time, ipc, 2 processes"
  python benchmarks/one_sided_first_refit.py --transport ipc
fi
if has layouts; then
  step "layout suite, 8 processes on one GPU, every one-sided transport"
  python -m pytest -q -p no:cacheprovider tests/test_gpu_layouts.py -k one_gpu
fi
step done
