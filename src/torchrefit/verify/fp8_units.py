"""FP8 destinations in ``verify()``'s witness: blocks quantized by one source rank.

An FP8 target (``transforms.fp8``) holds the block quantization of its source, not the
source's values, so the witness cannot compare sums of the source's bytes. Instead the
source side quantizes again, from its own current values: a *unit* is a block-aligned
box of the target (a destination cell, or one block of it) whose every element one
source rank holds; the lowest such rank assembles it in float32, quantizes it by the
convention (``quantize_blocks``, ``quantize_tensor`` for per-tensor scales) and sums the
FP8 bytes at the unit's place in the target and the scales at its cells in the scale
tensor, each weighted by the destination ranks holding it. The destination side sums
the same boxes of what it holds. Nothing here reads the plan's transfers or where the
refit quantized.

Not checked by the witness: a block whose elements no single source rank holds (a
source TP cut through a block; a per-tensor target sharded on the source). Such blocks
are counted (:attr:`FP8Units.unchecked`) and ``Refitter.verify`` compares them through
the plan instead (the same exchange as a refit, into scratch), and says so.

Who calls it: ``Witness`` on every rank (pure planning, :func:`plan_units`), and its
owners while summing (:func:`quantize_unit`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..layout._types import Box, ModelLayout
from ..maps import relocate
from ..plan.planner import Planner
from ..transforms.fp8 import quantize_blocks, quantize_tensor, scale_cells

__all__ = ["Unit", "plan_units", "quantize_unit"]


@dataclass(frozen=True, slots=True)
class Unit:
    """``box`` of FP8 target ``name`` (destination cell ``cell``, held by ``dst_ranks``),
    quantized by source rank ``owner`` from ``parts`` (target sub-box, source tensor,
    source box); its scales are ``scale_box`` of ``scale`` (cell ``scale_cell``)."""

    name: str
    box: Box
    cell: int
    dst_ranks: tuple[int, ...]
    owner: int
    parts: tuple[tuple[Box, str, Box], ...]
    scale: str
    scale_box: Box
    scale_cell: int
    per_tensor: bool


def plan_units(planner: Planner, name: str, dst_cells, scale_cells_list) -> tuple[list[Unit], int]:
    """The units of FP8 target ``name`` and how many of its blocks no unit covers.
    ``dst_cells`` / ``scale_cells_list``: the witness's cells of the target and its scale."""
    target = planner.fp8[name]
    info = planner.dst.tensors[name]
    units: list[Unit] = []
    unchecked = 0
    for j, (cell, dranks) in enumerate(dst_cells):
        held = next(b for b in info.boxes if b.contains(cell))
        parts = _parts(planner, name, held, cell)
        owner = _common_owner(parts)
        if owner is not None:
            units.append(_unit(planner, target, cell, j, dranks, owner, parts, scale_cells_list))
            continue
        if target.per_tensor:
            unchecked += 1
            continue
        for block in _blocks(cell, info.shape, planner.fp8_block):
            bparts = [(b, n, relocate(b, sub.offset, sbox.offset), ranks) for sub, n, sbox, ranks in parts
                      if (b := sub.intersect(block)) is not None]
            owner = _common_owner(bparts)
            if owner is None:
                unchecked += 1
            else:
                units.append(_unit(planner, target, block, j, dranks, owner, bparts, scale_cells_list))
    return units, unchecked


def _parts(planner: Planner, name: str, held: Box, cell: Box) -> list:
    out = []
    for reg in planner.regions(name, held):
        sub = reg.dst_box.intersect(cell)
        if sub is not None:
            sbox = relocate(sub, reg.dst_box.offset, reg.src_box.offset)
            out.append((sub, reg.src_name, sbox, frozenset(planner.src.ranks(reg.holders))))
    return out


def _common_owner(parts) -> int | None:
    """The lowest source rank holding every part, or None."""
    if not parts:
        return None
    common = frozenset.intersection(*(p[3] for p in parts))
    return min(common) if common else None


def _unit(planner: Planner, target, box: Box, cell: int, dranks, owner: int, parts, scale_cells_list) -> Unit:
    sinfo = planner.dst.tensors[target.scale]
    sbox = Box.whole(sinfo.shape) if target.per_tensor else scale_cells(box, planner.fp8_block)
    scell = next(k for k, (c, _) in enumerate(scale_cells_list) if (c.contains(sbox) if c.ndim else True))
    return Unit(target.name, box, cell, tuple(dranks), owner, tuple(p[:3] for p in parts), target.scale,
                sbox, scell, target.per_tensor)


def _blocks(cell: Box, shape, block: tuple[int, int]) -> list[Box]:
    """The blocks of a block-aligned cell (blocks over the last two dims, leading dims whole)."""
    lead = cell.ndim - 2
    spans = []
    for d, k in ((lead, block[0]), (lead + 1, block[1])):
        lo, hi = cell.offset[d], cell.end[d]
        spans.append([(a, min(a + k, hi) - a) for a in range(lo, hi, k)])
    return [Box(cell.offset[:lead] + (r0, c0), cell.size[:lead] + (rs, cs))
            for (r0, rs), (c0, cs) in itertools.product(*spans)]


def quantize_unit(unit: Unit, src: ModelLayout, tables: Mapping[str, torch.Tensor],
                  block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values of ``unit.box``, its scales shaped ``unit.scale_box``) from this rank's
    source tensors: the owner's side of the witness."""
    x = None
    zero = (0,) * unit.box.ndim
    for sub, src_name, sbox in unit.parts:
        key, piece = _holding(src, src_name, sbox)
        local = sbox.moved(piece.box.offset, piece.local_offset)
        values = tables[key].detach()[local.slices()].reshape(sub.size)
        if x is None:
            x = torch.zeros(unit.box.size, dtype=torch.float32, device=values.device)
        x[sub.moved(unit.box.offset, zero).slices()] = values.to(torch.float32)
    assert x is not None
    q, s = quantize_tensor(x) if unit.per_tensor else quantize_blocks(x, block)
    return q, s.reshape(unit.scale_box.size)


def _holding(src: ModelLayout, name: str, box: Box):
    for key, t in src:
        if t.name == name:
            for piece in t.pieces:
                if piece.box.contains(box):
                    return key, piece
    raise AssertionError(f"{name}{box}: the unit's owner holds no piece of it")
