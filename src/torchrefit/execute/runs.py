"""Contiguous-run merging of local copies, decided once when a program is compiled.

A MoE model is thousands of 3-12 MB expert tensors; one device copy of that size
spends more time starting and draining than moving bytes (a 3 MB copy alone reaches
a fifth of a large copy's bandwidth). The caching allocator often puts such
tensors back to back, in the same order on the source and the destination model.
Copies whose destinations *and* sources are back to back, each inside one device
allocation, are then one copy of their bytes.

:func:`merge_runs` is the pure rule (integers in, runs of indices out), so the
CPU suite can test it exhaustively; :func:`allocation_of` says which allocation an
address lies in (the CUDA driver's, or the tensor's own storage where that is not
available); :func:`byte_view` is the merged copy's operand. Called by
``execute.program.Program`` while compiling, on every rank.

With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` the caching allocator
reserves one address range per segment and maps it in 2 or 20 MB pieces, and a tensor
may span two pieces: the driver's mapped range (``cuMemGetAddressRange``) is then one
piece, so the allocation is the reserved range the pieces lie in. A merged copy still
only touches bytes of the live tensors it joins, back to back, all of them mapped.
"""

from __future__ import annotations

import ctypes
from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache

import torch

from .._util.cuda_driver import driver_function

__all__ = ["Span", "merge_runs", "merge_local", "allocation_of", "byte_view"]

Copy = tuple[torch.Tensor, torch.Tensor, str]  # (destination view, source view, name)


@dataclass(frozen=True)
class Span:
    """One dense same-dtype copy as bytes: ``nbytes`` from ``src`` to ``dst``, each
    address inside the allocation that starts at ``dst_alloc`` / ``src_alloc``."""

    dst: int
    src: int
    nbytes: int
    dst_alloc: tuple[int, int]  # (first byte, one past the last) of the allocation
    src_alloc: tuple[int, int]

    def __post_init__(self) -> None:
        if self.nbytes <= 0:
            raise ValueError(f"span of {self.nbytes} bytes")
        for ptr, (lo, hi) in ((self.dst, self.dst_alloc), (self.src, self.src_alloc)):
            if not (lo <= ptr and ptr + self.nbytes <= hi):
                raise ValueError(f"span {ptr:#x}+{self.nbytes} outside its allocation [{lo:#x}, {hi:#x})")


def merge_runs(spans: list[Span]) -> list[list[int]]:
    """Indices of ``spans`` grouped into runs, each run one copy: in destination
    address order, span j joins the run of span i just before it where j starts
    exactly where i ends on *both* sides and both lie in the same allocations.
    Every index appears in exactly one run; runs of one are copies left alone."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i].dst, spans[i].src))
    runs: list[list[int]] = []
    for j in order:
        if runs:
            a, b = spans[runs[-1][-1]], spans[j]
            if (a.dst + a.nbytes == b.dst and a.src + a.nbytes == b.src
                    and a.dst_alloc == b.dst_alloc and a.src_alloc == b.src_alloc):
                runs[-1].append(j)
                continue
        runs.append([j])
    return runs


def merge_local(copies: list[Copy]) -> list[Copy]:
    """``copies`` with every run of :func:`merge_runs` made one byte copy (named after
    its first and last tensor); copies that cannot merge (a dtype cast, a strided
    view) or have no neighbour are returned as they are."""
    dense = [i for i, (d, s, _) in enumerate(copies) if _mergeable(d, s)]
    if len(dense) < 2:
        return list(copies)
    spans = _spans([copies[i] for i in dense])
    merged: dict[int, Copy] = {}
    for run in merge_runs(spans):
        first = dense[run[0]]
        if len(run) == 1:
            merged[first] = copies[first]
            continue
        span, n = spans[run[0]], sum(spans[k].nbytes for k in run)
        names = f"{copies[first][2]} .. {copies[dense[run[-1]]][2]} ({len(run)} tensors in one copy)"
        merged[first] = (byte_view(copies[first][0], n, span.dst_alloc),
                         byte_view(copies[first][1], n, span.src_alloc), names)
    skipped = set(dense)
    keep = {i: c for i, c in enumerate(copies) if i not in skipped}
    keep.update(merged)
    return [keep[i] for i in sorted(keep)]


def _mergeable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (dst.dtype == src.dtype and dst.device == src.device and dst.numel() > 0
            and dst.is_contiguous() and src.is_contiguous())


def _spans(copies: list[Copy]) -> list[Span]:
    """Spans of dense copies. Only a copy that touches another on both sides can merge:
    the others get their own bytes as their allocation (no driver call for them)."""
    def ends(k: int) -> set[int]:
        return {c[k].data_ptr() + c[k].nbytes for c in copies}

    def starts(k: int) -> set[int]:
        return {c[k].data_ptr() for c in copies}

    dst_ends, src_ends, dst_starts, src_starts = ends(0), ends(1), starts(0), starts(1)
    known = _Allocations()
    out = []
    for d, s, _ in copies:
        n, dp, sp = d.nbytes, d.data_ptr(), s.data_ptr()
        touching = ((dp in dst_ends and sp in src_ends)
                    or (dp + n in dst_starts and sp + n in src_starts))
        out.append(Span(dp, sp, n, known.of(d) if touching else (dp, dp + n),
                        known.of(s) if touching else (sp, sp + n)))
    return out


class _Allocations:
    """:func:`allocation_of`, asking the driver once per allocation: the caching
    allocator carves several tensors out of one (3-6 experts per 20 MB segment), and a
    driver call costs ~6 us (a qwen3-shaped preset's 4174 calls: 26 ms of a first refit)."""

    def __init__(self) -> None:
        self._starts: list[int] = []  # sorted, disjoint ranges
        self._ends: list[int] = []

    def of(self, t: torch.Tensor) -> tuple[int, int]:
        ptr = t.data_ptr()
        k = bisect_right(self._starts, ptr) - 1
        if k >= 0 and ptr + t.nbytes <= self._ends[k]:
            return self._starts[k], self._ends[k]
        got = allocation_of(t)
        k = bisect_right(self._starts, got[0])
        if not (k and self._starts[k - 1] == got[0]):
            self._starts.insert(k, got[0])
            self._ends.insert(k, got[1])
        return got


def allocation_of(t: torch.Tensor) -> tuple[int, int]:
    """The device allocation holding ``t`` as (first byte, one past the last): for CUDA
    tensors the driver's (the caching allocator carves many tensors out of one; with
    expandable segments, the reserved range of the segment), else ``t``'s storage,
    which is also the answer wherever the driver's range does not hold all of ``t``
    (a piece of a segment, where the reserved range is not known)."""
    got = _device_range(t)
    ptr = t.data_ptr()
    if got is not None and got[0] <= ptr and ptr + t.nbytes <= got[1]:
        return got
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def _device_range(t: torch.Tensor) -> tuple[int, int] | None:
    return _driver_range(t.data_ptr()) if t.is_cuda else None


def _driver_range(ptr: int) -> tuple[int, int] | None:
    """The allocation the driver says ``ptr`` lies in: the range reserved for virtual
    memory mappings (``cuMemAddressReserve``; expandable segments) where the pointer is
    in one, else the mapped range (a ``cudaMalloc`` allocation); None without a driver."""
    mapped = _mapped_range(ptr)
    if mapped is None:
        return None
    reserved = _reserved_range(ptr)
    if reserved is not None and reserved[0] <= mapped[0] and mapped[1] <= reserved[1]:
        return reserved
    return mapped


def byte_view(t: torch.Tensor, nbytes: int, alloc: tuple[int, int]) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` starting at ``t``'s first byte. Within ``t``'s own
    storage it is a view of it; past it (a run over several tensors of one CUDA
    allocation) it wraps the addresses, and the caller keeps every tensor of the run
    alive (the program holds their views)."""
    ptr, s = t.data_ptr(), t.untyped_storage()
    if not (alloc[0] <= ptr and ptr + nbytes <= alloc[1]):
        raise AssertionError(f"byte view {ptr:#x}+{nbytes} outside its allocation")
    if ptr + nbytes <= s.data_ptr() + s.nbytes():
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
            s, ptr - s.data_ptr(), (nbytes,))
    return torch.as_tensor(_CudaBytes(ptr, nbytes), device=t.device)


class _CudaBytes:
    """``__cuda_array_interface__`` of a byte range (no stream: the copy is ordered by
    the program's streams, not by this import)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3}


@lru_cache(maxsize=1)
def _get_range():
    return _optional("cuMemGetAddressRange", [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                              ctypes.c_uint64])


@lru_cache(maxsize=1)
def _get_attributes():
    return _optional("cuPointerGetAttributes", [ctypes.c_uint, ctypes.POINTER(ctypes.c_int),
                                                ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64])


def _optional(name: str, argtypes: list):
    try:
        return driver_function(name, argtypes)
    except RuntimeError:  # no driver here: the storage is the allocation
        return None


def _mapped_range(ptr: int) -> tuple[int, int] | None:
    fn = _get_range()
    if fn is None:
        return None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
        return None
    return base.value, base.value + size.value


# CUpointer_attribute (cuda.h): 1 where cudaIpcGetMemHandle works (cudaMalloc memory);
# the start and size of the address range a virtual memory mapping was reserved in
_LEGACY_IPC, _RANGE_START, _RANGE_SIZE = 10, 11, 12


def _reserved_range(ptr: int) -> tuple[int, int] | None:
    """The reserved range of a pointer into virtual memory mappings (not ``cudaMalloc``
    memory: that stays the mapped range, as it always was); None otherwise. One driver
    call for the three attributes (each zeroed: a flag is written in fewer bytes)."""
    fn = _get_attributes()
    if fn is None:
        return None
    attrs = (ctypes.c_int * 3)(_LEGACY_IPC, _RANGE_START, _RANGE_SIZE)
    values = (ctypes.c_uint64 * 3)()
    slots = (ctypes.c_void_p * 3)(*(ctypes.addressof(values) + 8 * i for i in range(3)))
    if fn(3, attrs, slots, ctypes.c_uint64(ptr)) != 0:
        return None
    legacy, start, size = values
    if legacy or not size:
        return None
    return start, start + size
