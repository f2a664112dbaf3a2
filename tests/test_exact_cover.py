"""Every destination element is covered exactly once, or the refit raises on every rank.

Covers a name map whose segments overlap (more elements than the tensor holds), one
whose overlap hides a gap (as many elements as the tensor, two regions sharing some
and none feeding others), a map reading past the source's end, on 2 real processes (gloo): each rank raises the same
``PlanError`` within seconds and writes nothing. The overlap test on the planner's
boxes compares with a brute-force element count.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

import torchrefit as tr
from torchrefit.layout._types import Box
from torchrefit.maps import NameMap, Segment
from torchrefit.plan.planner import _overlapping
from torchrefit.testing import attempt_refit, check_failed_everywhere, run_world

ROWS, COLS = 8, 4


class _Rows(NameMap):
    """Destination ``w`` made of row blocks ``[lo, hi)`` of source ``w``, as given."""

    def __init__(self, blocks: tuple[tuple[int, int], ...]) -> None:
        self.blocks = blocks

    def segments(self, dst_name, dst_shape, src_names, src_aliases):
        return [Segment(Box((lo, 0), (hi - lo, COLS)), "w", (lo, 0), part=True)
                for lo, hi in self.blocks]


class _Model(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((ROWS, COLS), value))


CASES = {
    # rows 3 and 4 fed twice: 40 elements for 32
    "overlap": ((0, 5), (3, 8)),
    # rows 0-3 fed twice, rows 4-7 never: 32 elements for 32
    "overlap-hides-gap": ((0, 4), (0, 4)),
    # one block short: a gap
    "gap": ((0, 4), (5, 8)),
}
TEXTS = {
    "overlap": "some elements are covered more than once",
    "overlap-hides-gap": "covered more than once and as many have no source",
    "gap": "4 of 32 elements have no source",
}


def _world(rank: int, world: int, names: list[str]) -> dict[str, dict]:
    return {name: attempt_refit(_Model(1.0), _Model(2.0), name_map=_Rows(CASES[name]), timeout=20)
            for name in names}


@pytest.fixture(scope="module")
def results():
    return run_world(_world, 2, list(CASES), timeout=120, pg_timeout=30)


@pytest.mark.parametrize("name", list(CASES))
def test_double_coverage_raises_on_every_rank(name, results) -> None:
    assert len(results) == 2
    check_failed_everywhere([per_rank[name] for per_rank in results], tr.PlanError, TEXTS[name],
                            max_seconds=20)


def test_exact_rows_refit() -> None:
    """The same map with blocks that tile the tensor plans and refits (the control)."""
    got = run_world(_exact_world, 2, timeout=120, pg_timeout=30)
    assert got == [True, True]


def _exact_world(rank: int, world: int) -> bool:
    src, dst = _Model(1.0), _Model(2.0)
    tr.Refitter(src, dst, name_map=_Rows(((0, 3), (3, 8)))).refit()
    return torch.equal(dst.w, src.w)


def test_segment_outside_the_source_is_refused() -> None:
    """A name map that reads past the source's end: a ``bounds`` PlanError, not a read of
    whatever lies beyond (the planner alone, every rank sees the same rosters)."""
    from torchrefit.layout import ModelLayout, TensorLayout, whole_piece
    from torchrefit.plan.world_plan import plan_world

    def held(rows):
        return ModelLayout((("w", TensorLayout("w", (rows, COLS), "float32", (rows, COLS),
                                               whole_piece((rows, COLS)))),))

    class _Past(NameMap):  # the destination's 8 rows from rows 4-11 of a 10-row source
        def segments(self, dst_name, dst_shape, src_names, src_aliases):
            return [Segment(Box((0, 0), (ROWS, COLS)), "w", (4, 0), part=True)]

    with pytest.raises(tr.PlanError, match="outside one of the two tensors") as got:
        plan_world([held(10)], [held(ROWS)], name_map=_Past())
    assert got.value.rule == "bounds"


def _brute(boxes: list[Box]) -> bool:
    seen: set[tuple[int, ...]] = set()
    for b in boxes:
        for c in itertools.product(*(range(o, o + s) for o, s in zip(b.offset, b.size))):
            if c in seen:
                return True
            seen.add(c)
    return False


def test_overlapping_matches_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(400):
        boxes = []
        for _ in range(rng.randint(1, 5)):
            off = tuple(rng.randint(0, 5) for _ in range(3))
            boxes.append(Box(off, tuple(rng.randint(0, 3) for _ in range(3))))
        assert _overlapping(boxes) == _brute(boxes), boxes
    assert _overlapping([Box((), ()), Box((), ())])
    assert not _overlapping([Box((0,), (4,)), Box((4,), (4,))])
