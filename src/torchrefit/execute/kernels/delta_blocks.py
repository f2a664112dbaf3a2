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

Runs on CUDA tensors, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
the tests).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["available", "TILE", "CLASSES", "Diffed", "diff_parts", "gather_part", "apply_part", "fusable_cast"]

#: elements one diff program compares; the wire format's block is a whole number of tiles
TILE = 4096
#: changes one gather or apply program moves per step
CHUNK = 1024
#: element sizes, one scratch (positions, values) and one reservation counter each
CLASSES = (1, 2, 4, 8)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def diff_tiles(cur, ref, numel, counts, starts, pos_out, val_out, total, slot, limit,
                   TILE: tl.constexpr, CAST: tl.constexpr, WIRE: tl.constexpr, BF16_RNE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = t * TILE + tl.arange(0, TILE)
        inside = offs < numel
        b = tl.load(ref + offs, mask=inside, other=0)
        a = tl.load(cur + offs, mask=inside, other=0)
        if BF16_RNE:  # the interpreter: bfloat16 rounded to nearest even in integers, as torch on CPU
            u = a.to(tl.float32).to(tl.uint32, bitcast=True)
            r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
            a = r.to(tl.uint16).to(tl.int16, bitcast=True)
        elif CAST:  # the wire dtype's bits of the cast: the device's cast instruction, as torch's
            a = a.to(WIRE).to(b.dtype, bitcast=True)
        changed = (a != b) & inside
        n = tl.sum(changed.to(tl.int32), axis=0)
        tl.store(ref + offs, a, mask=changed)
        tl.store(counts + t, n)
        if n > 0:
            cap = tl.load(limit)
            start = tl.atomic_add(total + slot, n.to(tl.int64))  # room in this element size's scratch
            tl.store(starts + t, start)
            if start + n <= cap:
                at = start + tl.cumsum(changed.to(tl.int32), axis=0) - 1
                tl.store(pos_out + at, (offs & 0xFFFF).to(tl.int16), mask=changed)
                tl.store(val_out + at, a, mask=changed)

    @triton.jit
    def gather_tiles(counts, starts, prefix, pos_in, val_in, pos_out, val_out, CHUNK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        n = tl.load(counts + t)
        if n > 0:
            src = tl.load(starts + t)
            dst = tl.load(prefix + t)
            i = tl.arange(0, CHUNK)
            j = n * 0
            while j < n:  # while, not range(): the interpreter takes no loaded bound
                k = j + i
                m = k < n
                tl.store(pos_out + dst + k, tl.load(pos_in + src + k, mask=m), mask=m)
                tl.store(val_out + dst + k, tl.load(val_in + src + k, mask=m), mask=m)
                j += CHUNK

    @triton.jit
    def apply_blocks(counts, prefix, pos_in, val_in, dst, CHUNK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        n = tl.load(counts + b)
        if n > 0:
            at = tl.load(prefix + b)
            i = tl.arange(0, CHUNK)
            j = n * 0
            while j < n:
                k = j + i
                m = k < n
                low = tl.load(pos_in + at + k, mask=m, other=0).to(tl.int32) & 0xFFFF
                v = tl.load(val_in + at + k, mask=m)
                tl.store(dst + (b * 65536 + low), v, mask=m)
                j += CHUNK

    return diff_tiles, gather_tiles, apply_blocks


def available(device_type: str) -> bool:
    """Whether the kernels run on this device type: CUDA with Triton, or any device under
    Triton's interpreter (``TRITON_INTERPRET=1``, tests)."""
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        _kernels()
    except Exception:  # no triton
        return False
    return True


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


@dataclass
class Diffed:
    """What one message's diff left on the device: per part, its tiles' counts and
    scratch starts; per element size, the scratch; ``totals``: reservations per element
    size (``CLASSES``), then the changed count of each part."""

    counts: list[torch.Tensor]
    starts: list[torch.Tensor]
    scratch: dict[int, tuple[torch.Tensor, torch.Tensor]]
    totals: torch.Tensor
    cap: int


def diff_parts(currents: list[torch.Tensor], refs: list[torch.Tensor], wires: list[torch.dtype], cap: int,
               kept, limit: torch.Tensor | None = None) -> Diffed:
    """Diff each part (``currents[i]``, contiguous, in its local dtype; ``refs[i]`` its
    reference bytes as a contiguous tensor of the wire dtype) on the current stream,
    bringing the references up to date. ``cap``: the most changes the scratch keeps
    (more: the message goes dense); ``limit``: where given, an int64 on the device read
    in place of ``cap`` (-1: the caller knows the message goes dense, nothing need be
    kept). ``kept(name, numel, dtype)``: a buffer kept across calls. Nothing is copied
    to the host."""
    diff, _, _ = _kernels()
    sizes = sorted({w.itemsize for w in wires})
    totals = kept("totals", len(CLASSES) + len(refs), torch.int64)
    totals.zero_()
    room = max(cap, 0) + 1
    scratch = {s: (kept(("pos", s), room, torch.int16), kept(("val", s), room, _INT[s])) for s in sizes}
    if limit is None:
        limit = kept("limit", 1, torch.int64).fill_(cap)
    counts, starts = [], []
    for i, (cur, ref, wire) in enumerate(zip(currents, refs, wires)):
        tiles = -(-ref.numel() // TILE)
        per_block = 65536 // TILE
        padded = -(-tiles // per_block) * per_block
        c = kept(("counts", i), padded, torch.int32)
        if padded > tiles:
            c[tiles:].zero_()
        s = kept(("starts", i), tiles, torch.int64)
        counts.append(c)
        starts.append(s)
        if not tiles:
            continue
        cast = cur.dtype != wire
        # the interpreter's float32 -> bfloat16 conversion truncates; a GPU's rounds as torch's
        rne = cast and wire == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
        pos, val = scratch[wire.itemsize]
        b = _bits(ref.reshape(-1))
        with _on_device(b):
            diff[(tiles,)](cur.reshape(-1) if cast else _bits(cur.reshape(-1)), b, ref.numel(), c, s, pos, val,
                           totals, CLASSES.index(wire.itemsize), limit, TILE=TILE, CAST=cast,
                           WIRE=_tl_dtype(wire) if cast else None, BF16_RNE=rne, num_warps=8)
        # each part's changed count: a sum of its tiles' (no atomic per tile on one slot)
        torch.sum(c, 0, dtype=torch.int64, out=totals[len(CLASSES) + i])
    return Diffed(counts, starts, scratch, totals, cap)


def gather_part(d: Diffed, i: int, numel: int, wire: torch.dtype, k: int, out: torch.Tensor, kept) -> None:
    """Part ``i``'s sparse encoding (``k`` changes, ``numel`` elements) into ``out``
    (uint8, its bytes in the wire format: block counts, positions, values)."""
    _, gather, _ = _kernels()
    from ..delta import BLOCK, _align
    blocks = -(-numel // BLOCK)
    tiles = -(-numel // TILE)
    c = d.counts[i]
    c0 = _align(4 * blocks)
    torch.sum(c.view(blocks, BLOCK // TILE), 1, dtype=torch.int32, out=out[: 4 * blocks].view(torch.int32))
    prefix = kept(("prefix",), tiles, torch.int64)
    torch.cumsum(c[:tiles], 0, out=prefix)
    prefix.sub_(c[:tiles])
    pos, val = d.scratch[wire.itemsize]
    v0 = c0 + _align(2 * k)
    with _on_device(out):
        gather[(tiles,)](c, d.starts[i], prefix, pos, val, out[c0: c0 + 2 * k].view(torch.int16),
                         out[v0: v0 + k * wire.itemsize].view(_INT[wire.itemsize]), CHUNK=CHUNK, num_warps=4)


def apply_part(payload: torch.Tensor, at: int, view: torch.Tensor, k: int, kept) -> None:
    """One part's sparse encoding at byte ``at`` of ``payload`` (on ``view``'s device)
    written into ``view`` (contiguous, in the wire dtype), on the current stream."""
    _, _, apply = _kernels()
    from ..delta import BLOCK, _align
    numel, size = view.numel(), view.element_size()
    blocks = -(-numel // BLOCK)
    c0 = _align(4 * blocks)
    counts = payload[at: at + 4 * blocks].view(torch.int32)
    prefix = kept(("aprefix",), blocks, torch.int64)
    torch.cumsum(counts, 0, out=prefix)
    prefix.sub_(counts)
    v0 = at + c0 + _align(2 * k)
    with _on_device(view):
        apply[(blocks,)](counts, prefix, payload[at + c0: at + c0 + 2 * k].view(torch.int16),
                         payload[v0: v0 + k * size].view(_INT[size]), _bits(view.reshape(-1)), CHUNK=CHUNK,
                         num_warps=4)
