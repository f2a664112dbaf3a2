"""The result of describing a model on one rank, and how local tensors are enumerated."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .._util.identity import identity
from ._types import ModelLayout
from .walk import named_modules

__all__ = ["Described", "named_refit_tensors", "unwrap_chunks"]


@dataclass(frozen=True)
class Described:
    """A rank's layout of one model and the local tensors its keys name.

    ``after_refit``, where set, is called by ``Refitter.refit()`` on this rank after
    every refit into this model (as destination): for an adapter whose model keeps
    derived copies of the tensors it was described by (FSDP2's unsharded parameters),
    so that the model's next use sees the new weights.
    """

    layout: ModelLayout
    tensors: Mapping[str, torch.Tensor]
    after_refit: Callable[[], None] | None = None


def named_refit_tensors(module: nn.Module | Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers, the tensors a refit moves.

    Non-persistent buffers (rotary caches, token counters) are derived state and
    stay where they are; persistent ones (a MoE router's ``expert_bias``) are
    training state and travel with the weights.
    """
    if isinstance(module, Mapping):
        yield from module.items()
        return
    modules = named_modules(module)  # one walk for parameters and buffers
    if type(module).named_parameters is nn.Module.named_parameters:
        yield from _named_parameters(modules)
    else:  # a wrapper that names its parameters its own way (FSDP1) names them
        yield from module.named_parameters()
    for prefix, sub in modules:
        skip = sub._non_persistent_buffers_set
        for name, buf in sub._buffers.items():
            if buf is not None and name not in skip:
                yield (f"{prefix}.{name}" if prefix else name), buf


def _named_parameters(modules: list[tuple[str, nn.Module]]) -> Iterator[tuple[str, torch.Tensor]]:
    """What ``named_parameters()`` yields, from the walk ``named_modules()`` made: each
    parameter once, under its first path."""
    seen: set[int] = set()
    for prefix, sub in modules:
        for name, p in sub._parameters.items():
            if p is None or (key := identity(p)) in seen:
                continue
            seen.add(key)
            yield (f"{prefix}.{name}" if prefix else name), p


def unwrap_chunks(model) -> list:
    """Model chunks (virtual pipeline stages) with their wrappers removed: DDP and
    Float16 modules (``.module``) and ``torch.compile``'s (``_orig_mod``), so that a
    compiled model is described by the names of the model it compiles."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    out = []
    for chunk in chunks:
        while (inner := _wrapped(chunk)) is not None:
            chunk = inner
        out.append(chunk)
    return out


def _wrapped(chunk) -> nn.Module | None:
    compiled = _compiled_type()
    if compiled is not None and isinstance(chunk, compiled):
        return chunk._orig_mod
    inner = getattr(chunk, "module", None)
    return inner if isinstance(inner, nn.Module) else None


def _compiled_type() -> type | None:
    """``torch.compile``'s module wrapper, where torch's compiler was imported (no
    compiled module exists before; importing it only to check would cost seconds)."""
    frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(frame, "OptimizedModule", None)


def chunk_key(index: int, count: int, name: str) -> str:
    """Local key of a tensor: its qualified name, prefixed by the chunk where several."""
    return name if count == 1 else f"{index}/{name}"
