"""The layout suite of ``test_layouts.py`` on 8 GPUs, one process per GPU, over NCCL.

Marked ``gpu``; skipped with a reason where fewer than 8 GPUs are present (the
cases' meshes span 8 ranks).
"""

from __future__ import annotations

import pytest
import torch
from test_layouts import CASES, WORLD, _world_cases, check_case

from torchrefit.testing import run_world

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
    reason=f"needs {WORLD} CUDA GPUs")]


@pytest.fixture(scope="module")
def results():
    return run_world(_world_cases, WORLD, CASES, True, backend="nccl", timeout=900)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_layout_case_on_gpus(case, results) -> None:
    check_case(case, results)
