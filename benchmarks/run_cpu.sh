#!/usr/bin/env bash
# The CPU benchmarks behind BENCHMARKS.md: planning at scale and a first refit's host work.
# Usage (repo root, no GPU needed): bash benchmarks/run_cpu.sh [all|plan|first_refit|watch|stage]
# plan_scaling.py compares megatron-core's planner where MEGATRON_PATH names an unpacked
# megatron-core (see its docstring); without it, torchrefit's rows only.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
R=${OUT:-benchmarks/results/cpu}

plan() {
  mkdir -p "$R/plan"
  python3 benchmarks/plan_16k.py
  if [ -n "${MEGATRON_PATH:-}" ]; then
    python3 benchmarks/plan_scaling.py --megatron-path "$MEGATRON_PATH"
  else
    python3 benchmarks/plan_scaling.py --no-megatron
  fi
}

first_refit() {
  mkdir -p "$R/first_refit"
  python3 benchmarks/first_refit.py --preset qwen3-30b-a3b --layers 8 --json "$R/first_refit/qwen3.json"
}

watch() {
  mkdir -p "$R/watch"
  python3 benchmarks/watch_cost.py --preset qwen3-30b-a3b --layers 8 --json "$R/watch/qwen3.json"
}

# `stage`: refit while the engine serves, two processes over gloo: a plain refit against
# stage() + commit() (the commit is the engine's stall), and the engine's matmul loop while
# a stage runs against the same loop idle (both processes share the machine's cores)
stage() {
  mkdir -p "$R/stage"
  python3 -m torchrefit bench --stage --model dense-0.5b --nproc 2 --mode non-collocated \
    --transport gloo --warmup 1 --iters 5 --label stage_dense-0.5b_gloo --json "$R/stage/stage_dense-0.5b_gloo.json"
  python3 benchmarks/stage_commit.py --transport gloo --hidden 1024 --layers 4 --vocab 32000 \
    --stages 6 --json "$R/stage/stage_commit_gloo.json"
}

case ${1:-all} in
  all) plan; first_refit; watch; stage ;;
  plan|first_refit|watch|stage) "$1" ;;
  *) echo "unknown benchmark: $1"; exit 2 ;;
esac
