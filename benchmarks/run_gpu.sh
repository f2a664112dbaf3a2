#!/usr/bin/env bash
# Every one-GPU benchmark behind BENCHMARKS.md, and the GPU tests, on this machine's card.
# Usage (repo root, one GPU, e.g. an H100 80GB or an H200):
#   bash benchmarks/run_gpu.sh [all|tests|matrix|transports|fp8|reliability|watch|stage|delta|fleet]
# Results go to benchmarks/results/<card>/<benchmark>/ ($OUT replaces benchmarks/results/<card>),
# each with its run.log. megatron-core importable puts its swap_model_weights beside
# torchrefit in the matrix (pip install --no-deps megatron-core); without it, toy models only.
# deepseek-v3-moe's two models need more than 80 GB: on a smaller card the matrix skips it.
set -u
cd "$(dirname "$0")/.."
CARD=$(bash benchmarks/card.sh)
BASE=${OUT:-benchmarks/results/$CARD}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
python3 -m torchrefit native build >/dev/null 2>&1 || echo "native watch checks not built"

# `folder NAME`: $R = the benchmark's results folder, its output also into run.log there
folder() {
  R=$BASE/$1
  mkdir -p "$R"
  exec > >(tee -a "$R/run.log") 2>&1
  echo "=== $1 on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)," \
    "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%FT%TZ)"
}

tests() {
  folder tests
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/
  echo "--- the stale-read tests with a wait removed: these must FAIL"
  TORCHREFIT_BREAK_PRODUCER_WAIT=1 python3 -m pytest -q -p no:cacheprovider \
    tests/test_gpu_stale_read.py -k "stale_weights" 2>&1 | tail -3
  TORCHREFIT_BREAK_DONE_WAIT=1 python3 -m pytest -q -p no:cacheprovider \
    tests/test_gpu_stale_read.py -k "overwrites" 2>&1 | tail -3
  TORCHREFIT_BREAK_DONE_WAIT=1 python3 -m pytest -q -p no:cacheprovider \
    tests/test_gpu_delta.py -k "rewrites" 2>&1 | tail -3
}

matrix() {
  folder matrix
  local only=()
  memory=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "${memory:-0}" -lt 120000 ]; then
    only=(--only qwen3-30b-a3b --only dense-0.5b --only llama-8b --only gpt-4b)
  fi
  python3 benchmarks/shape_matrix.py --watch-manual-too "${only[@]}" --json "$R/shape_matrix.json"
  python3 benchmarks/shape_matrix.py --report "$R/shape_matrix.json"
}

transports() {
  folder transports
  R=$R bash benchmarks/transports.sh 3
}

fp8() {
  folder fp8
  python3 benchmarks/fp8_kernel.py --json "$R/fp8_kernel.json"
  python3 -m torchrefit bench --model gpt-4b --map hf --fp8 --variant graph --variant plain \
    --warmup 3 --iters 20 --json "$R/gpt4b_map_hf_fp8.json"
}

reliability() {
  folder reliability
  python3 benchmarks/reliability.py --model gpt-4b --refits 1000 --iters 5 --json "$R/reliability_gpt4b.json"
}

# `watch`: the default watch="every" as a new environment gets it: a fresh kernel cache, so
# the first bench's Refitter starts the native checks' background build; once it landed,
# four presets with the default settings (host time per refit, device and wall x floor)
watch() {
  folder watch
  export TORCHREFIT_KERNEL_CACHE=$(mktemp -d)
  local b=(python3 -m torchrefit bench --transport nccl --variant graph --warmup 3 --iters 20)
  "${b[@]}" --model qwen3-30b-a3b --layers 8 --label first_qwen3 --json "$R/first_qwen3.json"
  for _ in $(seq 90); do python3 -m torchrefit native status | grep -q ": used" && break; sleep 2; done
  python3 -m torchrefit native status
  "${b[@]}" --model qwen3-30b-a3b --layers 8 --label qwen3 --json "$R/qwen3.json"
  "${b[@]}" --model deepseek-v3-moe --layers 1 --label deepseek --json "$R/deepseek.json"
  "${b[@]}" --model llama-8b --label llama --json "$R/llama.json"
  "${b[@]}" --model gpt-4b --label gpt --json "$R/gpt.json"
}

# `stage`: refit while the engine serves: two processes (trainer, engine), a plain refit
# and stage() + commit() in one run, over ipc and gloo; the engine's matmul loop while a
# stage runs against the same loop idle
stage() {
  folder stage
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_stage_order.py 2>&1 | tail -3
  local b=(python3 -m torchrefit bench --stage --nproc 2 --mode non-collocated --warmup 1 --iters 5)
  "${b[@]}" --model gpt-4b --transport ipc --label stage_gpt-4b_ipc --json "$R/stage_gpt-4b_ipc.json"
  "${b[@]}" --model gpt-4b --transport gloo --label stage_gpt-4b_gloo --json "$R/stage_gpt-4b_gloo.json"
  local e=(python3 benchmarks/stage_commit.py --hidden 4096 --layers 8 --vocab 32000 --stages 6)
  "${e[@]}" --transport gloo --json "$R/stage_commit_gloo.json"
  "${e[@]}" --transport ipc --json "$R/stage_commit_ipc.json"
  "${b[@]}" --model llama-8b --transport ipc --label stage_llama-8b_ipc --json "$R/stage_llama-8b_ipc.json"
  "${b[@]}" --model llama-8b --transport gloo --label stage_llama-8b_gloo --json "$R/stage_llama-8b_gloo.json"
}

# `delta`: delta refits on one GPU: the diff, encode and apply against the copy floor (both
# kernel sets, then the Triton kernels in other shapes), and delta against full refits
# between 2 processes over gloo (GPU tensors) and over ipc
delta() {
  folder delta
  python3 benchmarks/delta.py --part gpu --iters 10 --json "$R/delta-gpu.json"
  python3 benchmarks/delta.py --part gpu --iters 10 --shape 4096,8,1024 --shape 2048,8,1024 \
    --shape 2048,8,256 --shape 1024,4,256 --shape 1024,4,128 --shape 2048,4,256 \
    --shape 1024,2,128 --json "$R/kernel-shapes.json"
  python3 benchmarks/delta.py --part gloo-cuda --json "$R/delta_gloo_cuda.json"
  python3 benchmarks/delta.py --part ipc --json "$R/delta-ipc.json"
}

# `fleet`: 1, 2 and 3 replicas over ipc on the one GPU (a chain, then a tree of fan-out 2),
# and the same fleets on the host's CPUs over gloo
fleet() {
  folder fleet
  local f=(python3 benchmarks/fleet.py --chunks 4)
  "${f[@]}" --device cuda --transport ipc --size large --json "$R/fleet-ipc-chunks4.json"
  "${f[@]}" --device cuda --transport ipc --size large --fanout 2 --json "$R/fleet-ipc-chunks4-fanout2.json"
  CUDA_VISIBLE_DEVICES= "${f[@]}" --json "$R/fleet-host-cpu-chunks4.json"
  CUDA_VISIBLE_DEVICES= "${f[@]}" --fanout 2 --json "$R/fleet-host-cpu-chunks4-fanout2.json"
}

case ${1:-all} in
  all) (tests); (matrix); (transports); (fp8); (reliability); (watch); (stage); (delta); (fleet) ;;
  tests|matrix|transports|fp8|reliability|watch|stage|delta|fleet) "$1" ;;
  *) echo "unknown benchmark: $1"; exit 2 ;;
esac
