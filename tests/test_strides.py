"""Rows two strided regions share (``_util.strides``), as NIXL's descriptors cut them
(``transport.nixl.contiguous_runs``): the runs, expanded element by element, are every
element's address on both sides in row-major order (the oracle: index arithmetic over
every index), and each run is as long as the dims dense on both sides allow."""

from __future__ import annotations

import itertools

import pytest
import torch

from torchrefit.transport.nixl import contiguous_runs


def _addresses(t: torch.Tensor) -> list[int]:
    return [t.data_ptr() + t.element_size() * sum(i * s for i, s in zip(idx, t.stride()))
            for idx in itertools.product(*[range(n) for n in t.shape])]


def _expanded(starts: list[int], nbytes: int, itemsize: int) -> list[int]:
    return [a + k * itemsize for a in starts for k in range(nbytes // itemsize)]


BASE = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8)
CASES = {
    "both dense": (BASE[:2], BASE[2:]),
    "column half into a full row": (BASE[:, :, :4], BASE[:, :, 4:].contiguous()),
    "rows of a half": (BASE[:, :3], BASE[:, 3:]),
    "transposed": (BASE[0].t(), BASE[1].t().contiguous()),
    "unit dim with any stride": (BASE[:, :1, :], BASE[:, 2:3, :]),
    "scalar": (BASE[0, 0, 0], BASE[1, 1, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_contiguous_runs_cover_every_element_in_order(case: str) -> None:
    a, b = CASES[case]
    size = a.element_size()
    got_a, got_b, n = contiguous_runs((a.data_ptr(), tuple(a.shape), tuple(a.stride())),
                                      (b.data_ptr(), tuple(b.shape), tuple(b.stride())), size)
    assert _expanded(got_a, n, size) == _addresses(a)
    assert _expanded(got_b, n, size) == _addresses(b)


def test_runs_are_as_long_as_both_sides_allow() -> None:
    a, b = CASES["column half into a full row"]
    _, _, n = contiguous_runs((a.data_ptr(), tuple(a.shape), tuple(a.stride())),
                              (b.data_ptr(), tuple(b.shape), tuple(b.stride())), 4)
    assert n == 4 * 4  # one row of four floats: the source's rows are longer, the destination's not
    a, b = CASES["unit dim with any stride"]
    _, _, n = contiguous_runs((a.data_ptr(), tuple(a.shape), tuple(a.stride())),
                              (b.data_ptr(), tuple(b.shape), tuple(b.stride())), 4)
    assert n == 8 * 4  # the unit dim does not cut the rows
