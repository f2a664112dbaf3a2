"""The witness's sums in a few kernel launches (``execute.kernels.region_checksums``), tables built once.

``Witness.sums`` on CUDA (or under Triton's interpreter) goes through :class:`FusedSums`:
every term that is a strided view of a model tensor is read in place; a term that needs
a copy (a cast to the destination's dtype, a reshape that is no view, a strided last
dim) is copied into scratch first, in batches of at most ``SCRATCH_BYTES``. Tables of
segments, row and column weights are built on the first call and kept; they are
rebuilt only when a tensor's address or strides change (the signature checked on
every call), so a verify costs the launches, one ``index_add_`` and the copies.

Who calls it: ``Witness.sums`` on every rank, once per ``verify()``; the collective
comes after (``verify.compare``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..execute.kernels.region_checksums import NARROW, launch
from .checksum import MOD
from .segments import FIELDS, Region, aligned, as_int32, col_weights, row_weights, segment_rows

__all__ = ["FusedSums", "Item", "SCRATCH_BYTES", "TARGET_WORDS"]

#: words one program sums (about 256 KiB of bf16): enough to hide its start, small
#: enough to spread a tensor over every multiprocessor
TARGET_WORDS = 1 << 17
#: bytes of scratch for terms that need a copy, per batch (a larger single term gets its own)
SCRATCH_BYTES = 256 << 20
_ALIGN = 16  # bytes: where a scratch copy starts, so its segments can be vector loaded


@dataclass(frozen=True, slots=True)
class Item:
    """One term to sum: ``box`` (slices) of tensor ``key`` in mapping ``side``, read as
    ``dtype`` with shape ``size`` at global ``offset``, times ``weight``, into ``slot``."""

    side: str
    key: str
    slices: tuple[slice, ...]
    size: tuple[int, ...]
    offset: tuple[int, ...]
    dtype: torch.dtype
    weight: int
    slot: int


def _view(item: Item, tables: Mapping[str, Mapping[str, torch.Tensor]]) -> tuple[torch.Tensor, bool]:
    """The term's values and whether they must be copied (cast, or not a strided view
    with a dense last dim)."""
    x = tables[item.side][item.key].detach()
    x = x[item.slices] if item.slices else x
    if tuple(x.shape) != item.size:
        try:
            x = x.view(item.size)
        except RuntimeError:
            return x, True
    copy = x.dtype != item.dtype or (x.dim() > 0 and x.stride(-1) != 1 and x.shape[-1] > 1)
    return x, copy


def _region(x: torch.Tensor, item: Item, address: int) -> Region:
    """``x`` (``item.size``, ``item.dtype``) at word ``address`` as a :class:`Region`."""
    size = x.element_size()
    word = 1 if size == 1 else 2
    per = size // word
    shape = item.size or (1,)
    offset = item.offset or (0,)
    strides = tuple(s * per for s in x.stride()[:-1]) if x.dim() > 1 else ()
    return Region(address, shape[:-1] + (shape[-1] * per,), strides,
                  offset[:-1] + (offset[-1] * per,), item.weight, item.slot, word)


class _Launch:
    """Segments of one word size and tile, with their weight tables, on the device."""

    def __init__(self, rows: list[tuple[int, ...]], roww: torch.Tensor, colw: torch.Tensor, word: int,
                 tile: str, device: torch.device) -> None:
        self.vector = all(aligned(r, word) for r in rows)
        self.table = torch.tensor(rows, dtype=torch.int64).reshape(-1, FIELDS).to(device)
        self.slots = self.table[:, FIELDS - 1].contiguous()
        self.roww, self.colw = roww.to(device), colw.to(device)
        self.word, self.tile = word, tile

    def add(self, out: torch.Tensor, base: torch.Tensor, base_word: int) -> None:
        part = launch(base, base_word, self.table, self.roww, self.colw, self.word, self.tile, self.vector)
        out.index_add_(0, self.slots, part.to(torch.int64).bitwise_and_(MOD - 1))


def _launches(regions: list[Region], device: torch.device) -> list[_Launch]:
    """Group regions by (word size, tile, alignment) and plan each group's segments."""
    groups: dict[tuple, tuple[list, list, list]] = {}
    for region in regions:
        tile = "narrow" if region.width < NARROW else "wide"
        segs = segment_rows(region, 0, 0, TARGET_WORDS)
        vec = all(aligned(r, region.word) for r in segs)
        rows, rws, cws = groups.setdefault((region.word, tile, vec), ([], [], []))
        rb, cb = sum(len(w) for w in rws), sum(len(w) for w in cws)
        rows.extend(r[:3] + (r[3] + rb, r[4] + cb) + r[5:] for r in segs)
        rws.append(row_weights(region))
        cols = col_weights(region)
        pad = -len(cols) % _ALIGN  # every region's column weights start 16-word aligned
        cws.append(torch.cat([cols, cols.new_zeros(pad)]) if pad else cols)
    out = []
    for (word, tile, _), (rows, rws, cws) in groups.items():
        if rows:
            out.append(_Launch(rows, as_int32(torch.cat(rws)), as_int32(torch.cat(cws)), word, tile, device))
    return out


class FusedSums:
    """Sums of a fixed list of items (built on every rank by ``Witness``)."""

    def __init__(self, items: list[Item], slots: int) -> None:
        self.items = items
        self.slots = slots
        self._signature: tuple | None = None
        self._static: list[_Launch] = []
        self._anchor: torch.Tensor | None = None
        self._batches: list[tuple[list[tuple[Item, int]], int, list[_Launch]]] = []

    def _key(self, tables) -> tuple:
        return tuple((t.data_ptr(), t.stride()) for t in (tables[i.side][i.key] for i in self.items))

    def sums(self, tables: Mapping[str, Mapping[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
        """int64 ``[slots]`` in ``[0, 2**32)`` on ``device``: per slot, the sum of its items."""
        key = self._key(tables)
        if key != self._signature:
            self._build(tables, device)
            self._signature = key
        out = torch.zeros(self.slots, dtype=torch.int64, device=device)
        for group in self._static:
            base = self._anchor if group.word == 2 else self._anchor.view(torch.uint8)
            group.add(out, base, 0)
        for members, nbytes, groups in self._batches:
            scratch = self._fill(members, nbytes, tables, device)
            for group in groups:
                group.add(out, scratch.view(torch.int16) if group.word == 2 else scratch, 0)
        return out.bitwise_and_(MOD - 1)

    def _fill(self, members, nbytes: int, tables, device: torch.device) -> torch.Tensor:
        scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for item, at in members:
            x, _ = _view(item, tables)
            n = x.numel() * item.dtype.itemsize
            scratch[at:at + n].view(item.dtype).view(item.size).copy_(x.reshape(item.size))
        return scratch

    def _build(self, tables, device: torch.device) -> None:
        """Plan every launch: in-place items against an anchor (word addresses relative to
        it, 16-byte aligned), copied items against their scratch batch."""
        self._anchor = torch.zeros(8, dtype=torch.int16, device=device)
        anchor = self._anchor.data_ptr()
        static, pending = [], []
        for item in self.items:
            x, copy = _view(item, tables)
            if x.numel() == 0:
                continue
            if copy:
                pending.append(item)
                continue
            word = 1 if x.element_size() == 1 else 2
            static.append(_region(x, item, (x.data_ptr() - anchor) // word))
        self._static = _launches(static, device)
        self._batches = [self._batch(members, device) for members in _batched(pending)]

    def _batch(self, members: list[Item], device: torch.device):
        at, placed, regions = 0, [], []
        for item in members:
            nbytes = _numel(item.size) * item.dtype.itemsize
            dense = torch.empty_strided(item.size, _dense_strides(item.size), dtype=item.dtype, device="meta")
            word = 1 if item.dtype.itemsize == 1 else 2
            regions.append(_region(dense, item, at // word))
            placed.append((item, at))
            at += -(-nbytes // _ALIGN) * _ALIGN
        return placed, max(at, _ALIGN), _launches(regions, device)


def _numel(size: tuple[int, ...]) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def _dense_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    out, n = [], 1
    for s in reversed(size):
        out.append(n)
        n *= max(s, 1)
    return tuple(reversed(out))


def _batched(items: list[Item]) -> list[list[Item]]:
    """Items in batches of at most ``SCRATCH_BYTES`` (a larger single item alone)."""
    out: list[list[Item]] = []
    used = SCRATCH_BYTES
    for item in items:
        n = _numel(item.size) * item.dtype.itemsize
        if not n:
            continue
        if used + n > SCRATCH_BYTES:
            out.append([])
            used = 0
        out[-1].append(item)
        used += n
    return out
