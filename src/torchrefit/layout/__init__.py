"""Layouts: how a rank's local tensors are pieces of global tensors.

``describe(model, layout)`` returns a :class:`Described` (the rank's
:class:`ModelLayout` and the tensors its keys name). ``layout`` is None (detect:
DTensor parameters or buffers, then ``spmd_types`` annotations, then Megatron-style
attributes, else replicated),
``"dtensor"`` (FSDP2, torchtitan TP, any ``DeviceMesh``; see ``dtensor``),
``"spmd_annotated"`` (torchtitan's ``spmd_types`` backend: plain local tensors
annotated with their cut; see ``spmd_annotated``), ``"megatron"``, ``"replicated"``, a mapping ``{local name: TensorSpec}`` (explicit),
or any callable ``model -> Described``. ``placement_pieces`` and ``shard_pieces``
compute pieces of DTensor placements and of Megatron's cuts for explicit layouts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .._util.caller_state import caller_state
from ..errors import LayoutError
from ._described import Described, named_refit_tensors
from ._types import Box, ModelLayout, Piece, TensorLayout
from .dtensor import dtensor, global_name, is_dtensor_model
from .explicit import Explicit, TensorSpec
from .megatron import is_megatron_model, megatron
from .placements import placement_pieces
from .replicated import replicated
from .sharding import shard_pieces, whole_piece
from .spmd_annotated import is_spmd_annotated_model, spmd_annotated

__all__ = [
    "Box", "Piece", "TensorLayout", "ModelLayout", "Described", "TensorSpec", "Explicit",
    "describe", "dtensor", "spmd_annotated", "megatron", "replicated", "shard_pieces", "whole_piece",
    "placement_pieces", "named_refit_tensors", "is_dtensor_model", "global_name", "layout_kind",
    "NAMED_LAYOUTS",
]

LayoutArg = str | Mapping[str, TensorSpec] | Callable[..., Described] | None

_NAMED = {"dtensor": dtensor, "spmd_annotated": spmd_annotated, "megatron": megatron, "replicated": replicated}
#: the layouts ``describe`` takes by name (what ``layout_kind`` detects when given none)
NAMED_LAYOUTS = tuple(_NAMED)


def layout_kind(model, layout: LayoutArg = None) -> str:
    """How ``describe`` reads ``model``: "dtensor", "spmd_annotated", "megatron", "replicated", "explicit"
    or "custom" ("" where the rank holds no such model), for error messages."""
    if model is None:
        return ""
    if layout is None:
        try:
            if is_dtensor_model(model):
                return "dtensor"
            if is_spmd_annotated_model(model):
                return "spmd_annotated"
            return "megatron" if is_megatron_model(model) else "replicated"
        except Exception:
            return "unknown"
    if isinstance(layout, str):
        return layout
    return "explicit" if isinstance(layout, Mapping) else "custom"


def describe(model, layout: LayoutArg = None) -> Described | None:
    """This rank's description of ``model`` (None where the rank holds no such model)."""
    if model is None:
        return None
    if layout is None:
        # DTensor first: a DTensor's shape is global, so no other adapter reads it right.
        # then annotations: an annotated tensor's shape is local, read whole it would lie.
        if is_dtensor_model(model):
            layout = dtensor
        elif is_spmd_annotated_model(model):
            layout = spmd_annotated
        else:
            layout = megatron if is_megatron_model(model) else replicated
    elif isinstance(layout, str):
        try:
            layout = _NAMED[layout]
        except KeyError:
            raise LayoutError(f"unknown layout {layout!r}; use one of {sorted(_NAMED)}") from None
    elif isinstance(layout, Mapping):
        layout = Explicit(layout)
    if str(getattr(layout, "__module__", "")).startswith("torchrefit."):
        described = layout(model)  # torchrefit's own adapters (named, Explicit, vLLM, sink)
    else:
        with caller_state():  # a caller's adapter runs with the caller's torch modes
            described = layout(model)
    if not isinstance(described, Described):
        raise LayoutError(f"layout adapter {layout!r} returned {type(described).__name__}, not Described")
    return described
