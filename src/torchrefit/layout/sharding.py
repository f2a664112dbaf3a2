"""Pieces of common sharding patterns, for adapters and for users' explicit layouts.

``shard_pieces`` covers the tensor-parallel patterns Megatron-core uses:

* plain: the global dim is cut into ``world`` equal blocks; rank r holds block r;
* strided (``stride`` s): the global dim is cut into ``s * world`` blocks and rank r
  holds blocks ``r, r + world, ...``; a SwiGLU ``linear_fc1`` is stride 2, so each
  rank holds its part of the gate and its part of the up projection;
* block-interleaved (``sizes``): the global dim packs components of global sizes
  ``sizes[i] * world`` (Mamba ``in_proj``: z, x, B, C, dt); each component is cut
  plainly and a rank's local tensor concatenates its block of each. ``sizes`` are
  the per-rank (local) block sizes, as Megatron's ``partition_sizes`` attribute.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from ..errors import LayoutError
from ._types import Box, Piece

__all__ = ["shard_pieces", "whole_piece"]


def whole_piece(shape: Sequence[int]) -> tuple[Piece, ...]:
    """The single piece of a tensor that a rank holds entirely."""
    # a plain tuple as is (Box.whole makes its sizes ints): 0.2 us against 1 us, per tensor
    return _whole_piece(shape if type(shape) is tuple else tuple(int(s) for s in shape))


@lru_cache(maxsize=4096)
def _whole_piece(shape: tuple[int, ...]) -> tuple[Piece, ...]:
    # one (immutable) piece per shape: a MoE model's thousands of experts share a few
    return (Piece(Box.whole(shape), (0,) * len(shape)),)


def shard_pieces(
    local_shape: Sequence[int],
    dim: int,
    rank: int,
    world: int,
    *,
    stride: int = 1,
    sizes: Sequence[int] | None = None,
    name: str = "tensor",
) -> tuple[tuple[int, ...], tuple[Piece, ...]]:
    """Global shape and pieces of a local tensor sharded along ``dim`` over ``world`` ranks.

    Raises :class:`LayoutError` naming ``name`` where the local extent does not fit
    the pattern (a stride that does not divide it, sizes that do not sum to it).
    """
    local_shape = tuple(int(s) for s in local_shape)
    ndim = len(local_shape)
    if not 0 <= dim < ndim:
        raise LayoutError(f"{name}: partition dim {dim} is out of range for shape {list(local_shape)}")
    if not 0 <= rank < world:
        raise LayoutError(f"{name}: rank {rank} is out of range for a group of {world}")
    extent = local_shape[dim]
    # Each block: (local offset, global offset, length) along ``dim``.
    if sizes is not None:
        sizes = [int(s) for s in sizes]
        if sum(sizes) != extent or any(s < 0 for s in sizes):
            raise LayoutError(
                f"{name}: partition sizes {sizes} do not sum to the local extent {extent} "
                f"of dim {dim}"
            )
        blocks, local_off, global_off = [], 0, 0
        for s in sizes:
            blocks.append((local_off, global_off + rank * s, s))
            local_off += s
            global_off += s * world
        global_extent = global_off
    else:
        if stride < 1 or extent % stride:
            raise LayoutError(
                f"{name}: partition stride {stride} does not divide the local extent {extent} "
                f"of dim {dim}"
            )
        chunk = extent // stride
        blocks = [(j * chunk, (j * world + rank) * chunk, chunk) for j in range(stride)]
        global_extent = extent * world
    global_shape = local_shape[:dim] + (global_extent,) + local_shape[dim + 1:]
    return global_shape, _pieces_from_blocks(local_shape, dim, merge_adjacent(blocks))


def merge_adjacent(blocks: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Join ``(local start, global start, length)`` blocks that follow each other both
    locally and globally (e.g. world 1), dropping empty ones."""
    merged: list[tuple[int, int, int]] = []
    for lo, go, n in blocks:
        if n == 0:
            continue
        if merged and merged[-1][0] + merged[-1][2] == lo and merged[-1][1] + merged[-1][2] == go:
            plo, pgo, pn = merged[-1]
            merged[-1] = (plo, pgo, pn + n)
        else:
            merged.append((lo, go, n))
    return merged


def _pieces_from_blocks(
    local_shape: tuple[int, ...], dim: int, blocks: list[tuple[int, int, int]]
) -> tuple[Piece, ...]:
    pieces = []
    for lo, go, n in blocks:
        offset = tuple(go if d == dim else 0 for d in range(len(local_shape)))
        size = tuple(n if d == dim else s for d, s in enumerate(local_shape))
        local_offset = tuple(lo if d == dim else 0 for d in range(len(local_shape)))
        pieces.append(Piece(Box(offset, size), local_offset))
    if not pieces:  # a zero-size dim: one empty piece keeps the tensor described
        pieces.append(Piece(Box((0,) * len(local_shape), local_shape), (0,) * len(local_shape)))
    return tuple(pieces)
