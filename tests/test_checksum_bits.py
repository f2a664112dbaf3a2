"""The verify checksum sees every single flipped bit, wherever the element sits.

Every coordinate weight is odd (over a million coordinates per dim), so a word that
changes by ``±2**k`` changes the sum by ``2**k`` times an odd number, never 0 mod
``2**32``. The property test flips every bit of sampled elements of bf16, fp16, fp32,
fp8 (e4m3, e5m2), int8, int32 and int64 tensors: at random positions of a tensor
placed at a random offset of a large global tensor, and at coordinates whose weight
has bits 1..15 clear in both dims (there a weight missing its low bit would be a
multiple of ``2**16`` in each dim, ``2**32`` in their product, and the flip would
vanish from the sum).
"""

from __future__ import annotations

import random

import pytest
import torch

from torchrefit.layout import Box
from torchrefit.verify import region_sum
from torchrefit.verify.checksum import coordinate_weights

SPAN = 1 << 21  # global coordinates searched per dim
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.int32, torch.int64]
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _lean(dim: int, n: int) -> list[int]:
    """The first ``n`` coordinates of ``dim`` whose weight has bits 1..15 clear."""
    w = coordinate_weights(dim, 0, SPAN, torch.device("cpu"))
    found = torch.nonzero((w & 0xFFFE) == 0).flatten()[:n].tolist()
    assert len(found) == n, f"dim {dim}: only {len(found)} lean coordinates below {SPAN}"
    return found


def test_every_weight_is_odd() -> None:
    for dim in range(4):
        w = coordinate_weights(dim, SPAN - (1 << 20), SPAN, torch.device("cpu"))
        assert bool((w & 1).all()), f"dim {dim}: an even weight"
        assert int(w.min()) > 0 and int(w.max()) < (1 << 31)


def _values(dtype: torch.dtype, shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).mul(3).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(1 << 40)), min(info.max, 1 << 40)
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)


def _missed_flips(x: torch.Tensor, offset: tuple[int, int], at: list[tuple[int, int]]) -> list:
    """(element, bit) pairs among elements ``at`` whose flip leaves the checksum of ``x``
    (placed at global ``offset``) unchanged."""
    box = Box(offset, tuple(x.shape))
    base = int(region_sum(x, box))
    bits = x.element_size() * 8
    missed = []
    for i, j in at:
        for bit in range(bits):
            y = x.clone()
            cell = y[i, j:j + 1].view(_INT[x.element_size()])
            cell.bitwise_xor_(-(1 << bit) if bit == bits - 1 else 1 << bit)  # the sign bit as a signed int
            assert not torch.equal(y.view(_INT[x.element_size()]), x.view(_INT[x.element_size()]))
            if int(region_sum(y, box)) == base:
                missed.append(((i, j), bit))
    return missed


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
def test_every_bit_flip_at_sampled_positions_changes_the_checksum(dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    rng = random.Random(str(dtype))
    missed = []
    # random positions of a 128 x 512 tensor sitting somewhere in a large global tensor
    x = _values(dtype, (128, 512), gen)
    offset = (rng.randrange(SPAN), rng.randrange(SPAN))
    at = [(rng.randrange(128), rng.randrange(512)) for _ in range(4)] + [(0, 0), (127, 511)]
    missed += _missed_flips(x, offset, at)
    # lean coordinates: the word at (row, col) of a small tensor placed to hold it
    per = max(1, x.element_size() // 2)  # words per element (the last dim counted in words)
    for row in _lean(0, 3):
        for col in _lean(1, 3):
            i, j = rng.randrange(4), rng.randrange(8)
            offset = (row - i, col // per - j)
            if min(offset) < 0:
                continue
            missed += _missed_flips(_values(dtype, (4, 8), gen), offset, [(i, j)])
    assert not missed, f"{dtype}: {len(missed)} flips leave the checksum unchanged, e.g. {missed[:4]}"
