#!/usr/bin/env bash
# The one-GPU reference run behind BENCHMARKS.md (issues 2 and 5). Run from the repo root on
# a machine with one H200 and megatron-core importable (bring it as a wheel: see README).
# Results go to $OUT (default benchmarks/results); the log to $OUT/h200_suite.log.
set -u
R=${OUT:-benchmarks/results}
mkdir -p "$R"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
exec > >(tee "$R/h200_suite.log") 2>&1
step() { echo; echo "=== $* ($(date +%T))"; }
B="python -m torchrefit bench"

step environment
python -c "import torch, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'megatron-core', m.__version__)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv

step "stale-read test (issue 2): must pass"
python -m pytest -q -p no:cacheprovider tests/test_gpu_stale_read.py
step "stale-read test with the side stream's producer wait removed: must FAIL"
TORCHREFIT_BREAK_PRODUCER_WAIT=1 python -m pytest -q -p no:cacheprovider tests/test_gpu_stale_read.py
step "the same, one process, in this process (what each path read)"
python benchmarks/stale_debug.py

step "seed model TP1 -> TP1, nccl, vs megatron-core (issue 5 targets)"
$B --model gpt-4b --compare megatron-core --transport nccl --variant plain --variant graph --variant share \
   --label "gpt-4b tp1->tp1 nccl" --json "$R/h200_gpt4b_tp1_nccl.json"
step "seed model TP1 -> TP1, gloo, vs megatron-core"
$B --model gpt-4b --compare megatron-core --transport gloo --variant plain --variant graph \
   --label "gpt-4b tp1->tp1 gloo" --json "$R/h200_gpt4b_tp1_gloo.json"
step "MoE shape, 16 experts, TP1 -> TP1"
$B --model gpt-4b --layers 4 --experts 16 --expert-ffn 4096 --variant plain --variant graph \
   --label "moe-16x tp1->tp1" --json "$R/h200_moe16_tp1.json"
step "4 processes on the one GPU, collocated TP2 -> TP1 through gloo"
$B --model gpt-4b --layers 4 --nproc 4 --src tp2 --dst tp1 --transport gloo --warmup 1 --iters 5 \
   --variant plain --label "gpt 4-layer tp2->tp1 4 procs gloo" --json "$R/h200_4proc_gloo_tp2_tp1.json"
step "4 processes on the one GPU, collocated TP2 -> TP1 through CUDA IPC (same model)"
$B --model gpt-4b --layers 4 --nproc 4 --src tp2 --dst tp1 --transport ipc --warmup 3 --iters 20 \
   --variant plain --variant graph --label "gpt 4-layer tp2->tp1 4 procs ipc" --json "$R/h200_4proc_ipc_tp2_tp1.json"
step "4 processes on the one GPU, the seed's model TP2 -> TP1 through CUDA IPC"
$B --model gpt-4b --nproc 4 --src tp2 --dst tp1 --transport ipc --warmup 3 --iters 20 \
   --variant graph --label "gpt-4b tp2->tp1 4 procs ipc" --json "$R/h200_gpt4b_4proc_ipc_tp2_tp1.json"
step "local-copy lab: where the time goes against the floor"
python benchmarks/local_copy_lab.py --json "$R/h200_local_copy_lab.json"
step "size sweep for the plot"
$B --model gpt-4b --layers 2,5,10,20 --variant graph --warmup 3 --iters 15 \
   --label "size sweep" --json "$R/h200_size_sweep.json" --plot "$R/h200_size_sweep.png"
step done
