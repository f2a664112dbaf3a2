"""Delta refits on GPUs (marked ``gpu``): the CPU suite's every-dtype scenario
(``test_delta._dtypes_world``: every dtype, a cast, block-FP8 targets, densities 0 to
100%, NaN payloads and -0.0) with CUDA tensors, checked bit for bit against a full refit
into a second destination. Over gloo with both processes on one GPU (the diff and the
patch run on the device, the messages through host memory), and over NCCL with one GPU
per process (needs 2 GPUs).
"""

from __future__ import annotations

import pytest
import torch
from test_delta import _dtypes_world, check_dtypes

from torchrefit.testing import run_world


@pytest.mark.gpu
@pytest.mark.parametrize("delta", ["device", "host"])
def test_gloo_with_cuda_tensors(delta: str) -> None:
    check_dtypes(run_world(_dtypes_world, 2, delta, "cuda", "gloo", timeout=300))


@pytest.mark.gpu
def test_nccl_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL cannot pair two ranks on one GPU; needs 2 GPUs")
    check_dtypes(run_world(_dtypes_world, 2, "device", "cuda", "nccl", backend="cpu:gloo,cuda:nccl",
                           timeout=300))
