"""torchtitan names -> Hugging Face names: :func:`torchtitan_to_hf`, :func:`torchtitan_to_vllm`.

Called once, on every rank, to build the ``name_map`` of a ``tr.Refitter`` from a
torchtitan trainer (Llama 3, Qwen 3, Qwen 3 MoE, DeepSeek V3) to a Hugging
Face-named model or, through :func:`~torchrefit.maps.hf_to_vllm`, a vLLM-style
engine. The planner asks it, per destination tensor, which regions of which
trainer tensors fill it, in global coordinates, so no rank gathers a full tensor.

:data:`HF_FROM_TORCHTITAN` is a flat table: a Hugging Face template (``{}`` a layer
or expert index) -> a rule and the torchtitan names that may hold it, tried in
order; the first one the trainer holds is read. torchtitan renames modules between
versions (``attention.wq`` became ``attention.qkv_linear.wq`` or the fused
``qkv_linear.wqkv``; ``output`` became ``lm_head``), so a rename is a new name in
the table, not a new map. Rules:

* ``whole``: a rename; ``optional``: a rename of a tensor a trainer may lack
  (DeepSeek's expert bias exists only with load balancing), left to the planner's
  "no source" rule, which ``skip=[...]`` may relax;
* ``q`` / ``k`` / ``v``: the heads of a query, key or value projection, from the
  unfused ``wq`` / ``wk`` / ``wv`` or from the fused ``wqkv``, whose rows torchtitan
  groups per key-value head as ``[q x heads per kv head; k; v]``. Where the model's
  rotary embedding rotates interleaved pairs (torchtitan's Llama, ``ComplexRoPE``)
  and Hugging Face's rotates halves, q and k rows are also reordered within each
  head as torchtitan's own converter does: Hugging Face row ``j * d/2 + i`` of a
  head is torchtitan row ``2i + j``. Those rows are one region each (stride-2 rows
  are not a box). Qwen 3 (``CosSinRoPE``) and DeepSeek V3 (whose Hugging Face
  model sets ``rope_interleave``) keep rows as they are;
* ``gate_up`` / ``expert``: stacked experts. torchtitan holds a layer's experts as
  ``w1_EFD`` / ``w3_EFD`` ``[E, F, D]`` and ``w2_EDF`` ``[E, D, F]``;
  ``transformers`` 5 as ``experts.gate_up_proj`` ``[E, 2F, D]`` (gate rows first)
  and ``experts.down_proj`` ``[E, D, F]``; per-expert Hugging Face names
  (``experts.{e}.gate_proj.weight``, the names of torchtitan's converter) are
  expert ``e`` of the stacked tensor.

A destination the table lists whose torchtitan names the trainer holds none of is a
map built for another naming: :meth:`TorchtitanToHF.segments` raises
:class:`~torchrefit.PlanError` naming what it expected and what the trainer holds
there, which the planner reports on every rank.
"""

from __future__ import annotations

import re
from collections.abc import Container, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..errors import PlanError
from ..layout._types import Box
from .base import Compose, NameMap, Segment, held_name, shape_of
from .hf_vllm import HfToVllm
from .megatron_hf import _field

__all__ = ["TorchtitanToHF", "torchtitan_to_hf", "torchtitan_to_vllm", "HF_FROM_TORCHTITAN"]

_L = "layers.{}."
_A = _L + "attention."
_QKV = _A + "qkv_linear."
_E = _L + "moe.routed_experts.inner_experts."
_S = _L + "moe.shared_experts."

# Hugging Face template -> (rule, torchtitan templates tried in order). ``{}`` is a
# layer (then an expert) index. Newer torchtitan names come first.
HF_FROM_TORCHTITAN: dict[str, tuple[str, tuple[str, ...]]] = {
    "model.embed_tokens.weight": ("whole", ("tok_embeddings.weight",)),
    "model.norm.weight": ("whole", ("norm.weight",)),
    "lm_head.weight": ("whole", ("lm_head.weight", "output.weight")),
    "model.layers.{}.input_layernorm.weight": ("whole", (_L + "attention_norm.weight",)),
    "model.layers.{}.post_attention_layernorm.weight": ("whole", (_L + "ffn_norm.weight",)),
    # attention: grouped-query (Llama 3, Qwen 3)
    "model.layers.{}.self_attn.q_proj.weight": (
        "q", (_QKV + "wq.weight", _QKV + "wqkv.weight", _A + "wq.weight")),
    "model.layers.{}.self_attn.k_proj.weight": (
        "k", (_QKV + "wk.weight", _QKV + "wqkv.weight", _A + "wk.weight")),
    "model.layers.{}.self_attn.v_proj.weight": (
        "v", (_QKV + "wv.weight", _QKV + "wqkv.weight", _A + "wv.weight")),
    "model.layers.{}.self_attn.o_proj.weight": ("whole", (_A + "wo.weight",)),
    "model.layers.{}.self_attn.q_norm.weight": ("whole", (_A + "q_norm.weight",)),
    "model.layers.{}.self_attn.k_norm.weight": ("whole", (_A + "k_norm.weight",)),
    # attention: multi-head latent (DeepSeek V3); q_proj is the table's "q" rule on wq
    "model.layers.{}.self_attn.q_a_proj.weight": ("whole", (_A + "wq_a.weight",)),
    "model.layers.{}.self_attn.q_a_layernorm.weight": ("whole", (_A + "q_norm.weight",)),
    "model.layers.{}.self_attn.q_b_proj.weight": ("whole", (_A + "wq_b.weight",)),
    "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight": ("whole", (_A + "wkv_a.weight",)),
    "model.layers.{}.self_attn.kv_a_layernorm.weight": ("whole", (_A + "kv_norm.weight",)),
    "model.layers.{}.self_attn.kv_b_proj.weight": ("whole", (_A + "wkv_b.weight",)),
    # dense feed-forward
    "model.layers.{}.mlp.gate_proj.weight": ("whole", (_L + "feed_forward.w1.weight",)),
    "model.layers.{}.mlp.up_proj.weight": ("whole", (_L + "feed_forward.w3.weight",)),
    "model.layers.{}.mlp.down_proj.weight": ("whole", (_L + "feed_forward.w2.weight",)),
    # mixture of experts
    "model.layers.{}.mlp.gate.weight": ("whole", (_L + "moe.router.gate.weight",)),
    "model.layers.{}.mlp.gate.e_score_correction_bias": (  # absent without load balancing
        "optional", (_L + "moe.expert_bias_E", _L + "moe.expert_bias")),
    "model.layers.{}.mlp.experts.gate_up_proj": ("gate_up", (_E + "w1_EFD", _E + "w3_EFD")),
    "model.layers.{}.mlp.experts.down_proj": ("whole", (_E + "w2_EDF",)),
    "model.layers.{}.mlp.experts.{}.gate_proj.weight": ("expert", (_E + "w1_EFD",)),
    "model.layers.{}.mlp.experts.{}.up_proj.weight": ("expert", (_E + "w3_EFD",)),
    "model.layers.{}.mlp.experts.{}.down_proj.weight": ("expert", (_E + "w2_EDF",)),
    "model.layers.{}.mlp.shared_experts.gate_proj.weight": ("whole", (_S + "w1.weight",)),
    "model.layers.{}.mlp.shared_experts.up_proj.weight": ("whole", (_S + "w3.weight",)),
    "model.layers.{}.mlp.shared_experts.down_proj.weight": ("whole", (_S + "w2.weight",)),
}

# How a Hugging Face model's rotary embedding relates to torchtitan's for the same
# family: True where torchtitan rotates interleaved pairs and Hugging Face halves.
_PERMUTE_FOR_HF_TYPE = {"llama": True, "qwen3": False, "qwen3_moe": False,
                        "deepseek_v3": False}


@dataclass(frozen=True)
class TorchtitanToHF(NameMap):
    """Hugging Face destination names from torchtitan source names (see the module
    docstring): ``num_heads`` query heads in ``num_kv_heads`` groups; ``permute_rope``
    reorders q and k rows from interleaved to half rotary pairs.

    Every rule checks the shapes it reads against these counts and raises
    :class:`PlanError` naming the tensor where they do not fit.
    """

    num_heads: int
    num_kv_heads: int
    permute_rope: bool = True

    def __post_init__(self) -> None:
        h, g = self.num_heads, self.num_kv_heads
        if h < 1 or g < 1 or h % g:
            raise ValueError(f"torchtitan_to_hf: num_heads {h} must be a positive multiple of "
                             f"num_kv_heads {g}")

    def segments(self, dst_name, dst_shape, src_names, src_aliases):
        rule = _rule(dst_name)
        if rule is None:
            return super().segments(dst_name, dst_shape, src_names, src_aliases)
        kind, templates, indices = rule
        dst_shape = tuple(dst_shape)
        layer_indices = indices[:1] if kind == "expert" else indices
        held = [held_name(t.format(*layer_indices), src_names, src_aliases) for t in templates]
        if kind == "gate_up":
            if None in held:
                raise _naming_error(dst_name, templates, layer_indices, src_names, held)
            return _gate_up(dst_name, dst_shape, held, src_names)
        src = next((h for h in held if h is not None), None)
        if src is None and kind == "optional":
            return None  # the planner's "no source", which skip=[...] may allow
        if src is None:
            raise _naming_error(dst_name, templates, layer_indices, src_names, held)
        if kind in ("whole", "optional"):
            return [Segment(Box.whole(dst_shape), src, (0,) * len(dst_shape))]
        if kind == "expert":
            return _one_expert(dst_name, dst_shape, src, int(indices[1]), src_names)
        return self._heads(dst_name, dst_shape, kind, src, src_names)

    def _heads(self, dst_name: str, dst_shape: tuple[int, ...], kind: str, src: str,
               src_names: Container[str]) -> list[Segment]:
        """q, k or v rows from an unfused projection or the fused ``wqkv``."""
        fused = src.endswith("wqkv.weight")
        heads = self.num_heads if kind == "q" else self.num_kv_heads
        src_shape = shape_of(src_names, src)
        if len(dst_shape) != 2 or dst_shape[0] % heads:
            raise PlanError(f"{dst_name}: {list(dst_shape)} is not {heads} heads of rows",
                            tensor=dst_name, rule="heads")
        d = dst_shape[0] // heads
        want = (self.num_heads + 2 * self.num_kv_heads) * d if fused else dst_shape[0]
        if src_shape is not None and (src_shape[1:] != dst_shape[1:] or src_shape[0] != want):
            layout = (f"[q x {self.num_heads // self.num_kv_heads}; k; v] per kv head, "
                      f"{self.num_heads} q heads and {self.num_kv_heads} kv heads of {d} rows"
                      if fused else f"{heads} heads of {d} rows")
            raise PlanError(f"{dst_name}: source {src} {list(src_shape)} is not {layout} "
                            f"(destination {list(dst_shape)})", tensor=dst_name, rule="heads")
        permute = self.permute_rope and kind in ("q", "k")
        if permute and d % 2:
            raise PlanError(f"{dst_name}: head dim {d} is odd, so its rows are not rotary "
                            "pairs", tensor=dst_name, rule="heads")
        cols = dst_shape[1]
        return [Segment(Box((dst, 0), (n, cols)), src, (at, 0), part=True)
                for dst, at, n in _head_rows(kind, fused, self.num_heads, self.num_kv_heads,
                                             d, permute)]

    def wanted(self, dst_name: str) -> tuple[str, ...]:
        rule = _rule(dst_name)
        if rule is None:
            return (dst_name,)
        kind, templates, indices = rule
        layer_indices = indices[:1] if kind == "expert" else indices
        return tuple(t.format(*layer_indices) for t in templates)

    def source_shape(self, dst_name, src_names, src_aliases):
        rule = _rule(dst_name)
        if rule is None:
            return super().source_shape(dst_name, src_names, src_aliases)
        kind, templates, indices = rule
        if kind not in ("whole", "optional"):
            return None
        for t in templates:
            name = held_name(t.format(*indices), src_names, src_aliases)
            if name is not None:
                return shape_of(src_names, name)
        return None

    def cache_key(self) -> object:
        return (type(self).__qualname__, self.num_heads, self.num_kv_heads, self.permute_rope)


_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


def _rule(dst_name: str) -> tuple[str, tuple[str, ...], tuple[str, ...]] | None:
    """(rule, torchtitan templates, indices) of a destination name, or None. Read from
    the table on each call (no cache), so that an edit of the table takes effect."""
    got = HF_FROM_TORCHTITAN.get(_INDEX.sub("{}", dst_name))
    return None if got is None else (*got, tuple(_INDEX.findall(dst_name)))


@lru_cache(maxsize=256)
def _head_rows(kind: str, fused: bool, heads: int, kv_heads: int, d: int,
               permute: bool) -> tuple[tuple[int, int, int], ...]:
    """``(dst row, src row, rows)`` runs of a q, k or v projection: head by head from
    where the source keeps it, row by row where rotary pairs are reordered."""
    per = heads // kv_heads
    count = heads if kind == "q" else kv_heads

    def base(h: int) -> int:  # the source row where destination head h starts
        if not fused:
            return h * d
        if kind == "q":
            return ((h // per) * (per + 2) + h % per) * d
        return (h * (per + 2) + per + (kind == "v")) * d

    out: list[tuple[int, int, int]] = []
    half = d // 2
    for h in range(count):
        if permute:  # Hugging Face row j * d/2 + i of a head is torchtitan row 2i + j
            out += [(h * d + j * half + i, base(h) + 2 * i + j, 1)
                    for j in range(2) for i in range(half)]
        elif out and out[-1][1] + out[-1][2] == base(h):
            dst, at, n = out[-1]
            out[-1] = (dst, at, n + d)  # contiguous heads are one region
        else:
            out.append((h * d, base(h), d))
    return tuple(out)


def _gate_up(dst_name: str, dst_shape: tuple[int, ...], held: list[str | None],
             src_names: Container[str]) -> list[Segment]:
    """``experts.gate_up_proj`` ``[E, 2F, D]``: rows ``[0, F)`` of every expert from
    ``w1_EFD``, rows ``[F, 2F)`` from ``w3_EFD``."""
    w1, w3 = held
    if len(dst_shape) != 3 or dst_shape[1] % 2:
        raise PlanError(f"{dst_name}: {list(dst_shape)} is not [experts, 2 x hidden, dim]",
                        tensor=dst_name, rule="experts")
    e, rows, cols = dst_shape
    half = (e, rows // 2, cols)
    for src in (w1, w3):
        shape = shape_of(src_names, src)
        if shape is not None and shape != half:
            raise PlanError(f"{dst_name}: {list(dst_shape)} is not [gate; up] of {w1} and "
                            f"{w3}: {src} is {list(shape)}, not {list(half)}",
                            tensor=dst_name, rule="experts")
    return [Segment(Box((0, 0, 0), half), w1, (0, 0, 0), part=True),
            Segment(Box((0, rows // 2, 0), half), w3, (0, 0, 0), part=True)]


def _one_expert(dst_name: str, dst_shape: tuple[int, ...], src: str, expert: int,
                src_names: Container[str]) -> list[Segment]:
    """One expert's ``[F, D]`` (or ``[D, F]``): row ``expert`` of a stacked tensor."""
    shape = shape_of(src_names, src)
    if shape is not None and (shape[1:] != dst_shape or expert >= shape[0]):
        raise PlanError(f"{dst_name}: expert {expert} of {src} {list(shape)} is not "
                        f"{list(dst_shape)}", tensor=dst_name, rule="experts")
    zeros = (0,) * len(dst_shape)
    return [Segment(Box.whole(dst_shape), src, (expert,) + zeros, part=True)]


def _naming_error(dst_name: str, templates: tuple[str, ...], indices: tuple[str, ...],
                  src_names: Container[str], held: list[str | None]) -> PlanError:
    """The trainer holds none (or not all) of the names the table reads for
    ``dst_name``: say which were expected and what the trainer holds nearby. Where it
    holds the same names for other layers, the layer is absent, not renamed: a
    pipeline stage holds only its own modules (torchtitan's split keeps their names)."""
    expected = [t.format(*indices) for t, h in zip(templates, held) if h is None]
    reads = f"{dst_name}: torchtitan_to_hf reads it from {' or '.join(map(repr, expected))}"
    missing = tuple(t for t, h in zip(templates, held) if h is None)
    others = _layers_holding(missing, indices, src_names)
    if others:
        return PlanError(
            f"{reads}, which no source rank holds; the source ranks hold it for layers "
            f"{', '.join(others)} only, under the names the map reads: layer {indices[0]} is on "
            f"no source rank. {_STAGES}", tensor=dst_name, rule="pipeline")
    nearby = _held_near(expected[0], src_names)
    holds = (f"; the trainer holds {', '.join(nearby)}" if nearby else
             "; the trainer holds none of the names near it")
    top = expected[0].split(".")[0]
    tops = _top_modules(src_names)
    if not indices and "layers" in tops and top not in tops:  # a stage without it?
        return PlanError(
            f"{reads}, which no source rank holds{holds}. The source ranks hold no {top!r} "
            f"module (their modules: {', '.join(tops)}): a pipeline stage without it, or a "
            f"trainer that names it another way. {_STAGES}; otherwise add the trainer's names "
            "to tr.maps.HF_FROM_TORCHTITAN (or pass a map built for them)",
            tensor=dst_name, rule="naming")
    return PlanError(
        f"{reads}, which no source rank holds{holds}. The trainer names its tensors another "
        "way: add its names to tr.maps.HF_FROM_TORCHTITAN (or pass a map built for them)",
        tensor=dst_name, rule="naming")


_STAGES = ("A pipeline-parallel trainer refits with a rank of every stage in the "
           "Refitter's group, each passing its stage modules (a list where it holds several)")


def _layers_holding(templates: tuple[str, ...], indices: tuple[str, ...],
                    src_names: Container[str]) -> list[str]:
    """Other layer indices for which the source holds one of ``templates``, in order."""
    if not indices or not isinstance(src_names, Mapping):
        return []
    pattern = re.compile("|".join(
        re.escape(t).replace(re.escape("{}"), r"(\d+)", 1).replace(re.escape("{}"), "(?:\\d+)")
        for t in templates))
    found = {next((g for g in m.groups() if g is not None), None)
             for n in src_names if (m := pattern.fullmatch(n))}
    return sorted(found - {indices[0], None}, key=int)


def _top_modules(src_names: Container[str]) -> list[str]:
    if not isinstance(src_names, Mapping):
        return []
    return sorted({n.split(".")[0] for n in src_names})


def _held_near(name: str, src_names: Container[str], most: int = 8) -> list[str]:
    """Up to ``most`` source names under the closest module of ``name`` the source has."""
    if not isinstance(src_names, Mapping):
        return []
    parts = name.split(".")
    for keep in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:keep]) + "."
        near = sorted(n for n in src_names if n.startswith(prefix))
        if near:
            return near[:most] + ([f"... ({len(near) - most} more)"] if len(near) > most else [])
    return []


def torchtitan_to_hf(config: Mapping[str, Any] | object | None = None, *,
                     num_heads: int | None = None, num_kv_heads: int | None = None,
                     permute_rope: bool | None = None) -> TorchtitanToHF:
    """The name map from a torchtitan trainer to a Hugging Face-named model.

    ``config``: torchtitan's model config (``Llama3Model.Config``, ``Qwen3Model.Config``,
    ``DeepSeekV3Model.Config``: heads read from ``layers[0].attention``; older model args
    with ``n_heads`` / ``n_kv_heads``), or the Hugging Face config of the destination
    (``num_attention_heads``, ``num_key_value_heads``, ``model_type``). Keywords
    override it. ``permute_rope`` None: True where torchtitan's model rotates
    interleaved pairs (``ComplexRoPE``, a Hugging Face ``llama``), False for Qwen 3
    (``CosSinRoPE``) and DeepSeek V3 (multi-head latent attention). Call it on every
    rank with the same values.
    """
    attn = _first_attention(config)
    heads = num_heads if num_heads is not None else (
        _field(attn, "n_heads") or _field(config, "n_heads", "num_attention_heads"))
    if heads is None:
        raise ValueError("torchtitan_to_hf: give num_heads, torchtitan's model config "
                         "(layers[0].attention.n_heads) or a Hugging Face config")
    kv = num_kv_heads if num_kv_heads is not None else (
        _field(attn, "n_kv_heads") or _field(config, "n_kv_heads", "num_key_value_heads"))
    if _field(attn, "kv_lora_rank") is not None:  # latent attention: one key per head
        kv = heads
    if permute_rope is None:
        permute_rope = _permutes(config, attn)
    return TorchtitanToHF(int(heads), int(kv if kv is not None else heads), permute_rope)


def torchtitan_to_vllm(config: Mapping[str, Any] | object | None = None, **kwargs) -> Compose:
    """torchtitan trainer -> vLLM-style engine: :func:`~torchrefit.maps.hf_to_vllm`
    after :func:`torchtitan_to_hf` (same config and keywords)."""
    inner = torchtitan_to_hf(config, **kwargs)
    return Compose(HfToVllm(inner.num_heads, inner.num_kv_heads), inner)


def _first_attention(config) -> object | None:
    layers = _field(config, "layers")
    if isinstance(layers, (list, tuple)) and layers:
        return _field(layers[0], "attention")
    return None


def _permutes(config, attn) -> bool:
    if attn is not None:
        if _field(attn, "kv_lora_rank") is not None:
            return False  # DeepSeek V3: Hugging Face's model rotates interleaved pairs too
        rope = _field(attn, "rope")
        return rope is None or type(rope).__qualname__.startswith("ComplexRoPE")
    model_type = _field(config, "model_type")
    if model_type is None:
        return True  # torchtitan's Llama model args
    if model_type not in _PERMUTE_FOR_HF_TYPE:
        raise ValueError(f"torchtitan_to_hf: say permute_rope= for a {model_type!r} model "
                         "(whether torchtitan rotates interleaved pairs where it rotates halves)")
    return _PERMUTE_FOR_HF_TYPE[model_type]
