"""Delta refits on GPUs (marked ``gpu``): the CPU suite's every-dtype scenario
(``test_delta._dtypes_world``: every dtype, a cast, block-FP8 targets, densities 0 to
100%, NaN payloads and -0.0) with CUDA tensors, checked bit for bit against a full refit
into a second destination. Over gloo with both processes on one GPU (the diff and the
patch run on the device, the messages through host memory), and over NCCL with one GPU
per process (needs 2 GPUs), and over CUDA IPC between 2 processes (on one GPU where the
machine has one; ``execute.delta_one_sided``: the receiver applies patches straight out of
the sender's registered slots and copies dense messages out of its sources), with the
version chain's stage / commit sequence (``test_delta._chain_world``) too. CUDA tensors take the Triton kernels (``settings.triton_delta``)
unless turned off: both forms run, and the Triton kernels also against the torch ops
message by message (``test_delta_triton_interpreted``'s cases on the GPU, with NaN payloads
through the fused cast).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_delta import _chain_world, _dtypes_world, check_chain, check_dtypes
from test_delta_triton_interpreted import _CODE

from torchrefit.testing import run_world


@pytest.mark.gpu
@pytest.mark.parametrize("delta, triton", [("device", True), ("device", False), ("host", True)])
def test_gloo_with_cuda_tensors(delta: str, triton: bool) -> None:
    check_dtypes(run_world(_dtypes_world, 2, delta, "cuda", "gloo", True, triton, timeout=300))


@pytest.mark.gpu
def test_triton_kernels_match_the_torch_ops_on_the_gpu() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _CODE.replace("DEVICE", "cuda")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("EXACT"), out.stdout


@pytest.mark.gpu
def test_nccl_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL cannot pair two ranks on one GPU; needs 2 GPUs")
    check_dtypes(run_world(_dtypes_world, 2, "device", "cuda", "nccl", backend="cpu:gloo,cuda:nccl",
                           timeout=300))


@pytest.mark.gpu
@pytest.mark.parametrize("delta, triton", [("device", True), ("device", False), ("host", True)])
def test_ipc_two_processes(delta: str, triton: bool) -> None:
    check_dtypes(run_world(_dtypes_world, 2, delta, "cuda", "ipc", True, triton, timeout=300))


@pytest.mark.gpu
def test_ipc_version_chain_with_stage_and_commit() -> None:
    check_chain(run_world(_chain_world, 2, "ipc", "cuda", timeout=300)[1]["rows"])
