"""A one-rank NCCL world on GPU 0, as the one-GPU diagnostic scripts in ``benchmarks/``
start it (the refit needs a process group even with one rank)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["one_gpu_world"]


def one_gpu_world(port: int) -> torch.device:
    """Join a one-rank NCCL world on ``port`` (each script its own, so two can run at once)
    and make GPU 0 current; the device it returns."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device
