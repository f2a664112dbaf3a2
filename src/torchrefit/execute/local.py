"""Copies between tensors this rank can address, compiled once and replayed.

Used for the plan's local copies and for a pull transport's copies out of mapped
peer memory (``execute.one_sided_program``). In a program of many mid-sized copies (MoE
experts; ``settings.batched_copy`` decides, see ``execute.batched``), every plain
aligned large copy runs in one batched kernel launch on a stream of its own; large
copies otherwise run one by one on parallel side streams (graph branches), as memcpy
or, where the batched kernel cannot be built, as elementwise kernels
(``execute.kernels.elementwise_copies``; ``settings.sm_copy_below`` sets a size);
small ones in one ``torch._foreach_copy_`` per (destination dtype, source dtype,
dense) group on another stream; with ``cuda_graph`` the whole set, fork and join
included, is captured once and replayed with one launch. Strided large copies cut
into aligned rows of at least 2 KB join the batched launch (unless ``batched_copy`` is
``none``); the others run on the widest views of the same bytes that fit.
All stream ordering goes through ``streams.SideStreams``.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from .. import settings
from .._util.caller_state import caller_inference
from ..settings import MAX_BRANCHES
from .batched import (
    Batch,
    batch_from,
    batch_mode,
    batchable,
    compile_batch,
    kernel_available,
    strided_runs,
)
from .kernels import elementwise_copies
from .kernels.copy_runs import ByteRuns
from .runs import merge_local
from .streams import SideStreams

__all__ = ["Copy", "CopyGroup", "LocalCopies", "compile_copies", "balance_by_bytes", "same", "differing",
           "SMALL_COPY_BYTES", "BRANCHES", "LANES"]

#: copies below this size go through ``torch._foreach_copy_`` (one per dtype pair)
SMALL_COPY_BYTES = 1 << 20
#: large copies run on this many parallel side streams (graph branches): one copy's
#: tail overlaps another's body instead of the stream draining between copies. Eight,
#: not two: models of many 2-20 MB tensors need more copies in flight to keep the copy
#: engines busy, while large tensors reach the floor either way. The small copies get one
#: more stream of their own, so their many short kernels overlap the large copies instead
#: of lengthening a branch. ``settings.branches`` may ask for fewer.
BRANCHES = MAX_BRANCHES
_SMALL_LANE = BRANCHES
#: the batched kernel gets a stream of its own too: it overlaps the large copies
_BATCH_LANE = BRANCHES + 1
#: side streams a program needs for its copies
LANES = BRANCHES + 2


class Copy(NamedTuple):
    dst: torch.Tensor
    src: torch.Tensor
    name: str


@dataclass(frozen=True)
class CopyGroup:
    """Small copies one ``torch._foreach_copy_`` moves in one fused kernel: the fused
    path needs one destination dtype, one source dtype and dense pairs of equal
    strides, else it falls back to a kernel per tensor (for megatron-core's bf16 biases
    mixed with fp32 layer norms, tens of times slower)."""

    dst: tuple[torch.Tensor, ...]
    src: tuple[torch.Tensor, ...]
    names: tuple[str, ...]


@dataclass(frozen=True)
class LocalCopies:
    """A compiled set of copies: ``planned`` as the plan lists them (what verify
    compares, naming the tensor that differs), and what runs: ``big`` with the side
    stream (branch) of each, ``small`` fused groups, ``batch``, the plain byte copies
    one kernel launch moves (or None), and the CUDA graph that replays them all (or
    None). Runs contiguous on both sides may be merged into one copy first
    (``runs.merge_local``)."""

    planned: tuple[Copy, ...]
    big: tuple[Copy, ...]
    branch_of: tuple[int, ...]
    small: tuple[CopyGroup, ...]
    #: per large copy, its integer views where it runs as a kernel (``execute.kernels.elementwise_copies``), else None
    words: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]
    batch: Batch | None = None
    graph: torch.cuda.CUDAGraph | None = None

    def __bool__(self) -> bool:
        return bool(self.big or self.small or self.batch)

    def copies(self) -> Iterator[Copy]:
        if self.batch is not None:
            yield from (Copy(*c) for c in zip(self.batch.dst, self.batch.src, self.batch.names))
        yield from self.big
        for g in self.small:
            yield from (Copy(*c) for c in zip(g.dst, g.src, g.names))

    def copy(self, side: SideStreams) -> None:
        """Inside a ``side.session()`` of all ``LANES`` streams: the batched kernel on a
        stream of its own, large copies spread over the branches, small ones, one
        foreach per group, on another stream."""
        if self.batch is not None:
            with side.placed(_BATCH_LANE):
                self.batch.launch()
        on: dict[int, list[int]] = defaultdict(list)
        for i, branch in enumerate(self.branch_of):
            on[branch].append(i)
        for branch, copies in on.items():  # one stream switch per branch, not per copy
            with side.placed(branch):  # (~30 us each while capturing: 1000 copies, 30 ms)
                for i in copies:
                    if self.words[i] is None:
                        self.big[i].dst.copy_(self.big[i].src)
                    else:
                        elementwise_copies.run(self.words[i])
        with side.placed(_SMALL_LANE):
            for g in self.small:
                torch._foreach_copy_(g.dst, g.src)

    def run_in_session(self, side: SideStreams) -> None:
        """Inside ``side.session()``: replay the graph on side stream 0, or copy."""
        if self.graph is not None:
            with side.placed(0):
                self.graph.replay()
        elif self:
            self.copy(side)

    def run_on_caller(self, side: SideStreams) -> None:
        """Replay on the caller's stream (ordered by stream order; the branches inside
        are the fork and join captured through ``SideStreams``), or copy inside
        ``SideStreams.session``."""
        if self.graph is not None:
            self.graph.replay()
        elif self:
            with side.session():
                self.copy(side)

    def mismatches(self, where: str) -> list[str]:
        return [f"{name} ({where})" for dst, src, name in self.planned if not same(dst, src)]


def compile_copies(copies: Iterable[Copy], side: SideStreams, cuda_graph: bool,
                   merge: bool = True) -> LocalCopies:
    """Group ``copies`` (skipping those whose destination is the source itself, and,
    with ``merge``, making runs contiguous on both sides one copy; plain byte copies
    from ``batched.batch_from``'s size and large strided copies cut into rows
    (``batched.strided_runs``), where ``batched.kernel_available``, into one batch)
    and, with ``cuda_graph`` on CUDA, capture them once."""
    planned = []
    for c in copies:
        dst, src = c.dst, c.src
        if src.dim() != dst.dim():  # one expert of stacked experts: unit dims differ
            c = Copy(dst, src.view(dst.shape), c.name)
        if dst.data_ptr() == c.src.data_ptr() and dst.stride() == c.src.stride() and dst.dtype == c.src.dtype:
            continue  # the destination is the source itself: nothing to copy
        planned.append(c)
    big: list[Copy] = []
    small: dict[tuple, list[Copy]] = defaultdict(list)
    batch: list[Copy] = []
    strided: list[tuple[Copy, ByteRuns]] = []  # batched where the kernel can be built, else per copy
    # the rules read the copies as planned: merged runs depend on where the allocator put them
    sizes = [n for c in planned if (n := max(c.dst.nbytes, c.src.nbytes)) >= SMALL_COPY_BYTES]
    mode = batch_mode()
    start = batch_from(sizes, SMALL_COPY_BYTES, mode)
    if start is not None and not kernel_available(side.device):
        start = None
    for c in (map(Copy._make, merge_local(planned)) if merge else planned):
        dst, src = c.dst, c.src
        if start is not None and dst.nbytes >= start and batchable(dst, src):
            batch.append(c)
        elif max(dst.nbytes, src.nbytes) >= SMALL_COPY_BYTES:
            rows = strided_runs(dst, src) if mode != "none" and side.device.type == "cuda" else None
            if rows is None:
                big.append(c)
            else:
                strided.append((c, rows))
        else:
            small[(dst.dtype, src.dtype, dst.is_contiguous() and src.is_contiguous())].append(c)
    runs: list[ByteRuns | None] = [None] * len(batch)  # the dense ones' runs: planned by compile_batch
    if strided and kernel_available(side.device):
        batch.extend(c for c, _ in strided)
        runs.extend(r for _, r in strided)
    else:
        big.extend(c for c, _ in strided)
    groups = tuple(CopyGroup(*(tuple(x) for x in zip(*g))) for g in small.values())
    big = [Copy(*w, c.name) if (w := elementwise_copies.widened(c.dst, c.src)) else c for c in big]
    below = elementwise_copies.sm_copy_below(sizes)
    words = tuple(elementwise_copies.word_views(c.dst, c.src) if c.dst.nbytes < below else None for c in big)
    compiled = LocalCopies(tuple(planned), tuple(big),
                           tuple(balance_by_bytes([c.dst.nbytes for c in big], branches())), groups, words,
                           compile_batch(batch, side.device, runs))
    if cuda_graph and side.streams and compiled:
        return replace(compiled, graph=_capture(compiled, side))
    return compiled


def _capture(copies: LocalCopies, side: SideStreams) -> torch.cuda.CUDAGraph | None:
    """Capture the copies (with their branches) once. Falls back to eager copies
    where capture fails."""
    graph = torch.cuda.CUDAGraph()
    # capture_begin/end rather than torch.cuda.graph(): that context also runs
    # gc.collect() and empties the allocator cache, side effects a trainer should
    # not pay for; these copies allocate nothing.
    capture = torch.cuda.Stream(device=side.device)
    capture.wait_stream(torch.cuda.current_stream(side.device))
    try:
        # capturing runs the copies once: in the caller's inference mode, as a refit would
        with caller_inference(), torch.no_grad(), torch.cuda.stream(capture):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                with side.session():  # captured as the graph's fork and join
                    copies.copy(side)
            finally:
                graph.capture_end()
    except RuntimeError as e:
        warnings.warn(f"torchrefit: CUDA graph capture of local copies failed ({e}); "
                      "copying eagerly", stacklevel=4)
        return None
    return graph


def branches() -> int:
    """Side streams the large copies spread over: ``settings.branches`` (``BRANCHES``
    unless set lower, e.g. for processes time-sliced on one GPU without MPS)."""
    return settings.current().branches


def balance_by_bytes(sizes: list[int], lanes: int) -> list[int]:
    """Lane of each copy: largest first onto the least loaded lane, so the lanes carry
    about the same bytes and end together."""
    load = [0] * lanes
    lane = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        b = load.index(min(load))
        lane[i] = b
        load[b] += sizes[i]
    return lane


def same(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``dst`` holds what a refit would copy from ``src`` (cast and moved as it)."""
    if dst.dtype == src.dtype and dst.dtype.itemsize == 1:  # FP8: torch.equal lacks it
        return torch.equal(dst.view(torch.uint8), src.to(dst.device).view(torch.uint8))
    return torch.equal(dst, src.to(device=dst.device, dtype=dst.dtype))


def differing(dsts, srcs, names) -> list[str]:
    return [name for dst, src, name in zip(dsts, srcs, names) if not same(dst, src)]
