"""torchtitan Llama names -> Hugging Face names: :func:`torchtitan_to_hf`.

Called once, on every rank, to build the ``name_map`` of a ``tr.Refitter`` from a
torchtitan Llama trainer to a Hugging Face-named engine. A flat table with ``{}``
layer templates renames every tensor; ``q_proj`` / ``k_proj`` also reorder rows
within each head, as torchtitan's own Hugging Face adapter does: torchtitan rotates
interleaved pairs (``x[2i], x[2i+1]``), Hugging Face rotates halves (``x[i],
x[i + d/2]``), so Hugging Face row ``j * d/2 + i`` of a head is torchtitan row
``2i + j``. Those rows are one segment each (stride-2 rows are not a box): a refit
of ``q_proj`` / ``k_proj`` moves one region per row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..errors import PlanError
from ..layout._types import Box
from .base import Rename, Segment
from .megatron_hf import _field

__all__ = ["TorchtitanToHF", "torchtitan_to_hf", "HF_FROM_TORCHTITAN"]

HF_FROM_TORCHTITAN: dict[str, str] = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
}


@dataclass(frozen=False, eq=False)
class TorchtitanToHF(Rename):
    """:data:`HF_FROM_TORCHTITAN` plus the rotary row order of ``q_proj`` / ``k_proj``
    (``num_heads`` / ``num_kv_heads`` heads; ``permute_rope=False`` keeps rows as they
    are, for a torchtitan model whose rotary embedding already rotates halves)."""

    num_heads: int
    num_kv_heads: int
    permute_rope: bool = True

    def __post_init__(self) -> None:
        Rename.__init__(self, HF_FROM_TORCHTITAN)

    def segments(self, dst_name, dst_shape, src_names, src_aliases):
        segs = super().segments(dst_name, dst_shape, src_names, src_aliases)
        heads = {"q_proj": self.num_heads, "k_proj": self.num_kv_heads}.get(
            dst_name.split(".")[-2] if dst_name.startswith("model.layers.") else "")
        if segs is None or heads is None or not self.permute_rope:
            return segs
        dst_shape = tuple(dst_shape)
        if len(dst_shape) != 2 or dst_shape[0] % (2 * heads):
            raise PlanError(f"{dst_name}: {list(dst_shape)} rows are not {heads} heads of an even "
                            "head dim (rotary pairs)")
        return [Segment(Box((d, 0), (1, dst_shape[1])), segs[0].src_name, (s, 0), part=True)
                for d, s in _rope_rows(dst_shape[0], heads)]

    def cache_key(self) -> object:
        return (type(self).__qualname__, self.num_heads, self.num_kv_heads, self.permute_rope)


@lru_cache(maxsize=64)
def _rope_rows(rows: int, heads: int) -> tuple[tuple[int, int], ...]:
    """(Hugging Face row, torchtitan row) for every row of a q or k projection."""
    d = rows // heads
    half = d // 2
    return tuple((h * d + j * half + i, h * d + 2 * i + j)
                 for h in range(heads) for j in range(2) for i in range(half))


def torchtitan_to_hf(config: Mapping[str, Any] | object | None = None, *,
                     num_heads: int | None = None, num_kv_heads: int | None = None,
                     permute_rope: bool = True) -> TorchtitanToHF:
    """The name map from a torchtitan Llama trainer to a Hugging Face-named engine.

    ``config``: torchtitan's model args (``n_heads``, ``n_kv_heads``) or a Hugging Face
    config (``num_attention_heads``, ``num_key_value_heads``); keywords override it.
    """
    heads = num_heads if num_heads is not None else _field(config, "n_heads", "num_attention_heads")
    if heads is None:
        raise ValueError("torchtitan_to_hf: give num_heads (or a config with n_heads)")
    kv = num_kv_heads if num_kv_heads is not None else _field(
        config, "n_kv_heads", "num_key_value_heads")
    return TorchtitanToHF(int(heads), int(kv if kv is not None else heads), permute_rope)
