"""Hugging Face names -> vLLM's fused and stacked names: :func:`hf_to_vllm`.

Called once, on every rank, to build the ``name_map`` of a ``tr.Refitter`` whose
source is a Hugging Face-named trainer (FSDP2 or whole) and whose destination is a
vLLM-style engine. The planner asks it, per engine tensor, which source rows fill
which rows, in global coordinates:

* ``self_attn.qkv_proj`` is ``[q_proj; k_proj; v_proj]`` (weights and biases);
* ``mlp.gate_up_proj`` (and a shared expert's) is ``[gate_proj; up_proj]``;
* ``experts.w13_weight`` ``[E, 2I, H]`` is, per expert, ``[gate; up]`` and
  ``experts.w2_weight`` ``[E, H, I]`` its ``down``, from ``transformers`` 5's
  stacked ``mlp.experts.gate_up_proj`` / ``down_proj``, from per-expert
  ``mlp.experts.{e}.gate_proj`` ... (``transformers`` 4 Qwen MoE), or from
  Mixtral's ``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2`` (also under vLLM's
  ``experts.routed_experts.``);
* vLLM's engine state (attention ``_k_scale`` / ``_v_scale`` / ``_q_scale`` /
  ``_prob_scale``, rotary ``cos_sin_cache``; :data:`ENGINE_STATE`) is fed nothing and
  left as the engine has it, with no ``skip`` needed;
* ``embed_tokens`` and ``lm_head`` padded to the engine's vocabulary: the source's
  rows fill the first rows, the padding rows are left as the engine has them;
* every other name is its own source (identity).

:func:`megatron_to_vllm` is this map after :func:`~torchrefit.maps.megatron_to_hf`
(:class:`~torchrefit.maps.Compose`), not a third table.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..errors import PlanError
from ..layout._types import Box
from .base import Compose, NameMap, Segment, held_name, shape_of, table_rule
from .megatron_hf import _field, megatron_to_hf

__all__ = ["HfToVllm", "hf_to_vllm", "megatron_to_vllm", "VLLM_FROM_HF", "ENGINE_STATE",
           "is_engine_state"]

_A = "model.layers.{}.self_attn."
_M = "model.layers.{}.mlp."
_X = "model.layers.{}.block_sparse_moe.experts.{e}."
# vLLM 0.32 holds a MoE layer's stacked experts one module deeper (``experts.routed_experts``)
_ROUTED = ("", "routed_experts.")

#: vLLM's tensors that are engine state, not weights: attention scales (``_k_scale``,
#: ``_v_scale``, ``_q_scale``, ``_prob_scale``) and rotary caches. No trainer holds them;
#: :class:`HfToVllm` feeds them nothing and leaves them as the engine has them.
ENGINE_STATE = re.compile(r"(^|.*\.)(_(k|v|q|prob)_scale|cos_sin_cache|inv_freq)$")

# Destination template -> (rule, source forms). ``{}`` is the layer, ``{w}`` the leaf
# (weight or bias), ``{e}`` an expert. A form is a tuple of source templates read one
# after another along dim 0 of the destination (of each expert, for stacked rules); the
# first form whose tensors the source holds is used.
VLLM_FROM_HF: dict[str, tuple[str, tuple[tuple[str, ...], ...]]] = {
    _A + "qkv_proj.{w}": ("qkv", ((_A + "q_proj.{w}", _A + "k_proj.{w}", _A + "v_proj.{w}"),)),
    _M + "gate_up_proj.{w}": ("halves", ((_M + "gate_proj.{w}", _M + "up_proj.{w}"),)),
    **{_M + f"{s}.gate_up_proj.{{w}}": ("halves", ((_M + f"{s}.gate_proj.{{w}}", _M + f"{s}.up_proj.{{w}}"),))
       for s in ("shared_expert", "shared_experts")},
    **{f"model.layers.{{}}.{moe}.experts.{routed}w13_weight": ("experts", (
        (_M + "experts.gate_up_proj",),
        (_M + "experts.{e}.gate_proj.weight", _M + "experts.{e}.up_proj.weight"),
        (_X + "w1.weight", _X + "w3.weight")))
       for moe in ("mlp", "block_sparse_moe") for routed in _ROUTED},
    **{f"model.layers.{{}}.{moe}.experts.{routed}w2_weight": ("experts", (
        (_M + "experts.down_proj",),
        (_M + "experts.{e}.down_proj.weight",),
        (_X + "w2.weight",))) for moe in ("mlp", "block_sparse_moe") for routed in _ROUTED},
    "model.layers.{}.block_sparse_moe.gate.{w}": ("whole", (
        (_M + "gate.{w}",), ("model.layers.{}.block_sparse_moe.gate.{w}",))),
    "model.embed_tokens.{w}": ("vocab", (("model.embed_tokens.{w}",),)),
    "lm_head.{w}": ("vocab", (("lm_head.{w}",),)),
}



@dataclass(frozen=True)
class HfToVllm(NameMap):
    """vLLM destination names from Hugging Face source names (see the module docstring).

    ``num_heads`` / ``num_kv_heads`` place q, k and v in ``qkv_proj``: the head dim is
    its rows over ``num_heads + 2 * num_kv_heads``; source shapes, where known, must
    agree, else ``segments`` raises :class:`PlanError` naming the tensor.
    """

    num_heads: int
    num_kv_heads: int

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hf_to_vllm: num_heads {self.num_heads} must be a positive multiple "
                             f"of num_kv_heads {self.num_kv_heads}")

    def segments(self, dst_name, dst_shape, src_names, src_aliases):
        dst_shape = tuple(dst_shape)
        if is_engine_state(dst_name):
            return []  # all of it is padding (below): the engine's own values stay
        rule = _rule(dst_name)
        if rule is None or (rule[0] != "vocab" and dst_name in src_names):
            return super().segments(dst_name, dst_shape, src_names, src_aliases)
        kind, forms, layer, leaf = rule
        if kind == "vocab":
            return self._vocab(dst_name, dst_shape, forms[0][0].format(w=leaf), src_names, src_aliases)
        if kind == "experts":
            return _experts(dst_name, dst_shape, forms, layer, src_names, src_aliases)
        for form in forms:
            names = [held_name(t.format(*layer, w=leaf), src_names, src_aliases) for t in form]
            if None in names:
                continue
            if kind == "whole":
                return [Segment(Box.whole(dst_shape), names[0], (0,) * len(dst_shape))]
            rows = self._rows(dst_name, dst_shape, kind, names, src_names)
            return _stack_rows(dst_shape, names, rows)
        return None

    def _rows(self, dst_name, dst_shape, kind, names, src_names) -> list[int]:
        """Rows of each source in the destination, checked against known source shapes."""
        if not dst_shape:
            raise PlanError(f"{dst_name}: a scalar cannot be fused from rows")
        n = dst_shape[0]
        if kind == "halves":
            counts = [1, 1]
        else:
            counts = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        unit, rest = divmod(n, sum(counts))
        rows = [c * unit for c in counts]
        shapes = [shape_of(src_names, s) for s in names]
        want = [(r,) + dst_shape[1:] for r in rows]
        if rest or any(s is not None and s != w for s, w in zip(shapes, want)):
            got = ", ".join(f"{s} {list(sh) if sh else '?'}" for s, sh in zip(names, shapes))
            rule = ("[gate; up] of equal halves" if kind == "halves" else
                    f"[q; k; v] with num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}")
            raise PlanError(f"{dst_name}: destination {list(dst_shape)} is not {rule} of "
                            f"its sources ({got})")
        return rows

    def _vocab(self, dst_name, dst_shape, src_template, src_names, src_aliases):
        src = held_name(src_template, src_names, src_aliases)
        if src is None:
            return None
        shape = shape_of(src_names, src) or dst_shape
        if len(shape) != len(dst_shape) or shape[1:] != dst_shape[1:] or shape[0] > dst_shape[0]:
            raise PlanError(f"{dst_name}: the engine's vocabulary {list(dst_shape)} cannot hold "
                            f"the source's {src} {list(shape)} (padding only adds rows)")
        return [Segment(Box.whole(shape), src, (0,) * len(shape), part=shape != dst_shape)]

    def padding(self, dst_name, dst_shape, src_names, src_aliases):
        if is_engine_state(dst_name):
            return (Box.whole(tuple(dst_shape)),)
        rule = _rule(dst_name)
        if rule is None or rule[0] != "vocab" or not dst_shape:
            return ()
        src = held_name(rule[1][0][0].format(w=rule[3]), src_names, src_aliases)
        shape = shape_of(src_names, src) if src is not None else None
        if shape is None or shape[0] >= dst_shape[0]:
            return ()
        return (Box((shape[0],) + (0,) * (len(dst_shape) - 1),
                    (dst_shape[0] - shape[0],) + tuple(dst_shape[1:])),)

    def wanted(self, dst_name: str) -> tuple[str, ...]:
        if is_engine_state(dst_name):
            return ()
        rule = _rule(dst_name)
        if rule is None:
            return (dst_name,)
        _, forms, layer, leaf = rule
        return tuple(dict.fromkeys(t.format(*layer, w=leaf, e=0) for form in forms for t in form))

    def cache_key(self) -> object:
        return (type(self).__qualname__, self.num_heads, self.num_kv_heads)


def is_engine_state(name: str) -> bool:
    """Whether ``name`` is one of vLLM's non-weight tensors (:data:`ENGINE_STATE`)."""
    return ENGINE_STATE.match(name) is not None


def _stack_rows(dst_shape, names, rows) -> list[Segment]:
    rest = dst_shape[1:]
    zeros = (0,) * len(rest)
    out, at = [], 0
    for name, n in zip(names, rows):
        out.append(Segment(Box((at,) + zeros, (n,) + rest), name, (0,) + zeros, part=True))
        at += n
    return out


def _experts(dst_name, dst_shape, forms, layer, src_names, src_aliases) -> list[Segment] | None:
    """``w13_weight`` / ``w2_weight`` ``[E, ...]``: expert e's rows from the first form held."""
    if len(dst_shape) != 3:
        raise PlanError(f"{dst_name}: stacked experts are [experts, rows, columns], not "
                        f"{list(dst_shape)}")
    experts, rows, cols = dst_shape
    for form in forms:
        if "{e}" not in form[0]:  # transformers 5: already stacked, the same shape
            src = held_name(form[0].format(*layer), src_names, src_aliases)
            if src is None:
                continue
            shape = shape_of(src_names, src)
            if shape is not None and shape != dst_shape:
                raise PlanError(f"{dst_name}: destination {list(dst_shape)} differs from its "
                                f"source {src} {list(shape)}")
            return [Segment(Box.whole(dst_shape), src, (0, 0, 0), part=shape is None)]
        out = []
        for e in range(experts):
            names = [held_name(t.format(*layer, e=e), src_names, src_aliases) for t in form]
            if None in names:
                out = None
                break
            n = rows // len(form)
            for i, name in enumerate(names):
                shape = shape_of(src_names, name)
                if rows % len(form) or (shape is not None and shape != (n, cols)):
                    raise PlanError(f"{dst_name}: expert {e} needs {len(form)} sources of "
                                    f"[{rows / len(form):g}, {cols}], {name} is "
                                    f"{list(shape) if shape else '?'}")
                out.append(Segment(Box((e, i * n, 0), (1, n, cols)), name, (0, 0), part=True))
        if out is not None:
            return out
    return None


@lru_cache(maxsize=4096)
def _rule(dst_name: str):
    """(rule, source forms, layer indices, leaf) for a destination name, or None."""
    return table_rule(dst_name, VLLM_FROM_HF)


def hf_to_vllm(config: Mapping[str, Any] | object | None = None, *, num_heads: int | None = None,
               num_kv_heads: int | None = None) -> HfToVllm:
    """The name map from a Hugging Face-named trainer to a vLLM-style engine.

    ``config``: a Hugging Face config or dict (``num_attention_heads``,
    ``num_key_value_heads``; Megatron's ``num_query_groups`` also read); keywords
    override it. Call it on every rank with the same values.
    """
    heads = num_heads if num_heads is not None else _field(config, "num_attention_heads")
    if heads is None:
        raise ValueError("hf_to_vllm: give num_heads (or a config with num_attention_heads)")
    kv = num_kv_heads if num_kv_heads is not None else _field(
        config, "num_key_value_heads", "num_query_groups")
    return HfToVllm(int(heads), int(kv if kv is not None else heads))


def megatron_to_vllm(config: Mapping[str, Any] | object | None = None, **kwargs) -> Compose:
    """Megatron-core trainer -> vLLM-style engine: :func:`hf_to_vllm` after
    :func:`megatron_to_hf` (same config and keywords as ``megatron_to_hf``)."""
    inner = megatron_to_hf(config, **kwargs)
    return Compose(HfToVllm(inner.num_heads, inner.num_query_groups), inner)

