"""Delta refits' diff, encode and apply on the device (Triton), in the wire format of
``execute.delta`` (the torch ops and the native CPU kernels write the same bytes).

The diff reads the source and its reference once: one program per tile of ``TILE``
elements (a block of the wire format holds ``BLOCK // TILE`` tiles) compares the bits
(integer views; a cast on the sender is done in the program and the wire dtype's bits
compared), writes the reference only where it changed, and where any changed, reserves
room in a scratch buffer of its element size with one atomic add and writes its
changes' 16-bit positions and values there, compacted by a prefix sum of its mask.
Reservations past the scratch's capacity (the message's ``delta_dense_above`` share of
elements) are counted but not written: the message then goes dense, and its reference
is already the source's bytes. The counts reach the host in one small copy per
message; then, per changed part, its block counts (a sum of its tiles' counts), the
prefix of its tiles' counts and one gather program per tile move the scratch into the
sparse payload, in position order: the changes are a small share of the bytes, so that
second pass costs little next to the one over the full bytes.

The apply is one program per block of a part: it reads the block's count and where its
changes start (a prefix of the payload's block counts) and writes each value at its
position.

Parts of at most one block (``SMALL``: biases, norms, small projections) are diffed,
gathered and applied together, one launch per kind (element size, and the cast) for all
of a message's: a table of addresses (uploaded without waiting) says where each part's
source, reference, payload sections and destination lie. Large
parts get a launch each, on their own typed pointers.

Runs on CUDA tensors, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
the tests).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..delta_wire import BLOCK, align
from . import triton_runs

__all__ = ["available", "TILE", "PER", "SMALL", "CLASSES", "Diffed", "diff_parts", "gather", "apply", "fusable_cast"]

#: elements one diff program compares; the wire format's block is a whole number of tiles.
#: With DIFF_WARPS and CHUNK, the fastest at 1% and 5% changed of seven shapes timed end
#: to end on an H100 (BENCHMARKS.md, "Delta refits: diff, encode and apply"): 21% less
#: time than 4096 elements with CHUNK 1024 at 1% changed
TILE = 2048
#: warps of one diff program
DIFF_WARPS = 8
#: changes one gather or apply program moves per step (at 1% changed a tile holds about
#: 20 and a block about 650: wider steps are mostly masked-off lanes)
CHUNK = 256
#: element sizes, one scratch (positions, values) and one reservation counter each
CLASSES = (1, 2, 4, 8)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@lru_cache(maxsize=1)
def _kernels():
    from . import _delta_blocks_triton as k
    return k.diff_tiles, k.gather_tiles, k.apply_blocks, k.diff_small, k.gather_small, k.apply_small


def available(device_type: str) -> bool:
    """Whether the kernels run on this device type: CUDA with Triton, or any device under
    Triton's interpreter (``TRITON_INTERPRET=1``, tests)."""
    return triton_runs(device_type, _kernels)


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def fusable_cast(local: torch.dtype, wire: torch.dtype) -> bool:
    """Whether the diff casts ``local`` to ``wire`` itself (float to float of 16 or 32
    bits: the conversion the device's cast instruction makes, as torch's)."""
    return local == wire or (local in _FLOATS and wire in _FLOATS)


def _on_device(t: torch.Tensor):
    """Triton launches on the current device: make it the tensors' own."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


def _table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """A small int64 table on ``device``, copied from pinned memory without waiting (the
    host allocator keeps the pinned block until the copy ran)."""
    host = torch.tensor(rows, dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _tl_int(size: int):
    import triton.language as tl
    return {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}[size]


#: tiles per block: a part of one block at most has PER tiles in the grouped launches
PER = BLOCK // TILE


@contextlib.contextmanager
def shaped(tile: int, warps: int, chunk: int):
    """The kernels in another shape inside the block (``TILE``, its ``PER``,
    ``DIFF_WARPS``, ``CHUNK``; benchmarks: Triton compiles each shape at its first launch)."""
    global TILE, PER, DIFF_WARPS, CHUNK
    if not (0 < tile <= BLOCK and BLOCK % tile == 0 and tile & (tile - 1) == 0):
        raise ValueError(f"delta kernels: TILE must be a power of two dividing the block's {BLOCK} elements, "
                         f"not {tile}")
    if warps < 1 or chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"delta kernels: warps must be >= 1 and CHUNK a power of two, not {warps} and {chunk}")
    kept = TILE, PER, DIFF_WARPS, CHUNK
    TILE, PER, DIFF_WARPS, CHUNK = tile, BLOCK // tile, warps, chunk
    try:
        yield
    finally:
        TILE, PER, DIFF_WARPS, CHUNK = kept


@dataclass(frozen=True)
class _Group:
    """Parts of at most one block (``SMALL``) diffed in one launch: their indices, and
    PER tiles' counts and scratch starts each."""

    parts: tuple[int, ...]
    size: int
    counts: torch.Tensor
    starts: torch.Tensor


@dataclass
class Diffed:
    """What one message's diff left on the device: per large part its tiles' counts and
    scratch starts, the small parts' groups; per element size, the scratch; ``totals``:
    reservations per element size (``CLASSES``), then the changed count of each part."""

    tiles: dict[int, tuple[torch.Tensor, torch.Tensor]]
    groups: list[_Group]
    scratch: dict[int, tuple[torch.Tensor, torch.Tensor]]
    totals: torch.Tensor
    cap: int


#: a part of at most this many elements (one block) is diffed, gathered and applied with
#: others of its kind in one launch (a launch per small tensor would cost more than its bytes)
SMALL = 65536


def diff_parts(currents: list[torch.Tensor], refs: list[torch.Tensor], wires: list[torch.dtype], cap: int,
               kept) -> Diffed:
    """Diff each part (``currents[i]``, contiguous, in its local dtype; ``refs[i]`` its
    reference bytes as a contiguous tensor of the wire dtype) on the current stream,
    bringing the references up to date: one launch per large part, one per kind of small
    parts. ``cap``: the most changes the scratch keeps (more: the message goes dense).
    ``kept(name, numel, dtype)``: a buffer kept across calls. Nothing is copied to the host."""
    diff, _, _, small_diff, _, _ = _kernels()
    sizes = sorted({w.itemsize for w in wires})
    totals = kept("totals", len(CLASSES) + len(refs), torch.int64)
    totals.zero_()
    room = max(cap, 0) + 1
    scratch = {s: (kept(("pos", s), room, torch.int16), kept(("val", s), room, _INT[s])) for s in sizes}
    limit = kept("limit", 1, torch.int64).fill_(cap)  # the kernels read it on the device
    tiles_of, kinds = {}, {}
    for i, (cur, ref, wire) in enumerate(zip(currents, refs, wires)):
        if ref.numel() <= SMALL:
            if ref.numel():
                kinds.setdefault((cur.dtype if cur.dtype != wire else None, wire), []).append(i)
            continue
        tiles = -(-ref.numel() // TILE)
        padded = -(-tiles // PER) * PER
        c = kept(("counts", i), padded, torch.int32)
        if padded > tiles:
            c[tiles:].zero_()
        s = kept(("starts", i), tiles, torch.int64)
        tiles_of[i] = (c, s)
        cast = cur.dtype != wire
        pos, val = scratch[wire.itemsize]
        b = _bits(ref.reshape(-1))
        with _on_device(b):
            diff[(tiles,)](cur.reshape(-1) if cast else _bits(cur.reshape(-1)), b, ref.numel(), c, s, pos, val,
                           totals, CLASSES.index(wire.itemsize), limit, TILE=TILE, CAST=cast,
                           WIRE=_tl_dtype(wire) if cast else None, BF16_RNE=_rne(cast, wire), num_warps=DIFF_WARPS)
        # each part's changed count: a sum of its tiles' (no atomic per tile on one slot)
        torch.sum(c, 0, dtype=torch.int64, out=totals[len(CLASSES) + i])
    groups = []
    for g, ((src_dtype, wire), idx) in enumerate(sorted(kinds.items(), key=lambda kv: kv[1][0])):
        size = wire.itemsize
        ref0 = refs[idx[0]]
        table = _table([[currents[i].data_ptr(), refs[i].data_ptr(), refs[i].numel()] for i in idx], ref0.device)
        c = kept(("small counts", g), PER * len(idx), torch.int32)
        s = kept(("small starts", g), PER * len(idx), torch.int64)
        pos, val = scratch[size]
        cast = src_dtype is not None
        with _on_device(ref0):
            small_diff[(PER * len(idx),)](table, c, s, pos, val, totals, CLASSES.index(size), limit,
                                          SRC=_tl_dtype(src_dtype) if cast else _tl_int(size), ELEM=_tl_int(size),
                                          TILE=TILE, PER=PER, CAST=cast, WIRE=_tl_dtype(wire) if cast else None,
                                          BF16_RNE=_rne(cast, wire), num_warps=DIFF_WARPS)
        where = _table([[len(CLASSES) + i] for i in idx], ref0.device).view(-1)
        totals.index_copy_(0, where, c.view(len(idx), PER).sum(1, dtype=torch.int64))
        groups.append(_Group(tuple(idx), size, c, s))
    return Diffed(tiles_of, groups, scratch, totals, cap)


def _rne(cast: bool, wire: torch.dtype) -> bool:
    """The interpreter's float32 -> bfloat16 conversion truncates; a GPU's rounds as torch's."""
    return cast and wire == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def gather(d: Diffed, parts: list[tuple[int, torch.dtype, int, int]], out: torch.Tensor, kept) -> None:
    """Every changed part's sparse encoding into the payload ``out`` (uint8): ``parts[i]``
    is part i's (elements, wire dtype, changes, byte offset of its encoding in ``out``)."""
    _, gather_big, _, _, gather_few, _ = _kernels()
    for i, (c, s) in d.tiles.items():
        numel, wire, k, at = parts[i]
        if k:
            _gather_part(gather_big, c, s, d.scratch[wire.itemsize], numel, wire, k, out[at:], kept)
    for g in d.groups:
        rows, base = [], out.data_ptr()
        for i in g.parts:
            numel, wire, k, at = parts[i]
            c0 = at + align(4 * -(-numel // BLOCK))
            rows.append([base + at, base + c0, base + c0 + align(2 * k)] if k else [0, 0, 0])
        if not any(r[0] for r in rows):
            continue
        pos, val = d.scratch[g.size]
        with _on_device(out):
            gather_few[(PER * len(g.parts),)](g.counts, g.starts, _table(rows, out.device), pos, val,
                                              ELEM=_tl_int(g.size), PER=PER, CHUNK=CHUNK, num_warps=4)


def _gather_part(kernel, c: torch.Tensor, starts: torch.Tensor, scratch, numel: int, wire: torch.dtype, k: int,
                 out: torch.Tensor, kept) -> None:
    """A large part's encoding (``k`` changes) at the start of ``out``: block counts, the
    prefix of its tiles' counts, one program per tile."""
    blocks = -(-numel // BLOCK)
    tiles = -(-numel // TILE)
    c0 = align(4 * blocks)
    torch.sum(c.view(blocks, BLOCK // TILE), 1, dtype=torch.int32, out=out[: 4 * blocks].view(torch.int32))
    prefix = kept(("prefix",), tiles, torch.int64)
    torch.cumsum(c[:tiles], 0, out=prefix)
    prefix.sub_(c[:tiles])
    pos, val = scratch
    v0 = c0 + align(2 * k)
    with _on_device(out):
        kernel[(tiles,)](c, starts, prefix, pos, val, out[c0: c0 + 2 * k].view(torch.int16),
                         out[v0: v0 + k * wire.itemsize].view(_INT[wire.itemsize]), CHUNK=CHUNK, num_warps=4)


def apply(payload: torch.Tensor, parts: list[tuple[int, torch.Tensor, int]], kept) -> None:
    """Sparse encodings in ``payload`` (on the views' device) written into their views,
    on the current stream: ``parts`` holds (byte offset of the encoding, view: contiguous,
    in the wire dtype, changes). A launch per large part, one per element size of the
    small ones."""
    _, _, apply_big, _, _, apply_few = _kernels()
    few: dict[int, list[tuple[int, torch.Tensor, int]]] = {}
    for at, view, k in parts:
        if view.numel() <= SMALL:
            few.setdefault(view.element_size(), []).append((at, view, k))
        else:
            _apply_part(apply_big, payload, at, view, k, kept)
    base = payload.data_ptr()
    for size, items in sorted(few.items()):
        rows = []
        for at, view, k in items:
            c0 = at + align(4 * -(-view.numel() // BLOCK))
            rows.append([base + at, base + c0, base + c0 + align(2 * k), view.data_ptr()])
        with _on_device(payload):
            apply_few[(len(items),)](_table(rows, payload.device), ELEM=_tl_int(size), CHUNK=CHUNK, num_warps=4)


def _apply_part(kernel, payload: torch.Tensor, at: int, view: torch.Tensor, k: int, kept) -> None:
    """A large part's encoding at byte ``at`` of ``payload`` into ``view``: a program per block."""
    numel, size = view.numel(), view.element_size()
    blocks = -(-numel // BLOCK)
    c0 = align(4 * blocks)
    counts = payload[at: at + 4 * blocks].view(torch.int32)
    prefix = kept(("aprefix",), blocks, torch.int64)
    torch.cumsum(counts, 0, out=prefix)
    prefix.sub_(counts)
    v0 = at + c0 + align(2 * k)
    with _on_device(view):
        kernel[(blocks,)](counts, prefix, payload[at + c0: at + c0 + 2 * k].view(torch.int16),
                          payload[v0: v0 + k * size].view(_INT[size]), _bits(view.reshape(-1)), CHUNK=CHUNK,
                          num_warps=4)
