"""``Box`` arithmetic the planner rests on, against brute force over index sets (the
oracle): intersections (the same box, nested, partial, disjoint, empty, 0-dim) and
translations (also to the same place); and the rule a local tensor's pieces obey
(inside both tensors, each local element in one piece, no global element twice)."""

from __future__ import annotations

import itertools

import pytest

from torchrefit.layout._types import Box


def _cells(box: Box) -> set[tuple[int, ...]]:
    return set(itertools.product(*[range(o, o + s) for o, s in zip(box.offset, box.size)]))


CASES = [
    (Box((0, 0), (4, 6)), Box((0, 0), (4, 6))),  # the same box: returned as it is
    (Box((0, 0), (4, 6)), Box((1, 2), (2, 3))),  # nested
    (Box((0, 0), (4, 6)), Box((2, 4), (4, 4))),  # partial
    (Box((0, 0), (2, 2)), Box((2, 0), (2, 2))),  # touching, disjoint
    (Box((1, 1), (0, 3)), Box((1, 1), (0, 3))),  # the same empty box: no overlap
    (Box((0,), (0,)), Box((0,), (5,))),  # empty inside another
]


@pytest.mark.parametrize("a,b", CASES)
def test_intersect_is_the_common_cells(a: Box, b: Box) -> None:
    common = _cells(a) & _cells(b)
    for x, y in ((a, b), (b, a)):
        got = x.intersect(y)
        if not common:
            assert got is None, (x, y, got)
        else:
            assert got is not None and _cells(got) == common, (x, y, got)
    if a == b and common:
        assert a.intersect(b) is a  # no new box for the usual case


def test_scalar_boxes_intersect() -> None:
    assert Box((), ()).intersect(Box((), ())) == Box((), ())


def test_moved_translates_every_cell() -> None:
    box = Box((2, 3), (2, 2))
    moved = box.moved((2, 0), (0, 5))
    assert _cells(moved) == {(i - 2, j + 5) for i, j in _cells(box)}
    assert box.moved((1, 1), (1, 1)) is box


def _layout(pieces, local=(4, 6), global_=(8, 6)):
    from torchrefit.layout._types import Piece, TensorLayout

    return TensorLayout("w", global_, "float32", local, tuple(Piece(Box(o, s), lo) for o, s, lo in pieces))


@pytest.mark.parametrize("pieces,match", [
    ([((6, 0), (4, 6), (0, 0))], "lies outside the global tensor"),  # rows 6-9 of 8
    ([((0, 0), (4, 6), (1, 0))], "lies outside the local tensor"),  # local rows 1-4 of 4
    ([((0, 0), (2, 6), (0, 0)), ((2, 0), (2, 6), (0, 0))], "do not tile the local tensor"),  # local overlap
    ([((0, 0), (2, 6), (0, 0)), ((0, 0), (2, 6), (2, 0))], "do not tile the local tensor"),  # global overlap
    ([((0, 0), (2, 6), (0, 0))], "do not tile the local tensor"),  # local rows 2-3 in no piece
])
def test_tensor_layout_pieces_must_tile_the_local_tensor(pieces, match) -> None:
    """A local tensor's pieces lie inside both tensors and cover each local element once
    (and no global element twice); otherwise a refit would skip or double-write."""
    from torchrefit.errors import LayoutError

    with pytest.raises(LayoutError, match=match):
        _layout(pieces)
    _layout([((0, 0), (2, 6), (0, 0)), ((4, 0), (2, 6), (2, 0))])  # two row blocks: fine
