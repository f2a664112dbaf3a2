"""Value types that describe where a rank's local tensors sit in global tensors.

A *global tensor* is the full logical tensor with a canonical name. A rank's local
tensor holds one or more *pieces* of it: a box in global coordinates and the
offset at which that box sits inside the local tensor (same extents in both).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import LayoutError

__all__ = ["Box", "Piece", "TensorLayout", "ModelLayout", "dtype_name", "dtype_from_name"]


@dataclass(frozen=True, slots=True)
class Box:
    """An axis-aligned box: ``offset[d] <= i[d] < offset[d] + size[d]`` for every dim."""

    offset: tuple[int, ...]
    size: tuple[int, ...]
    # Boxes key the planner's dicts (10^5 lookups per rank at 16k ranks): hash them once.
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.offset) != len(self.size):
            raise ValueError(f"Box offset {self.offset} and size {self.size} differ in rank")
        # min() rather than any(<genexpr>): planning at 1024 ranks builds ~10^5 boxes.
        if self.offset and (min(self.offset) < 0 or min(self.size) < 0):
            raise ValueError(f"Box offset {self.offset} / size {self.size} must be non-negative")
        object.__setattr__(self, "_hash", hash((self.offset, self.size)))

    def __hash__(self) -> int:
        return self._hash

    @staticmethod
    def whole(shape: Sequence[int]) -> Box:
        return Box((0,) * len(shape), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.size)

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.size))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n

    def intersect(self, other: Box) -> Box | None:
        """The common box, or None where they do not overlap (empty boxes never overlap)."""
        if self.offset == other.offset and self.size == other.size and min(self.size, default=1):
            return self  # the same box (whole tensors on both sides): most of a TP1 -> TP1 plan
        off = []
        size = []
        for a, sa, b, sb in zip(self.offset, self.size, other.offset, other.size):
            lo = a if a > b else b
            hi = min(a + sa, b + sb)
            if hi <= lo:
                return None
            off.append(lo)
            size.append(hi - lo)
        off_t, size_t = tuple(off), tuple(size)
        # One box inside the other (the usual case): no new box to build.
        if off_t == self.offset and size_t == self.size:
            return self
        if off_t == other.offset and size_t == other.size:
            return other
        return Box(off_t, size_t)

    def contains(self, other: Box) -> bool:
        return all(
            a <= b and b + sb <= a + sa
            for a, sa, b, sb in zip(self.offset, self.size, other.offset, other.size)
        )

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(e <= s for e, s in zip(self.end, shape))

    def moved(self, old_origin: Sequence[int], new_origin: Sequence[int]) -> Box:
        """This box translated so that ``old_origin`` lands on ``new_origin``."""
        if old_origin == new_origin:  # a piece at the same place locally (every whole tensor)
            return self
        return Box(
            tuple([o - a + b for o, a, b in zip(self.offset, old_origin, new_origin)]), self.size
        )

    def rows(self, lo: int, hi: int) -> Box:
        """Rows ``lo`` to ``hi`` (along dim 0, relative to this box) of this box."""
        if lo == 0 and (not self.size or hi == self.size[0]):
            return self
        return Box((self.offset[0] + lo,) + self.offset[1:], (hi - lo,) + self.size[1:])

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.size))

    def __str__(self) -> str:
        if not self.size:
            return "[]"
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offset, self.size)) + "]"


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of a global tensor and where it sits inside the local tensor."""

    box: Box
    local_offset: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.local_offset) != self.box.ndim:
            raise ValueError(f"Piece local offset {self.local_offset} does not match {self.box}")

    @property
    def local_box(self) -> Box:
        return Box(self.local_offset, self.box.size)


_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
              "float8_e8m0fnu"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)


_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """The short, picklable name of a dtype (``bfloat16``)."""
    name = _NAMES.get(dtype)  # once per tensor described: a lookup, not str() and a strip
    if name is None:
        name = _NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise LayoutError(f"unsupported dtype {name!r}")
        _DTYPES[name] = dtype
    return dtype


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """One local tensor: the global tensor it belongs to and the pieces it holds.

    ``pieces`` must tile the local tensor exactly (every local element belongs to
    one piece), so that a refit that covers every piece writes every element.
    """

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    is_buffer: bool = False

    def __post_init__(self) -> None:
        if len(self.pieces) == 1 and _whole(self.pieces[0], self.local_shape, self.global_shape):
            return  # held whole (every tensor at TP1, every expert at expert-TP1): tiles trivially
        where = f"{self.name}: local {list(self.local_shape)} of global {list(self.global_shape)}"
        if not self.pieces:
            raise LayoutError(f"{where} has no pieces")
        ndim = len(self.global_shape)
        if len(self.local_shape) != ndim:
            raise LayoutError(f"{where}: local and global tensors differ in number of dims")
        covered = 0
        for p in self.pieces:
            if p.box.ndim != ndim:
                raise LayoutError(f"{where}: piece {p.box} has the wrong number of dims")
            if not p.box.within(self.global_shape):
                raise LayoutError(f"{where}: piece {p.box} lies outside the global tensor")
            if not p.local_box.within(self.local_shape):
                raise LayoutError(
                    f"{where}: piece {p.box} at local offset {list(p.local_offset)} "
                    "lies outside the local tensor"
                )
            covered += p.box.numel
        numel = Box.whole(self.local_shape).numel
        if covered != numel or _any_overlap([p.local_box for p in self.pieces]) or _any_overlap(
            [p.box for p in self.pieces]
        ):
            raise LayoutError(
                f"{where}: pieces {[str(p.box) for p in self.pieces]} do not tile the local "
                f"tensor exactly once ({covered} elements in pieces, {numel} local)"
            )


def _whole(p: Piece, local_shape: tuple[int, ...], global_shape: tuple[int, ...]) -> bool:
    """Whether ``p`` is the whole of a local tensor that is the whole global tensor."""
    return (p.box.size == local_shape == global_shape and not any(p.box.offset)
            and not any(p.local_offset))


def _any_overlap(boxes: list[Box]) -> bool:
    if len(boxes) < 2:
        return False
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if a.intersect(b) is not None:
                return True
    return False


@dataclass(frozen=True)
class ModelLayout:
    """What one rank holds of one model (source or destination).

    ``tensors`` pairs a rank-local key (how the executor finds the tensor, such as a
    parameter's qualified name) with its layout. ``aliases`` names global tensors
    that this model serves from another global tensor, such as a tied output layer
    served from the word embedding: ``(alias, target)``.
    """

    tensors: tuple[tuple[str, TensorLayout], ...]
    aliases: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        keys: set[str] = set()
        for key, t in self.tensors:
            if key in keys:
                raise LayoutError(f"local tensor key {key!r} appears twice")
            keys.add(key)
            if t.name in seen:
                raise LayoutError(
                    f"duplicate name: local tensors {seen[t.name]!r} and {key!r} both claim "
                    f"global tensor {t.name!r} (give each global tensor one local tensor)"
                )
            seen[t.name] = key

    def __iter__(self) -> Iterator[tuple[str, TensorLayout]]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)
