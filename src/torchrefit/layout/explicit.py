"""Explicit layout: the user says, per local tensor, which global tensor and pieces it holds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import LayoutError
from ._described import Described, named_refit_tensors
from ._types import ModelLayout, Piece, TensorLayout, dtype_name
from .replicated import whole_tensor_layout

__all__ = ["TensorSpec", "Explicit"]


@dataclass(frozen=True)
class TensorSpec:
    """A local tensor's global name, global shape and pieces (see ``shard_pieces``)."""

    name: str
    global_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(s) for s in self.global_shape))
        object.__setattr__(self, "pieces", tuple(self.pieces))


class Explicit:
    """A layout adapter built from a table ``{local name: TensorSpec}``.

    Local tensors the table does not list are described as whole tensors under
    their own names when ``unlisted="replicated"`` (the default), left out of the
    refit when ``"skip"``, and rejected when ``"error"``. ``aliases`` lists
    ``(alias, target)`` global names this model can serve (a tied output layer).
    """

    def __init__(
        self,
        specs: Mapping[str, TensorSpec],
        *,
        unlisted: str = "replicated",
        aliases: Sequence[tuple[str, str]] = (),
    ) -> None:
        if unlisted not in ("replicated", "skip", "error"):
            raise ValueError(f"unlisted must be 'replicated', 'skip' or 'error', not {unlisted!r}")
        self.specs = dict(specs)
        self.unlisted = unlisted
        self.aliases = tuple(aliases)

    def __call__(self, model: nn.Module | Mapping[str, torch.Tensor]) -> Described:
        entries, tensors = [], {}
        found = set()
        for key, t in named_refit_tensors(model):
            spec = self.specs.get(key)
            is_buffer = not isinstance(t, nn.Parameter)
            if spec is not None:
                found.add(key)
                layout = TensorLayout(spec.name, spec.global_shape, dtype_name(t.dtype),
                                      tuple(t.shape), spec.pieces, is_buffer)
            elif self.unlisted == "replicated":
                layout = whole_tensor_layout(key, t, is_buffer=is_buffer)
            elif self.unlisted == "skip":
                continue
            else:
                raise LayoutError(f"{key}: local tensor is not in the explicit layout table")
            entries.append((key, layout))
            tensors[key] = t
        missing = sorted(set(self.specs) - found)
        if missing:
            raise LayoutError(f"explicit layout names local tensors the model lacks: {missing[:5]}")
        return Described(ModelLayout(tuple(entries), self.aliases), tensors)
