"""Staging twins of a rank's destination tensors and the commit that installs them.

A staged refit runs the rank's whole plan (local copies, receives, FP8 quantize
steps) into *twins*: one tensor per destination tensor the plan writes, of the
same shape and dtype, on the destination's device (``"device"``) or in pinned host
memory (``"host"``). The live tensors are not touched until :meth:`Commit.run`
copies the written regions of every twin into them, on the caller's stream.

Who calls what: ``Refitter`` makes the twins once (:func:`make_twins`), compiles a
``Program`` whose destination tensors are the twins, and at commit builds or reuses
a :class:`Commit` from the live tensors (:func:`compile_commit`).

With device staging (and on CPU) the commit's copies are the refit's own compiled local
copies (``execute.local.compile_copies``: large copies on parallel side streams or one
batched kernel, small ones fused, all captured in one CUDA graph with ``cuda_graph``),
replayed on the caller's stream: the commit runs at the speed of a refit's local copies.
Host twins are copied by one ``torch._foreach_copy_(non_blocking=True)`` from pinned
memory (a CUDA graph of copies out of pinned host memory is not captured).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..layout._types import Box
from ..plan.types import RankPlan
from .local import LANES, Copy, LocalCopies, compile_copies
from .streams import SideStreams

__all__ = ["STAGING", "Commit", "compile_commit", "make_twins", "written_boxes"]

#: where staged bytes wait for the commit: the destination's device, or pinned host memory
STAGING = ("device", "host")


def written_boxes(plan: RankPlan, skip: frozenset[str] = frozenset()) -> dict[str, tuple[Box, ...]]:
    """Per destination key the plan writes, the boxes (local coordinates) it writes: local
    copies, receives, and FP8 values and scales quantized into the destination. Keys in
    ``skip`` (the FP8 shadows: scratch that the quantize steps read) are left out. The
    plan covers each destination element at most once, so the boxes are disjoint."""
    boxes: dict[str, list[Box]] = defaultdict(list)
    for c in plan.local:
        boxes[c.dst_key].append(c.dst_box)
    for t in plan.recvs:
        boxes[t.key].append(t.local_box)
    for q in plan.quantize:
        if not q.staged:
            boxes[q.dst_key].append(q.dst_box)
            boxes[q.scale_key].append(q.scale_box)
    return {k: tuple(v) for k, v in sorted(boxes.items()) if k not in skip}


def make_twins(keys, live: Mapping[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """One contiguous twin per key, shaped and typed as its live tensor: on its device, or in
    host memory (pinned where CUDA is present, so that the commit's copies are asynchronous)."""
    if where not in STAGING:
        raise ValueError(f"staging must be one of {STAGING}, not {where!r}")
    twins = {}
    for key in keys:
        t = live[key]
        if where == "device" or t.device.type == "cpu":
            twins[key] = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        else:
            twins[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                                     pin_memory=torch.cuda.is_available())
    return twins


@dataclass(frozen=True, eq=False)
class Commit:
    """The copies of one commit: ``live[i].copy_(twin[i])`` for every i, one ordered unit
    on the caller's stream. Whole tensors the plan writes entirely are copied whole;
    partly written ones as views of their written boxes. The copies hold the live
    tensors' addresses (views, merged runs, a captured graph): they are valid while
    every live tensor is the one seen, where it was (:meth:`current`); else the
    Refitter compiles them again, following a tensor replaced or a storage moved.
    ``local``: the compiled copies replayed through ``side`` (device staging, CPU), or
    None (host twins: one pinned ``_foreach_copy_``)."""

    live: tuple[torch.Tensor, ...]
    twins: tuple[torch.Tensor, ...]
    keys: tuple[str, ...]  # the destination keys, and the live tensor of each then
    tensors: tuple[torch.Tensor, ...]
    pointers: tuple[int, ...]  # their data pointers then
    nbytes: int
    local: LocalCopies | None = None
    side: SideStreams | None = None

    def current(self, live: Mapping[str, torch.Tensor]) -> bool:
        """Whether these copies still write the tensors ``live`` holds now, where they are."""
        return (all(live[k] is t for k, t in zip(self.keys, self.tensors))
                and tuple(t.data_ptr() for t in self.tensors) == self.pointers)

    def run(self) -> None:
        if not self.live:
            return
        with torch.no_grad():  # copies into leaves that require grad
            if self.local is not None:
                self.local.run_on_caller(self.side)
            else:
                torch._foreach_copy_(list(self.live), list(self.twins), non_blocking=True)


def compile_commit(boxes: Mapping[str, tuple[Box, ...]], live: Mapping[str, torch.Tensor],
                   twins: Mapping[str, torch.Tensor], side: SideStreams | None = None,
                   cuda_graph: bool = False) -> Commit:
    """The copies that install ``twins`` into ``live``: the whole tensor where the plan
    writes all of it, else each written box (a padded tensor's padding, or a tensor only
    partly covered, keeps its live values). Where every twin is on its live tensor's
    device, they are compiled as a refit's local copies (``compile_copies`` through
    ``side``, made here if not given; captured in a CUDA graph with ``cuda_graph``)."""
    dst, src, names, nbytes = [], [], [], 0
    for key, written in boxes.items():
        tensor, twin = live[key].detach(), twins[key]
        if sum(b.numel for b in written) == tensor.numel():
            dst.append(tensor)
            src.append(twin)
            names.append(key)
        else:
            for b in written:
                dst.append(tensor[b.slices()] if b.ndim else tensor)
                src.append(twin[b.slices()] if b.ndim else twin)
                names.append(key)
        nbytes += sum(b.numel for b in written) * tensor.element_size()
    local = None
    if dst and all(d.device == s.device for d, s in zip(dst, src)):
        if side is None:
            side = SideStreams(dst[0].device, LANES)
        local = compile_copies([Copy(d, s, n) for d, s, n in zip(dst, src, names)], side, cuda_graph)
    tensors = tuple(live[k] for k in boxes)
    return Commit(tuple(dst), tuple(src), tuple(boxes), tensors, tuple(t.data_ptr() for t in tensors),
                  nbytes, local, side if local is not None else None)
