"""Pieces of a DTensor's local tensor, from its global shape, mesh coordinate and placements.

Pure: no process group, no DTensor, so it can be tested against torch's own splits
on one CPU. ``dtensor`` (the adapter) calls it once per DTensor with the rank's
mesh coordinate.

DTensor's semantics, followed exactly:

* ``Shard(d)`` cuts the tensor dim as ``torch.chunk`` does: chunks of ``ceil(n / k)``,
  so the last ranks may hold fewer rows or none;
* placements apply left to right over the mesh dims, each cutting what the previous
  ones left (two mesh dims sharding one tensor dim nest);
* ``_StridedShard(d, split_factor=s)`` (FSDP2 over a tensor-parallel dim) first cuts
  what is left into ``s`` chunks, cuts each of those over the mesh dim and
  concatenates this rank's part of each: one local tensor, several pieces;
* ``Replicate()`` cuts nothing; ``Partial`` holds unreduced sums, which a refit cannot
  move (rejected).

Along each tensor dim the rank's local indices are kept as *runs* ``(global start,
length)`` in local order; a local tensor's pieces are the products of its dims' runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from ..errors import LayoutError
from ._types import Box, Piece
from .sharding import merge_adjacent

__all__ = ["placement_pieces"]

Runs = list[tuple[int, int]]  # (global start, length), in local order


def placement_pieces(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[object],
    *,
    order: Sequence[int] | None = None,
    name: str = "tensor",
) -> tuple[tuple[int, ...], tuple[Piece, ...]]:
    """Local shape and pieces of the rank at ``coordinate`` of a DTensor.

    ``order`` is the order the mesh dims apply in (default left to right; a
    ``DTensorSpec.shard_order`` flattened). Raises :class:`LayoutError` naming
    ``name`` for ``Partial`` placements and placements it does not know.
    """
    shape = tuple(int(s) for s in global_shape)
    if not len(mesh_shape) == len(coordinate) == len(placements):
        raise LayoutError(f"{name}: mesh {list(mesh_shape)}, coordinate {list(coordinate)} and "
                          f"placements {list(placements)} differ in length")
    runs: list[Runs] = [[(0, s)] for s in shape]
    for mesh_dim in range(len(placements)) if order is None else order:
        _apply(runs, placements[mesh_dim], int(mesh_shape[mesh_dim]), int(coordinate[mesh_dim]),
               mesh_dim, shape, name)
    local_shape = tuple(sum(n for _, n in r) for r in runs)
    return local_shape, _pieces(runs, local_shape)


def _apply(runs: list[Runs], placement, parts: int, index: int, mesh_dim: int,
           shape: tuple[int, ...], name: str) -> None:
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

    if isinstance(placement, Replicate):
        return
    if isinstance(placement, Partial):
        raise LayoutError(
            f"{name}: placement {placement!r} on mesh dim {mesh_dim} is Partial: its ranks hold "
            "unreduced partial values, and a refit copies values, it cannot reduce them; "
            "redistribute it to Replicate() or Shard() first"
        )
    if not isinstance(placement, (Shard, _StridedShard)):  # _StridedShard is no Shard subclass
        raise LayoutError(f"{name}: unsupported placement {placement!r} on mesh dim {mesh_dim}")
    dim = placement.dim + len(shape) if placement.dim < 0 else placement.dim
    if not 0 <= dim < len(shape):
        raise LayoutError(f"{name}: placement {placement} shards dim {dim} of a "
                          f"{len(shape)}-dim tensor")
    if isinstance(placement, _StridedShard):
        sf = int(placement.split_factor)
        runs[dim] = [r for j in range(sf) for r in _chunk(_chunk(runs[dim], sf, j), parts, index)]
    else:
        runs[dim] = _chunk(runs[dim], parts, index)


def _chunk(runs: Runs, parts: int, index: int) -> Runs:
    """Chunk ``index`` of ``parts`` of the sequence ``runs`` describes, as ``torch.chunk``
    cuts (``ceil(n / parts)`` per chunk; trailing chunks short or empty)."""
    total = sum(n for _, n in runs)
    size = -(-total // parts)
    start = min(index * size, total)
    return _take(runs, start, min(start + size, total))


def _take(runs: Runs, start: int, stop: int) -> Runs:
    """Positions ``[start, stop)`` of the sequence ``runs`` describes."""
    out, pos = [], 0
    for g, n in runs:
        lo, hi = max(start, pos), min(stop, pos + n)
        if lo < hi:
            out.append((g + lo - pos, hi - lo))
        pos += n
    return out


def _pieces(runs: list[Runs], local_shape: tuple[int, ...]) -> tuple[Piece, ...]:
    ndim = len(local_shape)
    if 0 in local_shape:  # holds nothing: one empty piece keeps the tensor described
        return (Piece(Box((0,) * ndim, local_shape), (0,) * ndim),)
    per_dim = []  # per dim: (local start, global start, length)
    for r in runs:
        blocks, local = [], 0
        for g, n in r:
            blocks.append((local, g, n))
            local += n
        per_dim.append(merge_adjacent(blocks))  # runs that follow globally: one piece
    return tuple(
        Piece(Box(tuple(b[1] for b in combo), tuple(b[2] for b in combo)),
              tuple(b[0] for b in combo))
        for combo in itertools.product(*per_dim)
    )
