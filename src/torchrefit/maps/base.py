"""The name map interface and the plain maps: :class:`Segment`, :class:`NameMap`,
:class:`Identity`, :class:`Rename`, :class:`Compose` and :func:`relocate`.

A name map answers, for one destination global tensor, which regions of which
source global tensors fill it (:class:`Segment`, region to region in global
coordinates). The default, :class:`Identity`, takes each destination tensor from
the source tensor of the same name, or from the tensor that name aliases on the
source (a tied ``output_layer.weight`` is served from the word embedding).
:class:`Rename` is a flat table with ``{}`` layer templates, for engines whose
names differ from the trainer's. The maps of particular frameworks live in modules
of their own next to this one and build on these classes (:mod:`.megatron_hf`,
:mod:`.vllm`, :mod:`.torchtitan`); this module imports none of them.

The planner calls :meth:`NameMap.segments` on every rank, for every destination
tensor, with the same arguments everywhere; a map that finds the shapes do not fit
raises :class:`~torchrefit.PlanError`, which the planner reports on every rank.
"""

from __future__ import annotations

import re
from collections.abc import Container, Mapping
from dataclasses import dataclass
from functools import lru_cache

from ..errors import PlanError
from ..layout._types import Box

__all__ = ["Segment", "NameMap", "Identity", "Rename", "Compose", "relocate"]


@dataclass(frozen=True, slots=True)
class Segment:
    """Destination region ``dst_box`` comes from ``src_name`` at ``src_offset`` (same extents).

    ``src_offset`` has the source's number of dims. Where the two tensors differ in
    number of dims, the longer one's leading dims are unit dims of the region: one
    expert ``[2I, H]`` is ``dst_box`` ``[e:e+1, 0:2I, 0:H]`` of a stacked ``[E, 2I, H]``
    (see :func:`relocate`).

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

    def source_shape(self, dst_name: str, src_names: Container[str],
                     src_aliases: Mapping[str, str]) -> tuple[int, ...] | None:
        """The shape ``dst_name`` has where this map takes it whole from one source
        tensor whose shape ``src_names`` gives (else None); :class:`Compose` asks."""
        name = self.source_name(dst_name)
        return shape_of(src_names, held_name(name, src_names, src_aliases) if name else None)

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
        name = held_name(name, src_names, src_aliases) if name is not None else None
        if name is None:
            return None
        whole = _whole(tuple(dst_shape))
        return [Segment(whole, name, whole.offset)]

    def padding(self, dst_name: str, dst_shape: tuple[int, ...], src_names: Container[str],
                src_aliases: Mapping[str, str]) -> tuple[Box, ...]:
        """Regions of the destination that no source feeds and a refit leaves untouched
        (an engine's vocabulary padding rows); everything else must be covered."""
        return ()

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


class Compose(NameMap):
    """``outer`` after ``inner``: the destination is named as ``outer``'s destination,
    the source as ``inner``'s source, and ``outer``'s source names are an intermediate
    naming no rank holds (Megatron -> Hugging Face -> vLLM).

    ``outer`` sees the intermediate names ``inner`` can serve (:class:`_Through`), with
    their shapes where ``inner`` knows them; each of its segments must cover a whole
    intermediate tensor, whose own segments ``inner`` then gives. Called like any map,
    on every rank by the planner.
    """

    def __init__(self, outer: NameMap, inner: NameMap) -> None:
        self.outer = outer
        self.inner = inner

    def segments(self, dst_name, dst_shape, src_names, src_aliases):
        outer = self._wholes(dst_name, dst_shape, src_names, src_aliases)
        if outer is None:
            return None
        out: list[Segment] = []
        for seg, box in outer:
            inner = self.inner.segments(seg.src_name, box.size, src_names, src_aliases)
            if inner is None:
                return None
            out.extend(Segment(relocate(s.dst_box, box.offset, seg.dst_box.offset), s.src_name,
                               s.src_offset, part=True) for s in inner)
        return out

    def intermediates(self, dst_name: str, dst_shape: tuple[int, ...],
                      src_names: Container[str], src_aliases: Mapping[str, str],
                      ) -> list[tuple[str, tuple[int, ...]]] | None:
        """The intermediate tensors ``dst_name`` is made of: ``(name, global shape)`` in the
        order the outer map reads them, or None where nothing feeds it. For an engine that
        takes intermediate-named tensors itself (vLLM's ``load_weights`` takes Hugging
        Face names): it asks for these, and :attr:`inner` says how each is filled."""
        outer = self._wholes(dst_name, dst_shape, src_names, src_aliases)
        if outer is None:
            return None
        return list({seg.src_name: box.size for seg, box in outer}.items())

    def _wholes(self, dst_name, dst_shape, src_names, src_aliases
                ) -> list[tuple[Segment, Box]] | None:
        """The outer map's segments, each with the whole intermediate tensor it reads (a
        box at the origin); raises where a segment reads a part of one."""
        through = _Through(self.inner, src_names, src_aliases)
        outer = self.outer.segments(dst_name, dst_shape, through, {})
        if outer is None:
            return None
        out = []
        for seg in outer:
            box = relocate(seg.dst_box, seg.dst_box.offset, seg.src_offset)
            whole = self.inner.source_shape(seg.src_name, src_names, src_aliases)
            if any(box.offset) or (whole is not None and box.size != whole):
                raise self._part_error(dst_name, seg.src_name, box, whole)
            out.append((seg, box))
        return out

    def _part_error(self, dst_name: str, name: str, box: Box,
                    whole: tuple[int, ...] | None) -> PlanError:
        size = f" of {list(whole)}" if whole is not None else ""
        return PlanError(
            f"{dst_name}: {type(self.outer).__name__} reads {box} of the intermediate tensor "
            f"{name}{size}, a part of it; Compose(outer, inner) needs each of the outer "
            "map's segments to cover a whole tensor of the inner map's naming. Adapt: let "
            "the outer map read whole intermediate tensors (split or fuse in one map), or "
            "write one NameMap from the source names to the destination's",
            tensor=dst_name, rule="compose")

    def padding(self, dst_name, dst_shape, src_names, src_aliases):
        through = _Through(self.inner, src_names, src_aliases)
        return self.outer.padding(dst_name, dst_shape, through, {})

    def wanted(self, dst_name: str) -> tuple[str, ...]:
        return tuple(w for name in self.outer.wanted(dst_name) for w in self.inner.wanted(name))

    def cache_key(self) -> object:
        return (type(self).__qualname__, self.outer.cache_key(), self.inner.cache_key())


class _Through(Mapping):
    """The intermediate names of a :class:`Compose`: a name is there where the inner
    map finds a source for it; its value has a ``shape`` where the inner map renames a
    whole tensor (else None: the outer map works the shape out from its config)."""

    def __init__(self, inner: NameMap, src_names: Container[str], src_aliases: Mapping[str, str]):
        self.inner, self.src_names, self.src_aliases = inner, src_names, src_aliases

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and any(
            w in self.src_names or self.src_aliases.get(w) in self.src_names
            for w in self.inner.wanted(name))

    def get(self, name, default=None):
        if name not in self:
            return default
        return _Shaped(self.inner.source_shape(name, self.src_names, self.src_aliases))

    def __getitem__(self, name):
        if name not in self:
            raise KeyError(name)
        return self.get(name)

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


@dataclass(frozen=True)
class _Shaped:
    shape: tuple[int, ...] | None


def relocate(box: Box, origin: tuple[int, ...], target: tuple[int, ...]) -> Box:
    """``box``, given where ``origin`` is, moved to where ``target`` is.

    Where ``origin`` and ``target`` differ in number of dims, the longer side's leading
    dims are unit dims: dropped going to the shorter side, taken from ``target`` (size 1)
    going to the longer one. The planner and the maps use this one rule both ways.
    """
    if origin == target:
        return box  # an identity map's segments: no new box (~10^5 per rank at 16k)
    n, m = len(origin), len(target)
    if n == m:
        return box.moved(origin, target)
    if n > m:
        k = n - m
        assert all(s == 1 for s in box.size[:k]), f"{box}: leading dims are not unit dims"
        return Box(tuple(o - a + b for o, a, b in zip(box.offset[k:], origin[k:], target)),
                   box.size[k:])
    k = m - n
    return Box(tuple(target[:k]) + tuple(o - a + b for o, a, b in zip(box.offset, origin, target[k:])),
               (1,) * k + box.size)


@lru_cache(maxsize=1024)
def _whole(shape: tuple[int, ...]) -> Box:
    return Box.whole(shape)  # boxes are immutable: one per shape serves every layer


_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")
_LEAF = re.compile(r"\.(weight|bias)$")


def table_rule(dst_name: str, table: Mapping[str, tuple]) -> tuple | None:
    """The rule of a flat name table for ``dst_name``: (the entry's two fields, the
    layer/expert indices, the leaf). Table keys write indices as ``{}`` and a final
    ``.weight`` / ``.bias`` as ``.{w}``; megatron_to_hf and hf_to_vllm look up the same way."""
    indices = tuple(_INDEX.findall(dst_name))
    key = _INDEX.sub("{}", dst_name)
    leaf = ""
    m = _LEAF.search(key)
    if m is not None:
        leaf = m.group(1)
        key = key[: m.start()] + ".{w}"
    got = table.get(key)
    if got is None:
        return None
    return got[0], got[1], indices, leaf


def held_name(name: str, src_names: Container[str], src_aliases: Mapping[str, str]) -> str | None:
    """``name`` where the source holds it, else the tensor it is an alias of (a tied
    output layer is served by the word embedding), else None. Maps of this package share it."""
    if name in src_names:
        return name
    target = src_aliases.get(name)
    return target if target is not None and target in src_names else None


def shape_of(src_names: Container[str], name: str | None) -> tuple[int, ...] | None:
    """The source tensor's global shape where the caller passes shapes (the planner
    passes a mapping whose values have ``shape``), else None."""
    if name is None or not isinstance(src_names, Mapping):
        return None
    shape = getattr(src_names.get(name), "shape", None)
    return tuple(shape) if shape is not None else None


def _template_regex(template: str) -> re.Pattern[str]:
    parts = template.split("{}")
    return re.compile(r"(\d+)".join(re.escape(p) for p in parts))
