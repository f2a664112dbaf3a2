"""Name maps: how destination global tensors are made of source global tensors.

A name map answers, for one destination global tensor, which regions of which
source global tensors fill it (:class:`Segment`, region to region in global
coordinates). The default, :class:`Identity`, takes each destination tensor from
the source tensor of the same name, or from the tensor that name aliases on the
source (a tied ``output_layer.weight`` is served from the word embedding).
:class:`Rename` is a flat table with ``{}`` layer templates, for engines whose
names differ from the trainer's. :func:`megatron_to_hf` (in :mod:`.maps_hf`) maps a
Megatron-core trainer onto a Hugging Face-named engine (Llama / Qwen2 / Mistral,
Qwen2-MoE / DeepSeek MoE names, vLLM's fused ``qkv_proj`` and ``gate_up_proj``):
it splits ``linear_qkv`` by query group and ``linear_fc1`` into gate and up as
row blocks, so no rank gathers a full tensor.

The planner calls :meth:`NameMap.segments` on every rank, for every destination
tensor, with the same arguments everywhere; a map that finds the shapes do not fit
raises :class:`~torchrefit.PlanError`, which the planner reports on every rank.
"""

from __future__ import annotations

import re
from collections.abc import Container, Mapping
from dataclasses import dataclass
from functools import lru_cache

from .layout._types import Box

__all__ = ["Segment", "NameMap", "Identity", "Rename", "MegatronToHF", "megatron_to_hf"]


@dataclass(frozen=True, slots=True)
class Segment:
    """Destination region ``dst_box`` comes from ``src_name`` at ``src_offset`` (same extents).

    ``part``: the map means the destination to be a part of a larger source (a row
    block of a fused tensor). Otherwise a segment covering the whole destination
    requires equal global shapes, so a plain rename never silently takes a corner of
    a bigger tensor.
    """

    dst_box: Box
    src_name: str
    src_offset: tuple[int, ...]
    part: bool = False


class NameMap:
    """Base class. Subclasses implement :meth:`source_name` or :meth:`segments`."""

    def source_name(self, dst_name: str) -> str | None:
        return dst_name

    def wanted(self, dst_name: str) -> tuple[str, ...]:
        """The source names this map would read for ``dst_name`` (for error messages)."""
        name = self.source_name(dst_name)
        return (name,) if name is not None else ()

    def segments(
        self,
        dst_name: str,
        dst_shape: tuple[int, ...],
        src_names: Container[str],
        src_aliases: Mapping[str, str],
    ) -> list[Segment] | None:
        """Segments covering the destination tensor, or None where nothing can feed it.

        ``src_names`` holds the source's global tensor names; the planner passes a
        mapping whose values have the global ``shape``, which maps may check.
        """
        name = self.source_name(dst_name)
        if name is None:
            return None
        if name not in src_names:
            name = src_aliases.get(name)
            if name is None or name not in src_names:
                return None
        return [Segment(_whole(tuple(dst_shape)), name, (0,) * len(dst_shape))]

    def cache_key(self) -> object:
        """What identifies this map's behaviour, for plan caches."""
        return (type(self).__qualname__,)


class Identity(NameMap):
    """Each destination tensor comes whole from the source tensor of the same name."""


class Rename(NameMap):
    """A flat table ``{dst template: src template}``; ``{}`` stands for an index (a layer).

    Names the table does not match keep their own name, so a table lists only the
    names that differ.
    """

    def __init__(self, table: Mapping[str, str]) -> None:
        self.table = dict(table)
        self._rules = [(_template_regex(d), s) for d, s in self.table.items()]

    def source_name(self, dst_name: str) -> str | None:
        for regex, src in self._rules:
            m = regex.fullmatch(dst_name)
            if m is not None:
                return src.format(*m.groups())
        return dst_name

    def cache_key(self) -> object:
        return (type(self).__qualname__, tuple(sorted(self.table.items())))


@lru_cache(maxsize=1024)
def _whole(shape: tuple[int, ...]) -> Box:
    return Box.whole(shape)  # boxes are immutable: one per shape serves every layer


def _template_regex(template: str) -> re.Pattern[str]:
    parts = template.split("{}")
    return re.compile(r"(\d+)".join(re.escape(p) for p in parts))


# After the base classes: the Megatron -> Hugging Face map builds on them.
from .maps_hf import MegatronToHF, megatron_to_hf  # noqa: E402
