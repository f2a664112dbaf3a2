#!/usr/bin/env bash
# Refits between the N processes of one host, one per GPU, and the GPU tests.
# Usage: bash benchmarks/multi_gpu_suite.sh N            N GPUs: nccl, gloo, ipc, nvshmem, nixl
#        bash benchmarks/multi_gpu_suite.sh N --cpu      no GPU: the same layouts over gloo, N processes
#        bash benchmarks/multi_gpu_suite.sh N [--cpu] --dry-run   print the commands only
# N = 2, 4 or 8. TRANSPORTS="nixl nvshmem" runs only those; GPU_TESTS=0 skips the GPU tests.
# Every bench run verifies the destination against the source (verify())
# before it reports. On GPUs each run also measures the NCCL link between GPUs 0 and 1 and
# reports the floor per GPU (remote bytes / link bandwidth vs local bytes / HBM copy
# bandwidth); nvshmem and nixl run where they are installed and say why not elsewhere.
# tests/test_multi_gpu_suite.py runs the CPU mode (N = 2) on every change, and checks the
# GPU mode's commands for N = 8 with --dry-run. Exit status: the number of failed steps.
set -u
N=${1:?number of processes (GPUs)}
shift
CPU=0 DRY=0
for arg in "$@"; do
  case $arg in
    --cpu) CPU=1 ;;
    --dry-run) DRY=1 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
R=${OUT:-benchmarks/results}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ "$DRY" = 0 ]; then
  mkdir -p "$R"
  exec > >(tee "$R/multi_gpu_${N}$([ "$CPU" = 1 ] && echo _cpu).log") 2>&1
fi
failed=0
step() {  # step LABEL COMMAND...: run (or print) one step, counting failures
  local label=$1
  shift
  echo "=== $label ($(date +%T))"
  if [ "$DRY" = 1 ]; then echo "$*"; return; fi
  "$@" || { echo "FAILED: $label"; failed=$((failed + 1)); }
}
unavailable() {  # why transport $1 cannot run in this environment ("" where it can)
  python3 -c "from torchrefit.transport.base import transport_class as t; ok = t('$1').available(); print('' if ok else ok.reason)"
}

if [ "$CPU" = 1 ]; then
  transports="gloo"
  B=(python3 -m torchrefit bench --warmup 1 --iters 2 --variant plain)
  tag=cpu
else
  transports=${TRANSPORTS:-nccl gloo ipc nvshmem nixl}
  B=(python3 -m torchrefit bench --model gpt-4b --variant graph)
  tag=gpu
fi

for t in $transports; do
  if [ "$CPU" = 0 ] && [ "$DRY" = 0 ]; then
    why=$(unavailable "$t")
    if [ -n "$why" ]; then echo "=== $t: not run here: $why"; continue; fi
  fi
  step "tp2->tp1 $t" "${B[@]}" --nproc 2 --src tp2 --dst tp1 --transport "$t" \
    --label "tp2->tp1 $t" --json "$R/${tag}${N}_tp2_tp1_$t.json"
  step "tp1->tp2 $t" "${B[@]}" --nproc 2 --src tp1 --dst tp2 --transport "$t" \
    --label "tp1->tp2 $t" --json "$R/${tag}${N}_tp1_tp2_$t.json"
  if [ "$N" -ge 4 ]; then
    step "tp2pp2->tp4 $t" "${B[@]}" --nproc 4 --src tp2pp2 --dst tp4 --transport "$t" \
      --label "tp2pp2->tp4 $t" --json "$R/${tag}${N}_tp2pp2_tp4_$t.json"
    step "tp2->tp2 non-collocated $t" "${B[@]}" --nproc 4 --src tp2 --dst tp2 --mode non-collocated \
      --transport "$t" --label "tp2(0-1)->tp2(2-3) non-collocated $t" --json "$R/${tag}${N}_noncolloc_tp2_tp2_$t.json"
  fi
  if [ "$N" -ge 8 ]; then
    step "tp8->tp4xdp2 $t" "${B[@]}" --nproc 8 --src tp8 --dst tp4 --transport "$t" \
      --label "tp8->tp4xdp2 $t" --json "$R/${tag}${N}_tp8_tp4dp2_$t.json"
  fi
done

if [ "$CPU" = 0 ] && [ "${GPU_TESTS:-1}" != 0 ]; then
  step "correctness on the GPUs" python3 -m pytest -q -p no:cacheprovider \
    tests/test_gpu_stale_read.py tests/test_gpu_layouts.py tests/test_gpu_one_sided.py \
    tests/test_gpu_refit.py tests/test_gpu_nvshmem.py
fi
echo "=== $failed step(s) failed"
exit "$failed"
