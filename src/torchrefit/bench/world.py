"""One-rank worlds and toy model pairs, as the diagnostic scripts in ``benchmarks/`` start
them (the refit needs a process group even with one rank)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from ..testing import Mesh, build_toy
from .config import spec_from_preset

__all__ = ["one_gpu_world", "one_gpu_toy_pair", "tiny_toy_pair", "report_and_leave"]


def one_gpu_world(port: int) -> torch.device:
    """Join a one-rank NCCL world on ``port`` (each script its own, so two can run at once)
    and make GPU 0 current; the device it returns."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device


def tiny_toy_pair(preset: str, layers: int, port: int, device: torch.device | str = "cpu",
                  megatron: bool = False, full_size: bool = False) -> tuple:
    """Join a one-rank Gloo world on ``port`` and build a ``preset``'s toy pair (source
    seed 1, destination seed 2) at tiny sizes (hidden 64) on ``device``: the preset's
    tensor and module counts, for timing the host's work per tensor. ``megatron``:
    megatron-core ``GPTModel``s of the same tiny shape on the CPU instead (megatron-core
    installed; its modules and parameter attributes, not the toy's). ``full_size``: the
    preset's own sizes instead (as the shape matrix's toy rows), to tell what the sizes
    change."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    spec = (spec_from_preset(preset, layers=layers) if full_size else
            spec_from_preset(preset, layers=layers, hidden=64, ffn=64, expert_ffn=32, vocab=512, heads=4, groups=2))
    if megatron:
        from .megatron_models import build_megatron_gpt

        return tuple(build_megatron_gpt(spec, seed=seed, device="cpu") for seed in (1, 2))
    return tuple(build_toy(spec, Mesh(1, ranks=1), 0, seed, device=device, random_init=True) for seed in (1, 2))


def report_and_leave(out: dict, path: str | None) -> None:
    """Print ``out`` as ``key=value`` on one line, write it as JSON to ``path`` where given,
    and leave the world :func:`tiny_toy_pair` joined."""
    print(" ".join(f"{k}={v}" for k, v in out.items()))
    if path:
        with open(path, "w") as fh:
            json.dump(out, fh, indent=1)
    dist.destroy_process_group()


def one_gpu_toy_pair(rank: int, layers: int | None, collocated: bool = False, world: int = 2) -> tuple:
    """The gpt-4b preset's toy model (``layers`` to shrink it) as source and destination of a
    non-collocated TP1 -> TP1 refit between two processes sharing GPU 0 (rank 0 holds
    the source, rank 1 the destination), or with ``collocated`` of a collocated TP2 ->
    TP1 refit over ``world`` processes (each rank a source half and a whole
    destination); returns once every rank built its models. Called by the one-sided
    transport diagnostics on every rank."""
    torch.cuda.set_device(0)
    spec = spec_from_preset("gpt-4b", layers=layers)
    meshes = ((Mesh(2, ranks=world), Mesh(1, ranks=world)) if collocated
              else (Mesh(1, ranks=1), Mesh(1, ranks=1, offset=1)))
    src, dst = (build_toy(spec, mesh, rank, seed, device="cuda", random_init=True)
                for mesh, seed in zip(meshes, (1, 2)))
    torch.cuda.synchronize()
    dist.barrier()
    return src, dst
