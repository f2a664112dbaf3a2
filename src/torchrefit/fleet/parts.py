"""Pure: cutting a replica's tensors into the parts the relay pipelines (no process group).

A relay that forwards a version only once it holds all of it makes an update's time grow
with the chain's depth. The fleet instead moves each update in ``chunks`` parts, each a
set of whole global tensors: a replica forwards part ``i`` to the next while it receives
part ``i + 1``, so a chain of depth ``d`` takes about ``(chunks + d - 1) / chunks`` of one
hop's time rather than ``d`` hops.

Every replica cuts the same way without talking to the others: the global tensors, in
the order of their names, are cut into ``chunks`` runs of about equal element counts
(every replica of a fleet describes the same global tensors, whatever its layout). A
tensor that another serves (a tied output layer) goes where its target goes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from ..layout import Described, ModelLayout

__all__ = ["cut", "part_of", "part_layout"]


def cut(sizes: Mapping[str, int], chunks: int) -> list[frozenset[str]]:
    """The global names of each of ``chunks`` parts: runs of the sorted names of about
    ``total / chunks`` elements each (fewer parts where there are fewer tensors; never an
    empty one). Deterministic: the same sizes give the same parts on every rank."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, not {chunks}")
    names = sorted(sizes)
    total = sum(sizes.values())
    parts: list[set[str]] = [set()]
    done = 0
    for name in names:
        # cut before this tensor where its middle lies past the current part's share
        if parts[-1] and len(parts) < chunks and done + sizes[name] / 2 > total * len(parts) / chunks:
            parts.append(set())
        parts[-1].add(name)
        done += sizes[name]
    return [frozenset(p) for p in parts if p]


def global_sizes(layout: ModelLayout) -> dict[str, int]:
    """Each global tensor's element count, as ``layout`` describes it."""
    return {t.name: math.prod(t.global_shape) for _, t in layout}


def part_of(described: Described, names: frozenset[str],
            tensors: Mapping[str, torch.Tensor] | None = None) -> Described:
    """``described`` cut to the global tensors ``names`` (and aliases served from them),
    over ``tensors`` (same keys and shapes: the fleet's staging copy) or its own."""
    keep = tuple((k, t) for k, t in described.layout if t.name in names)
    aliases = tuple((a, t) for a, t in described.layout.aliases if t in names)
    source = described.tensors if tensors is None else tensors
    return Described(ModelLayout(keep, aliases), {k: source[k] for k, _ in keep}, None)


def part_layout(described: Described, names: frozenset[str],
                tensors: Mapping[str, torch.Tensor] | None = None) -> Callable[..., Described]:
    """A layout callable (``Refitter(src_layout=...)``) that describes part ``names``."""
    fixed = part_of(described, names, tensors)

    def layout(_model) -> Described:
        return fixed

    return layout
