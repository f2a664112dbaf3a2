"""The layout suite of ``test_layouts.py`` on GPUs.

* 8 GPUs, one process per GPU, over NCCL, and over NVSHMEM (8 PEs) where its package
  is installed (skipped where fewer than 8 are present);
* one GPU shared by 8 processes, through every one-sided transport usable here
  (``ipc``, ``nixl`` where its package is installed), in a Gloo world (a push
  transport, nixl, converts a dtype through buffers of the wire dtype).
"""

from __future__ import annotations

import pytest
import torch
from test_layouts import CASES, WORLD, _world_cases, check_case

from torchrefit.testing import run_world, usable_transports
from torchrefit.transport.base import transport_class

pytestmark = pytest.mark.gpu
EIGHT = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
                           reason=f"needs {WORLD} CUDA GPUs")
ONE_SIDED = usable_transports(cuda=True, one_sided_only=True) if torch.cuda.is_available() else []


@pytest.fixture(scope="module")
def results():
    return run_world(_world_cases, WORLD, CASES, True, backend="nccl", timeout=900)


@EIGHT
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_layout_case_on_gpus(case, results) -> None:
    check_case(case, results)


@pytest.fixture(scope="module")
def nvshmem_results():
    if not transport_class("nvshmem").available():
        pytest.skip(f"nvshmem: {transport_class('nvshmem').available().reason}")
    return run_world(_world_cases, WORLD, CASES, True, "nvshmem", backend="gloo", timeout=900)


@EIGHT
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_layout_case_on_gpus_nvshmem(case, nvshmem_results) -> None:
    check_case(case, nvshmem_results)


@pytest.fixture(scope="module", params=ONE_SIDED or ["none"])
def one_gpu(request):
    if request.param == "none":
        pytest.skip("no one-sided transport is usable here")
    return request.param, run_world(_world_cases, WORLD, CASES, False, request.param, True,
                                    backend="gloo", timeout=900)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_layout_case_one_gpu(case, one_gpu) -> None:
    check_case(case, one_gpu[1])
