"""How many side streams (graph branches) the large local copies spread over
(``execute.local.branches``): ``BRANCHES`` by default, fewer with
``settings.branches`` (for processes time-sliced on one GPU). On CPU: the lanes
compile_copies assigns, balanced by bytes, and the copies exact against the sources
(the oracle: clones taken before); a value outside 1..BRANCHES is refused when set,
naming the setting, and the settings stay as they were."""

from __future__ import annotations

import pytest
import torch

from torchrefit import settings
from torchrefit.execute import local
from torchrefit.execute.streams import SideStreams

MB = 1 << 20


def _copies() -> list[local.Copy]:
    g = torch.Generator().manual_seed(0)
    # 12 large copies of 1-3 MB: balanced over 2 lanes by bytes, 12 MB each
    return [local.Copy(torch.zeros(n * MB // 4), torch.randn(n * MB // 4, generator=g), f"t{i}")
            for i, n in enumerate([3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 3, 3])]


def _compile(copies: list[local.Copy]) -> local.LocalCopies:
    return local.compile_copies(copies, SideStreams(torch.device("cpu"), local.LANES), cuda_graph=False)


def test_default_spreads_over_every_branch() -> None:
    assert sorted(set(_compile(_copies()).branch_of)) == list(range(local.BRANCHES))


def test_fewer_branches_balanced_and_exact() -> None:
    settings.configure(branches=2)
    copies = _copies()
    want = [c.src.clone() for c in copies]
    compiled = _compile(copies)
    load = [0, 0]
    for c, lane in zip(compiled.big, compiled.branch_of):
        load[lane] += c.dst.nbytes
    assert load == [12 * MB, 12 * MB], load
    compiled.run_on_caller(SideStreams(torch.device("cpu"), local.LANES))
    assert all(torch.equal(c.dst, w) for c, w in zip(copies, want))


@pytest.mark.parametrize("bad", [0, 9, -1])
def test_bad_value_is_refused_and_keeps_the_default(bad: int) -> None:
    with pytest.raises(ValueError, match=f"branches must be 1 to {local.BRANCHES}, not {bad}"):
        settings.configure(branches=bad)
    compiled = _compile(_copies())
    assert sorted(set(compiled.branch_of)) == list(range(local.BRANCHES))
