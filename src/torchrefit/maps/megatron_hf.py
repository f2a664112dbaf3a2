"""Megatron-core names -> Hugging Face names (and vLLM's fused ones): :func:`megatron_to_hf`.

Called once, on every rank, to build the ``name_map`` passed to ``tr.Refitter``; the
planner then asks it, for each destination (engine) tensor, which row blocks of
which source (trainer) tensors fill it. Everything is region to region in global
coordinates, so no rank ever gathers a full tensor:

* ``q_proj`` / ``k_proj`` / ``v_proj`` are the per query-group row blocks of
  Megatron's ``linear_qkv`` (stored ``[q heads of group 0, k0, v0, q heads of
  group 1, ...]``); vLLM's fused ``qkv_proj`` is ``[all q; all k; all v]``;
* ``gate_proj`` / ``up_proj`` are the two halves of a gated ``linear_fc1``
  (globally ``[gate; up]``), and vLLM's ``gate_up_proj`` is all of it;
* norms, ``o_proj``, ``down_proj``, embeddings, the router and per-expert tensors
  are renames (``{}`` in the table stands for a layer or expert index);
* ``transformers`` 5 stacks a layer's experts: ``mlp.experts.gate_up_proj``
  ``[E, 2I, H]`` (gate first, as Megatron's gated ``linear_fc1``) and
  ``mlp.experts.down_proj`` ``[E, H, I]``; expert ``e`` is row ``e`` of dim 0.

:func:`hf_to_megatron` is the inverse, derived from the same table: a Megatron
tensor is made of the Hugging Face tensors whose rules read it.

The destination name decides between split and fused forms, so one map serves
Hugging Face models and vLLM / SGLang models alike. Names the table does not list
keep their own name (identity).
"""

from __future__ import annotations

import re
from collections.abc import Container, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..errors import PlanError
from ..layout._types import Box
from .base import NameMap, Segment, held_name, relocate, shape_of, table_rule

__all__ = ["MegatronToHF", "HfToMegatron", "megatron_to_hf", "hf_to_megatron", "HF_FROM_MEGATRON"]

_L = "decoder.layers.{}."
_QKV = (_L + "self_attention.linear_qkv.{w}",)
_FC1 = (_L + "mlp.linear_fc1.{w}",)
_EXPERT_FC1 = (_L + "mlp.experts.local_experts.{}.linear_fc1.{w}", _L + "mlp.experts.linear_fc1.{w}{}")
_EXPERT_FC2 = (_L + "mlp.experts.local_experts.{}.linear_fc2.{w}", _L + "mlp.experts.linear_fc2.{w}{}")
_STACKED_FC1 = (_L + "mlp.experts.local_experts.{}.linear_fc1.weight", _L + "mlp.experts.linear_fc1.weight{}")
_STACKED_FC2 = (_L + "mlp.experts.local_experts.{}.linear_fc2.weight", _L + "mlp.experts.linear_fc2.weight{}")
_SHARED_FC1 = (_L + "mlp.shared_experts.linear_fc1.{w}",)
_SHARED_FC2 = (_L + "mlp.shared_experts.linear_fc2.{w}",)

# Destination template -> (part, source templates). ``{}`` is a layer or expert index,
# ``{w}`` the leaf (``weight`` or ``bias``). Where Megatron names a tensor two ways
# (Transformer Engine's fused layer norms or the local spec; ``local_experts.K`` or
# grouped ``weightK``) the source names the first one present. ``part`` says which
# rows of the source the destination is (see ``_blocks``); ``stack``: dim 0 of the
# destination indexes experts, each a whole source tensor (the last ``{}``).
HF_FROM_MEGATRON: dict[str, tuple[str, tuple[str, ...]]] = {
    "model.embed_tokens.{w}": ("whole", ("embedding.word_embeddings.{w}",)),
    "lm_head.{w}": ("whole", ("output_layer.{w}",)),
    "model.norm.{w}": ("whole", ("decoder.final_layernorm.{w}",)),
    "model.layers.{}.input_layernorm.{w}": (
        "whole", (_L + "self_attention.linear_qkv.layer_norm_{w}", _L + "input_layernorm.{w}")),
    "model.layers.{}.post_attention_layernorm.{w}": (
        "whole", (_L + "mlp.linear_fc1.layer_norm_{w}", _L + "pre_mlp_layernorm.{w}")),
    "model.layers.{}.self_attn.q_proj.{w}": ("q", _QKV),
    "model.layers.{}.self_attn.k_proj.{w}": ("k", _QKV),
    "model.layers.{}.self_attn.v_proj.{w}": ("v", _QKV),
    "model.layers.{}.self_attn.qkv_proj.{w}": ("qkv", _QKV),
    "model.layers.{}.self_attn.o_proj.{w}": ("whole", (_L + "self_attention.linear_proj.{w}",)),
    "model.layers.{}.self_attn.q_norm.{w}": ("whole", (_L + "self_attention.q_layernorm.{w}",)),
    "model.layers.{}.self_attn.k_norm.{w}": ("whole", (_L + "self_attention.k_layernorm.{w}",)),
    "model.layers.{}.mlp.gate_proj.{w}": ("gate", _FC1),
    "model.layers.{}.mlp.up_proj.{w}": ("up", _FC1),
    "model.layers.{}.mlp.gate_up_proj.{w}": ("whole", _FC1),
    "model.layers.{}.mlp.down_proj.{w}": ("whole", (_L + "mlp.linear_fc2.{w}",)),
    # MoE: Qwen2-MoE and DeepSeek names (router, experts, shared experts).
    "model.layers.{}.mlp.gate.{w}": ("whole", (_L + "mlp.router.{w}",)),
    "model.layers.{}.mlp.gate.e_score_correction_bias": ("whole", (_L + "mlp.router.expert_bias",)),
    "model.layers.{}.mlp.experts.{}.gate_proj.{w}": ("gate", _EXPERT_FC1),
    "model.layers.{}.mlp.experts.{}.up_proj.{w}": ("up", _EXPERT_FC1),
    "model.layers.{}.mlp.experts.{}.gate_up_proj.{w}": ("whole", _EXPERT_FC1),
    "model.layers.{}.mlp.experts.{}.down_proj.{w}": ("whole", _EXPERT_FC2),
    # transformers 5 (Mixtral, Qwen2-MoE, Qwen3-MoE): a layer's experts stacked.
    "model.layers.{}.mlp.experts.gate_up_proj": ("stack", _STACKED_FC1),
    "model.layers.{}.mlp.experts.down_proj": ("stack", _STACKED_FC2),
    **{f"model.layers.{{}}.mlp.{shared}.{proj}.{{w}}": (part, srcs)
       for shared in ("shared_expert", "shared_experts")
       for proj, part, srcs in (("gate_proj", "gate", _SHARED_FC1), ("up_proj", "up", _SHARED_FC1),
                                ("gate_up_proj", "whole", _SHARED_FC1),
                                ("down_proj", "whole", _SHARED_FC2))},
    "model.layers.{}.mlp.shared_expert_gate.{w}": ("whole", (_L + "mlp.shared_experts.gate_{w}",)),
}

_LINEAR_QKV = re.compile(r"linear_qkv\.(weight|bias)$")


@dataclass(frozen=True)
class MegatronToHF(NameMap):
    """Hugging Face / vLLM destination names from Megatron-core source names.

    ``head_dim`` None: read from the tensors' shapes. Either way every q/k/v tensor
    is checked against the source's ``linear_qkv`` rows and ``linear_proj`` columns,
    and ``segments`` raises :class:`PlanError` naming the tensor where they do not fit
    the head counts; the planner runs it on every rank over the same rosters, so
    every rank raises. Shapes cannot tell 4 heads in 2 groups from 2 heads in 1 group
    of twice the head dim: give ``head_dim`` (Megatron's ``kv_channels``) to rule
    that out.
    """

    num_heads: int
    num_query_groups: int
    head_dim: int | None = None

    def __post_init__(self) -> None:
        h, g, d = self.num_heads, self.num_query_groups, self.head_dim
        if h < 1 or g < 1 or (d is not None and d < 1):
            raise ValueError(f"megatron_to_hf: num_heads {h}, num_query_groups {g} and "
                             f"head_dim {d} must be positive")
        if h % g:
            raise ValueError(f"megatron_to_hf: num_heads {h} is not a multiple of "
                             f"num_query_groups {g} (each query group holds whole heads)")

    def segments(
        self,
        dst_name: str,
        dst_shape: tuple[int, ...],
        src_names: Container[str],
        src_aliases: Mapping[str, str],
    ) -> list[Segment] | None:
        rule = _rule(dst_name)
        if rule is None:
            return super().segments(dst_name, dst_shape, src_names, src_aliases)
        part, templates, indices, leaf = rule
        dst_shape = tuple(dst_shape)
        if part == "stack":
            return _stacked(dst_name, dst_shape, templates, indices, src_names, src_aliases)
        src = _source(templates, indices, leaf, src_names, src_aliases)
        if src is None:
            return None
        if part == "whole":
            return [Segment(Box.whole(dst_shape), src, (0,) * len(dst_shape))]
        return self._row_blocks(dst_name, dst_shape, part, src, src_names)

    def _row_blocks(self, dst_name: str, dst_shape: tuple[int, ...], part: str, src: str,
                    src_names: Container[str]) -> list[Segment]:
        """Segments of a destination that is some rows of ``src`` (q/k/v, gate/up)."""
        src_shape = shape_of(src_names, src)
        proj = _LINEAR_QKV.sub("linear_proj.weight", src) if part in _HEADS_IN else None
        proj_shape = shape_of(src_names, proj) if proj is not None else None
        blocks, problem = _blocks(part, self.num_heads, self.num_query_groups, self.head_dim,
                                  dst_shape, src_shape, proj_shape[1] if proj_shape else None)
        if problem:
            seen = f"source {src} {list(src_shape) if src_shape else '?'}"
            if proj_shape:
                seen += f", {proj} {list(proj_shape)}"
            raise PlanError(f"{dst_name}: {problem} ({seen}, destination {list(dst_shape)})")
        rest = dst_shape[1:]
        zeros = (0,) * len(rest)
        return [Segment(Box((d,) + zeros, (n,) + rest), src, (s,) + zeros, part=True)
                for d, s, n in blocks]

    def wanted(self, dst_name: str) -> tuple[str, ...]:
        rule = _rule(dst_name)
        if rule is None:
            return (dst_name,)
        part, templates, indices, leaf = rule
        if part == "stack":
            indices = indices + ("0",)  # expert 0 stands for them all
        return tuple(t.format(*indices, w=leaf) for t in templates)

    def source_shape(self, dst_name, src_names, src_aliases):
        rule = _rule(dst_name)
        if rule is None:
            return super().source_shape(dst_name, src_names, src_aliases)
        part, templates, indices, leaf = rule
        if part != "whole":
            return None
        return shape_of(src_names, _source(templates, indices, leaf, src_names, src_aliases))

    def cache_key(self) -> object:
        return (type(self).__qualname__, self.num_heads, self.num_query_groups, self.head_dim)


@dataclass(frozen=True)
class HfToMegatron(NameMap):
    """The inverse of :class:`MegatronToHF`: Megatron-core destination names from Hugging
    Face (or vLLM-fused) source names, derived from the same table.

    A Megatron tensor is made of the Hugging Face tensors whose rules read it, in table
    order (split ``q_proj`` / ``k_proj`` / ``v_proj`` before a fused ``qkv_proj``),
    each placed where the forward map would read it; a tensor that would cover rows
    already covered is passed over, so whichever form the source holds fills it.
    """

    forward: MegatronToHF

    def segments(self, dst_name, dst_shape, src_names, src_aliases):
        readers = _readers(dst_name)
        if not readers:
            return super().segments(dst_name, dst_shape, src_names, src_aliases)
        target = {dst_name: _Shape(tuple(dst_shape))}
        covered: list[Box] = []
        out: list[Segment] = []
        for hf_name, expert in readers:
            src = hf_name if hf_name in src_names else src_aliases.get(hf_name)
            shape = shape_of(src_names, src) if src is not None else None
            if shape is None:
                continue
            if expert is not None:  # one expert of a stacked tensor: its row of dim 0
                if shape[1:] != tuple(dst_shape):
                    raise PlanError(f"{dst_name}: expert {expert} of {src} {list(shape)} is not "
                                    f"{list(dst_shape)}")
                box = Box.whole(tuple(dst_shape))
                if any(box.intersect(c) is not None for c in covered):
                    continue
                covered.append(box)
                out.append(Segment(box, src, (expert,) + box.offset, part=True))
                continue
            mine = [f for f in self.forward.segments(hf_name, shape, target, {}) or ()
                    if f.src_name == dst_name]
            boxes = [relocate(f.dst_box, f.dst_box.offset, f.src_offset) for f in mine]
            if not boxes or any(b.intersect(c) is not None for b in boxes for c in covered):
                continue
            covered += boxes
            out += [Segment(b, src, f.dst_box.offset, part=True) for b, f in zip(boxes, mine)]
        return out or None

    def wanted(self, dst_name: str) -> tuple[str, ...]:
        return tuple(name for name, _ in _readers(dst_name)) or (dst_name,)

    def cache_key(self) -> object:
        return (type(self).__qualname__, self.forward.cache_key())


@dataclass(frozen=True)
class _Shape:
    shape: tuple[int, ...]


@lru_cache(maxsize=8192)
def _readers(megatron_name: str) -> tuple[tuple[str, int | None], ...]:
    """Hugging Face names whose rules in the table read ``megatron_name``, in table order,
    with the expert index where the name stacks experts."""
    out: list[tuple[str, int | None]] = []
    for hf_template, (part, templates) in HF_FROM_MEGATRON.items():
        for template in templates:
            m = _source_regex(template).fullmatch(megatron_name)
            if m is None:
                continue
            indices = [g for g in m.groups() if g not in ("weight", "bias")]
            leaf = m.groupdict().get("w") or ""
            expert = None
            if part == "stack":  # the expert is a row of the stacked tensor
                expert = int(indices.pop())
            item = (hf_template.format(*indices, w=leaf), expert)
            if item not in out:
                out.append(item)
    return tuple(out)


@lru_cache(maxsize=256)
def _source_regex(template: str) -> re.Pattern[str]:
    pattern = re.escape(template).replace(re.escape("{w}"), "(?P<w>weight|bias)")
    return re.compile(pattern.replace(re.escape("{}"), r"(\d+)"))


def hf_to_megatron(config: Mapping[str, Any] | object | None = None, **kwargs) -> HfToMegatron:
    """The name map from a Hugging Face-named trainer to a Megatron-core engine: the
    inverse of :func:`megatron_to_hf` with the same arguments."""
    return HfToMegatron(megatron_to_hf(config, **kwargs))


def megatron_to_hf(
    config: Mapping[str, Any] | object | None = None,
    *,
    num_heads: int | None = None,
    num_query_groups: int | None = None,
    head_dim: int | None = None,
) -> MegatronToHF:
    """The name map from a Megatron-core trainer to a Hugging Face-named engine.

    ``config`` is a Megatron ``TransformerConfig``, a Hugging Face config or a dict
    with their field names (``num_attention_heads``; ``num_query_groups`` or
    ``num_key_value_heads``, None meaning one group per head; ``kv_channels`` or
    ``head_dim``); keywords override it. Call it on every rank with the same values.
    """
    heads = num_heads if num_heads is not None else _field(config, "num_attention_heads")
    if heads is None:
        raise ValueError("megatron_to_hf: give num_heads (or a config with num_attention_heads)")
    groups = num_query_groups if num_query_groups is not None else _field(
        config, "num_query_groups", "num_key_value_heads")
    dim = head_dim if head_dim is not None else _field(config, "kv_channels", "head_dim")
    return MegatronToHF(int(heads), int(groups if groups is not None else heads),
                        int(dim) if dim is not None else None)


def _stacked(dst_name: str, dst_shape: tuple[int, ...], templates, indices, src_names,
             src_aliases) -> list[Segment] | None:
    """Expert ``e`` of a stacked ``[E, ...]`` destination is source expert ``e`` whole."""
    if len(dst_shape) < 2:
        raise PlanError(f"{dst_name}: stacked experts need [experts, ...], not {list(dst_shape)}")
    rest = dst_shape[1:]
    zeros = (0,) * len(rest)
    out = []
    for e in range(dst_shape[0]):
        src = _source(templates, indices + (str(e),), "weight", src_names, src_aliases)
        if src is None:
            return None
        shape = shape_of(src_names, src)
        if shape is not None and shape != rest:
            raise PlanError(f"{dst_name}: expert {e} is {src} {list(shape)}, but the stacked "
                            f"destination {list(dst_shape)} holds experts of {list(rest)}")
        out.append(Segment(Box((e,) + zeros, (1,) + rest), src, zeros, part=True))
    return out


def _field(config, *names: str):
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    return None


@lru_cache(maxsize=4096)
def _rule(dst_name: str) -> tuple[str, tuple[str, ...], tuple[str, ...], str] | None:
    """The table's rule for a destination name: (part, source templates, indices, leaf)."""
    return table_rule(dst_name, HF_FROM_MEGATRON)


def _source(templates, indices, leaf, src_names: Container[str],
            src_aliases: Mapping[str, str]) -> str | None:
    for template in templates:
        name = held_name(template.format(*indices, w=leaf), src_names, src_aliases)
        if name is not None:
            return name
    return None


@lru_cache(maxsize=1024)
def _blocks(part: str, heads: int, groups: int, head_dim: int | None,
            dst_shape: tuple[int, ...], src_shape: tuple[int, ...] | None,
            proj_cols: int | None = None) -> tuple[tuple[tuple[int, int, int], ...], str | None]:
    """Row blocks ``(dst row, src row, rows)`` of a split or fused tensor, or a problem.

    Layers repeat the same shapes, so each geometry is worked out once.
    """
    if not dst_shape:
        return (), "a scalar cannot be split by rows"
    if src_shape is not None and (len(src_shape) != len(dst_shape) or src_shape[1:] != dst_shape[1:]):
        return (), "source and destination differ beyond dim 0"
    rows = dst_shape[0]
    if part in ("gate", "up"):
        if src_shape is not None and src_shape[0] != 2 * rows:
            return (), (f"a gated linear_fc1 is [gate; up]: its {src_shape[0]} rows must be twice "
                        f"the destination's {rows}")
        return ((0, rows if part == "up" else 0, rows),), None
    d, problem = _head_dim(part, heads, groups, head_dim, rows, src_shape, proj_cols)
    if problem:
        return (), problem
    return _qkv_blocks(part, heads, groups, d), None


_HEADS_IN = {"q": lambda h, g: h, "k": lambda h, g: g, "v": lambda h, g: g,
             "qkv": lambda h, g: h + 2 * g}


def _head_dim(part: str, heads: int, groups: int, head_dim: int | None, rows: int,
              src_shape: tuple[int, ...] | None, proj_cols: int | None) -> tuple[int, str | None]:
    """The head dim that the destination's rows, ``linear_qkv``'s rows, ``linear_proj``'s
    columns and ``head_dim`` all agree on.

    Shapes alone cannot tell 4 heads in 2 groups from 2 heads in 1 group of twice the
    head dim; ``head_dim`` (Megatron's ``kv_channels``) settles that.
    """
    n = _HEADS_IN[part](heads, groups)
    d = head_dim if head_dim is not None else rows // n
    fits = d > 0 and rows == n * d
    if fits and src_shape is not None:
        fits = src_shape[0] == (heads + 2 * groups) * d
    if fits and proj_cols is not None:
        fits = proj_cols == heads * d
    if fits:
        return d, None
    return 0, (f"shapes do not fit num_heads={heads}, num_query_groups={groups}, "
               f"head_dim={head_dim}: {part}_proj rows must be {_rows_rule(part)} * head_dim, "
               "linear_qkv rows (num_heads + 2 * num_query_groups) * head_dim and linear_proj "
               "columns num_heads * head_dim")


def _rows_rule(part: str) -> str:
    return {"q": "num_heads", "k": "num_query_groups", "v": "num_query_groups",
            "qkv": "(num_heads + 2 * num_query_groups)"}[part]


def _qkv_blocks(part: str, heads: int, groups: int, d: int) -> tuple[tuple[int, int, int], ...]:
    """Megatron keeps each query group's heads together, ``[q x heads/groups, k, v]``;
    Hugging Face keeps each kind together, ``[q heads | k heads | v heads]``."""
    per = heads // groups
    group_rows = (per + 2) * d
    q = [(g * per * d, g * group_rows, per * d) for g in range(groups)]
    k = [(g * d, g * group_rows + per * d, d) for g in range(groups)]
    v = [(g * d, g * group_rows + (per + 1) * d, d) for g in range(groups)]
    if part != "qkv":
        return tuple({"q": q, "k": k, "v": v}[part])
    k_at, v_at = heads * d, (heads + groups) * d
    return tuple(q + [(k_at + o, s, n) for o, s, n in k] + [(v_at + o, s, n) for o, s, n in v])
