"""Layouts: how a rank's local tensors are pieces of global tensors.

``describe(model, layout)`` returns a :class:`Described` (the rank's
:class:`ModelLayout` and the tensors its keys name). ``layout`` is None (detect:
Megatron-style attributes, else replicated), ``"megatron"``, ``"replicated"``, a
mapping ``{local name: TensorSpec}`` (explicit), or any callable
``model -> Described``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..errors import LayoutError
from ._described import Described, named_refit_tensors
from ._types import Box, ModelLayout, Piece, TensorLayout
from .explicit import Explicit, TensorSpec
from .megatron import is_megatron_model, megatron
from .replicated import replicated
from .sharding import shard_pieces, whole_piece

__all__ = [
    "Box", "Piece", "TensorLayout", "ModelLayout", "Described", "TensorSpec", "Explicit",
    "describe", "megatron", "replicated", "shard_pieces", "whole_piece", "named_refit_tensors",
]

LayoutArg = str | Mapping[str, TensorSpec] | Callable[..., Described] | None

_NAMED = {"megatron": megatron, "replicated": replicated}


def describe(model, layout: LayoutArg = None) -> Described | None:
    """This rank's description of ``model`` (None where the rank holds no such model)."""
    if model is None:
        return None
    if layout is None:
        layout = megatron if is_megatron_model(model) else replicated
    elif isinstance(layout, str):
        try:
            layout = _NAMED[layout]
        except KeyError:
            raise LayoutError(f"unknown layout {layout!r}; use one of {sorted(_NAMED)}") from None
    elif isinstance(layout, Mapping):
        layout = Explicit(layout)
    described = layout(model)
    if not isinstance(described, Described):
        raise LayoutError(f"layout adapter {layout!r} returned {type(described).__name__}, not Described")
    return described
