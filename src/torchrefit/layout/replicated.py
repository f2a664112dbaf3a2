"""Replicated layout: every rank that holds the model holds every tensor whole."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ._described import Described, chunk_key, named_refit_tensors, unwrap_chunks
from ._types import ModelLayout, TensorLayout, dtype_name
from .sharding import whole_piece

__all__ = ["replicated"]


def replicated(model: nn.Module | list[nn.Module] | Mapping[str, torch.Tensor]) -> Described:
    """Describe a plain model (or a mapping of name to tensor) held whole on this rank.

    Global names are the qualified names; data-parallel replicas hold the same
    global tensors and the planner chooses among them.
    """
    chunks = [model] if isinstance(model, Mapping) else unwrap_chunks(model)
    entries, tensors = [], {}
    for i, chunk in enumerate(chunks):
        for name, t in named_refit_tensors(chunk):
            key = chunk_key(i, len(chunks), name)
            entries.append((key, whole_tensor_layout(name, t, is_buffer=not isinstance(t, nn.Parameter))))
            tensors[key] = t
    return Described(ModelLayout(tuple(entries)), tensors)


def whole_tensor_layout(name: str, t: torch.Tensor, *, is_buffer: bool = False) -> TensorLayout:
    shape = tuple(t.shape)
    return TensorLayout(name, shape, dtype_name(t.dtype), shape, whole_piece(shape), is_buffer)
