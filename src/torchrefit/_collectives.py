"""Gathering small Python objects over a process group without NumPy.

``torch.distributed.all_gather_object`` needs NumPy in recent PyTorch releases;
torchrefit depends on ``torch`` alone, so it pickles into a uint8 tensor itself.
"""

from __future__ import annotations

import ctypes
import pickle
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_pickled"]


def _device(group: dist.ProcessGroup) -> torch.device:
    backend = str(dist.get_backend(group))
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _to_bytes(t: torch.Tensor) -> bytes:
    t = t.cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel())


def all_gather_pickled(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's ``obj``, by group rank (two collectives: sizes, then bytes)."""
    world = dist.get_world_size(group)
    device = _device(group)
    data = pickle.dumps(obj, protocol=5)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf, group=group)
    return [pickle.loads(_to_bytes(t[:n])) for t, n in zip(out, lengths)]
