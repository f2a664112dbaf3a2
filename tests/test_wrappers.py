"""A model passed inside its wrappers is described as the model it wraps.

``torch.compile(model)`` (an ``OptimizedModule`` holding the model as ``_orig_mod``), a
DDP-style ``.module`` wrapper, and both nested: each is described with the names, layouts
and tensors of the bare model, for the Megatron-style layout and the replicated one, so
a compiled trainer or engine refits into or from a plain one (its names used to carry
``_orig_mod.`` and match nothing). The oracle is the bare model's own description, and
every described tensor is the bare model's own tensor object.
"""

from __future__ import annotations

import torch
from torch import nn

from torchrefit.layout import describe
from torchrefit.testing import Mesh, ModelSpec, build_toy


class _DataParallelLike(nn.Module):
    """What DDP and Megatron's Float16Module look like from outside: ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def _wrappings(model: nn.Module) -> dict[str, nn.Module]:
    return {"compiled": torch.compile(model), "ddp": _DataParallelLike(model),
            "compiled ddp": torch.compile(_DataParallelLike(model)),
            "ddp of compiled": _DataParallelLike(torch.compile(model))}


def _same_description(model: nn.Module) -> None:
    bare = describe(model)
    held = {id(t) for t in bare.tensors.values()}
    for how, wrapped in _wrappings(model).items():
        got = describe(wrapped)
        assert got.layout == bare.layout, how
        assert {id(t) for t in got.tensors.values()} == held, how


def test_wrapped_megatron_style_model() -> None:
    _same_description(build_toy(ModelSpec(layers=2), Mesh(2, ranks=2), 0, seed=1))


def test_wrapped_plain_model() -> None:
    _same_description(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2)))
