"""The GPU paths under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which RL
stacks often set: the caching allocator then reserves one address range per segment
and maps it in 2 or 20 MB pieces, and a tensor may span two pieces.

Under this setting a range lookup that assumes one mapping per segment raises "span ...
outside its allocation" on the graph path: the driver's mapped range is one piece. Covered here,
in worlds spawned with the setting: the memory really is of mapped pieces in a
reserved range (``execute.runs``' view of it), merged expert runs on the graph path
(exact, also after storage moves), and the one-sided transports between two processes
(``tests/test_gpu_one_sided.py``'s cases: ipc then shares each storage as its pieces).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

EXPANDABLE = "expandable_segments:True"


def _pieces(rank: int, world: int) -> dict:
    from torchrefit.execute import runs

    torch.cuda.set_device(0)
    ts = [torch.empty(3 << 20, dtype=torch.uint8, device="cuda") for _ in range(20)]  # 60 MB: 3+ pieces
    mapped = [runs._mapped_range(t.data_ptr()) for t in ts]
    reserved = [runs._reserved_range(t.data_ptr()) for t in ts]
    held = [runs.allocation_of(t) for t in ts]
    # cudaMalloc'd memory (the setting switched off for new segments) keeps the driver's
    # mapped range, as before expandable segments were known
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    plain = torch.empty(30 << 20, dtype=torch.uint8, device="cuda")
    return {"pieces": len(set(mapped)), "reserved": len(set(reserved)), "none": reserved.count(None),
            "held": all(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for t, (lo, hi) in zip(ts, held)),
            "plain_reserved": runs._reserved_range(plain.data_ptr()),
            "plain_same": runs.allocation_of(plain) == runs._mapped_range(plain.data_ptr())}


@pytest.fixture(autouse=True)
def _expandable(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none is present on this machine")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", EXPANDABLE)  # spawned workers inherit it


def test_memory_is_pieces_of_one_reserved_range() -> None:
    from torchrefit.testing import run_world

    (got,) = run_world(_pieces, 1, backend="gloo", timeout=120)
    assert got["pieces"] >= 3 and got["none"] == 0 and got["reserved"] == 1, got
    assert got["held"], got
    assert got["plain_reserved"] is None and got["plain_same"], got


def test_merged_expert_runs_exact() -> None:
    from test_gpu_refit import _merged_runs

    from torchrefit.testing import run_world

    (got,) = run_world(_merged_runs, 1, backend="nccl", timeout=180)
    assert got["graph"] and got["merged"] > 0 and got["copies"] < got["planned"], got
    assert got["exact"] and got["after_move_exact"], got


@pytest.mark.parametrize("transport", ["ipc", "ipc:delegate"])
def test_one_sided_two_processes(transport: str) -> None:
    from test_gpu_one_sided import _world, assert_exact_cases

    from torchrefit.testing import run_world

    assert_exact_cases(run_world(_world, 2, transport, backend="gloo", timeout=240), transport)
