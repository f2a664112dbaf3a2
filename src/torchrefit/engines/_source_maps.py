"""The trainer namings torchrefit's vLLM backend takes, and what its sink is fed.

The trainer passes the map from its own names to vLLM's, as it would to
``tr.Refitter``: :func:`~torchrefit.maps.hf_to_vllm` for a Hugging Face-named
trainer, :func:`~torchrefit.maps.torchtitan_to_vllm` or
:func:`~torchrefit.maps.megatron_to_vllm` (``Compose(HfToVllm, <trainer> -> Hugging
Face)``) for the others. The engine's workers rebuild it: the Hugging Face -> vLLM
part from the engine's own config, the trainer's part from a *description* that
crosses vLLM's init info as plain JSON (``vllm serve`` carries it over HTTP).

* :func:`describe_source` (trainer rank 0): the description of the trainer's part,
  None for Hugging Face names; a ``TypeError`` for a map the backend cannot carry;
* :func:`source_map_from` (every engine worker): the map again, from a description
  checked against :data:`SOURCE_MAPS` (a known kind, exactly its declared fields, each
  of its declared type), then the map's own validation; a ``PlanError`` otherwise;
* :func:`route_maps`: the map each route refits with (the in-place route: the whole
  map; the ``load_weights`` route: the trainer's part alone, since vLLM's
  ``load_weights`` takes Hugging Face names);
* :func:`sink_tensors`: the Hugging Face tensors ``load_weights`` is fed for the vLLM
  tensors routed through it, checked against what the trainer holds.

Pure: no vLLM import, so the engine-side reconstruction is tested without an engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..errors import PlanError
from ..maps.base import Compose, NameMap, table_rule
from ..maps.hf_vllm import VLLM_FROM_HF, HfToVllm
from ..maps.megatron_hf import MegatronToHF
from ..maps.torchtitan import TorchtitanToHF

__all__ = ["SOURCE_MAPS", "describe_source", "source_map_from", "compose", "route_maps",
           "vllm_part", "sink_tensors"]

#: kind -> (map class, {field: the JSON types it may take}): the trainer namings other
#: than Hugging Face's that the backend carries to its engine
SOURCE_MAPS: dict[str, tuple[type[NameMap], dict[str, tuple[type, ...]]]] = {
    "torchtitan_to_hf": (TorchtitanToHF, {"num_heads": (int,), "num_kv_heads": (int,),
                                          "permute_rope": (bool,)}),
    "megatron_to_hf": (MegatronToHF, {"num_heads": (int,), "num_query_groups": (int,),
                                      "head_dim": (int, type(None))}),
}
_USE = ("name_map must map the trainer's names to vLLM's: tr.maps.hf_to_vllm(config) for "
        "Hugging Face names, tr.maps.torchtitan_to_vllm(model_config) for a torchtitan "
        "trainer, tr.maps.megatron_to_vllm(config) for a Megatron-core one")


def describe_source(name_map: NameMap) -> dict[str, Any] | None:
    """Trainer side: the JSON description of ``name_map``'s trainer part (None: the
    trainer names its tensors the Hugging Face way)."""
    if isinstance(name_map, HfToVllm):
        return None
    if isinstance(name_map, Compose) and isinstance(name_map.outer, HfToVllm):
        for kind, (cls, fields) in SOURCE_MAPS.items():
            if type(name_map.inner) is cls:
                return {"kind": kind, **{f: getattr(name_map.inner, f) for f in fields}}
    raise TypeError(f"torchrefit's vLLM backend cannot carry a {_shown(name_map)} to the "
                    f"engine: {_USE}")


def source_map_from(description: Mapping[str, Any] | None) -> NameMap | None:
    """Engine side: the trainer's part of the map from its description (None: Hugging
    Face names). Raises :class:`PlanError` for anything but a declared description."""
    if description is None:
        return None
    kind = description.get("kind") if isinstance(description, Mapping) else None
    if kind not in SOURCE_MAPS:
        raise PlanError(f"the trainer's source map {description!r} is not one the engine "
                        f"builds (kinds: {', '.join(SOURCE_MAPS)}): {_USE}", rule="source map")
    cls, fields = SOURCE_MAPS[kind]
    given = {k: v for k, v in description.items() if k != "kind"}
    if set(given) != set(fields):
        raise PlanError(f"the trainer's source map {kind}: fields {sorted(given)}, not "
                        f"{sorted(fields)} (trainer and engine run other torchrefit "
                        "versions?)", rule="source map")
    for name, value in given.items():
        types = fields[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise PlanError(f"the trainer's source map {kind}: {name}={value!r} is not "
                            f"{' or '.join(t.__name__ for t in types)}", rule="source map")
    try:
        return cls(**given)
    except ValueError as e:
        raise PlanError(f"the trainer's source map {kind}: {e}", rule="source map") from e


def compose(vllm_map: HfToVllm, source: NameMap | None) -> NameMap:
    """The whole map: vLLM's part after the trainer's (just vLLM's for Hugging Face names)."""
    return vllm_map if source is None else Compose(vllm_map, source)


def vllm_part(name_map: NameMap) -> HfToVllm:
    """The Hugging Face -> vLLM part of a map :func:`describe_source` accepts."""
    return name_map.outer if isinstance(name_map, Compose) else name_map


def route_maps(name_map: NameMap) -> dict[str, NameMap]:
    """The map each route refits with: ``"direct"`` (into vLLM's tensors) the whole map;
    ``"load_weights"`` (into Hugging Face-named tensors) the trainer's part, or the whole
    map for a Hugging Face-named trainer (on those names it renames nothing)."""
    inner = name_map.inner if isinstance(name_map, Compose) else name_map
    return {"direct": name_map, "load_weights": inner}


def sink_tensors(name_map: NameMap, dst: Mapping[str, tuple[int, ...]],
                 src: Mapping[str, tuple[tuple[int, ...], str]]
                 ) -> list[tuple[str, tuple[int, ...], str]]:
    """What vLLM's ``load_weights`` is fed for the vLLM tensors ``dst`` (global shapes)
    routed through it: ``(Hugging Face name, global shape, dtype name)``, in order.
    ``src``: the trainer's ``{name: (global shape, dtype name)}``. A Hugging Face-named
    trainer's own tensors; for another trainer, the Hugging Face tensors its map makes
    of them. Raises :class:`PlanError` naming the first vLLM tensor with no source or a
    source of another shape."""
    shapes = {n: torch.empty(s, device="meta") for n, (s, _) in src.items()}
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    split = (Compose(_SplitNames(name_map.outer), name_map.inner)
             if isinstance(name_map, Compose) else None)
    for name, shape in dst.items():
        if split is not None:
            wholes = split.intermediates(name, tuple(shape), shapes, {})
            if wholes is None:
                raise _no_source(name, name_map)
            for hf, hf_shape in wholes:
                if hf not in out:
                    out[hf] = _made_by(name, hf, hf_shape, name_map.inner, shapes, src)
            continue
        segs = name_map.segments(name, tuple(shape), shapes, {})
        if segs is None:
            raise _no_source(name, name_map)
        for seg in segs:
            got = tuple(src[seg.src_name][0])
            if not seg.part and got != tuple(shape):
                raise PlanError(f"{name}: vLLM tensor of global shape {list(shape)} is fed "
                                f"whole by the trainer's {seg.src_name} of shape {list(got)}",
                                tensor=name, rule="global shape")
            out.setdefault(seg.src_name, (got, src[seg.src_name][1]))
    return [(n, s, d) for n, (s, d) in out.items()]


class _SplitNames(NameMap):
    """vLLM's part of the map as ``load_weights`` is fed: fused tensors (``qkv_proj``,
    ``gate_up_proj``) from their split Hugging Face parts, even where the trainer's map
    could make the fused one itself (``megatron_to_hf`` makes ``qkv_proj``)."""

    def __init__(self, outer: NameMap) -> None:
        self.outer = outer

    def segments(self, dst_name, dst_shape, src_names, src_aliases):
        rule = table_rule(dst_name, VLLM_FROM_HF)
        if rule is not None and rule[0] in ("qkv", "halves"):
            src_names = _Without(src_names, dst_name)
        return self.outer.segments(dst_name, dst_shape, src_names, src_aliases)

    def wanted(self, dst_name: str) -> tuple[str, ...]:
        return self.outer.wanted(dst_name)


class _Without(Mapping):
    """``names`` without ``hidden``."""

    def __init__(self, names: Mapping, hidden: str) -> None:
        self.names, self.hidden = names, hidden

    def __contains__(self, name: object) -> bool:
        return name != self.hidden and name in self.names

    def __getitem__(self, name: str):
        if name == self.hidden:
            raise KeyError(name)
        return self.names[name]

    def get(self, name, default=None):
        return default if name == self.hidden else self.names.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return (n for n in self.names if n != self.hidden)

    def __len__(self) -> int:
        return len(self.names) - (self.hidden in self.names)


def _made_by(name: str, hf: str, hf_shape: tuple[int, ...], inner: NameMap,
             shapes: Mapping[str, torch.Tensor], src: Mapping[str, tuple[tuple[int, ...], str]]
             ) -> tuple[tuple[int, ...], str]:
    """``hf``'s shape and dtype, once the trainer's map is found to fill it."""
    segs = inner.segments(hf, hf_shape, shapes, {})
    if not segs:
        wanted = " or ".join(map(repr, inner.wanted(hf) or (hf,)))
        raise PlanError(f"{name}: vLLM tensor (routed through load_weights) is made of the "
                        f"Hugging Face {hf}, which {type(inner).__name__} reads from {wanted}; "
                        f"the trainer holds none of them. {_USE}", tensor=name,
                        rule="no source")
    for seg in segs:
        got = tuple(src[seg.src_name][0])
        if not seg.part and got != tuple(hf_shape):
            raise PlanError(f"{name}: its Hugging Face part {hf} of global shape "
                            f"{list(hf_shape)} is the trainer's {seg.src_name} of shape "
                            f"{list(got)}", tensor=name, rule="global shape")
    return tuple(hf_shape), src[segs[0].src_name][1]


def _no_source(name: str, name_map: NameMap) -> PlanError:
    wanted = " or ".join(map(repr, name_map.wanted(name) or (name,)))
    return PlanError(f"{name}: vLLM tensor (routed through load_weights) has no source tensor "
                     f"(the trainer holds no {wanted}). {_USE}", tensor=name, rule="no source")


def _shown(name_map: object) -> str:
    if isinstance(name_map, Compose):
        return (f"Compose({type(name_map.outer).__name__}, "
                f"{type(name_map.inner).__name__})")
    return type(name_map).__name__
