"""The native form of a delta message's diff and apply (``_native.delta``), for CPU
tensors: which parts it can take, and the calls.

A message goes native on the sender only where every part can (the source, after any
cast, contiguous on the CPU, its reference on the CPU too); otherwise the whole message
takes the torch ops of ``execute.delta``. Both write the same bytes, so either end may
run either form. A receiver applies each part natively where its destination view is
contiguous on the CPU in the wire dtype, else with the torch ops.
"""

from __future__ import annotations

import torch

from .. import settings
from .._native import delta as native
from .delta_wire import sparse_nbytes

__all__ = ["encodable", "encode_parts", "appliable", "apply_part", "kernels", "threads"]

kernels = native.kernels


def threads() -> int:
    """Threads one native diff or apply spreads over: ``settings.delta_threads``, or where
    that is 0, torch's intra-op threads here (a launcher that gives several ranks one host
    sets those to 1, so ranks sharing cores do not oversubscribe them)."""
    return settings.current().delta_threads or max(1, min(64, torch.get_num_threads()))


def encodable(currents: list[torch.Tensor], ref: torch.Tensor) -> bool:
    """Whether the native diff can take these parts' current values against ``ref``."""
    return ref.device.type == "cpu" and all(c.device.type == "cpu" and c.is_contiguous() for c in currents)


def encode_parts(kern: native.Kernels, currents: list[torch.Tensor], ref: torch.Tensor, offsets: list[int],
                 out: torch.Tensor, cap: int, threads: int) -> tuple[list[int], int] | None:
    """Diff each part against its bytes of ``ref`` (at ``offsets``), writing the parts'
    sparse encodings one after another into ``out`` and updating ``ref``. Returns (changed
    count per part, payload bytes), or None where more than ``cap`` elements changed in
    all or the payload outgrew ``out`` (the message then goes dense, which overwrites
    ``ref`` whole)."""
    counts, at, left = [], 0, cap
    base, room, ref_at = out.data_ptr(), out.numel(), ref.data_ptr()
    for cur, offset in zip(currents, offsets):
        size = cur.element_size()
        k = kern.encode(cur.data_ptr(), ref_at + offset, cur.numel(), size, base + at, room - at, left, threads)
        if k < 0:
            return None
        counts.append(k)
        left -= k
        at += sparse_nbytes(cur.numel(), k, size)
    return counts, at


def appliable(view: torch.Tensor, wire: torch.dtype) -> bool:
    """Whether a part's destination view takes the native apply."""
    return view.device.type == "cpu" and view.dtype == wire and view.is_contiguous()


def apply_part(kern: native.Kernels, payload: torch.Tensor, at: int, view: torch.Tensor, changed: int) -> None:
    """One part's sparse encoding at byte ``at`` of ``payload`` into ``view``."""
    kern.apply(payload.data_ptr() + at, view.numel(), view.element_size(), changed, view.data_ptr(), threads())
