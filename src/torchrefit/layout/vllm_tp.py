"""vLLM's tensor-parallel layout: which rows or columns of each global tensor a rank holds.

It describes a model as vLLM shards it, whether its tensors carry vLLM's fused names
(``qkv_proj``, ``gate_up_proj``, stacked ``w13_weight`` / ``w2_weight``: a live vLLM
model) or Hugging Face's unfused ones (``q_proj``, ``gate_proj``, ...). An engine rank
passes ``dst_layout=vllm_tp_layout(tp_rank, tp_size, num_heads=..., num_kv_heads=...)``
to its ``Refitter`` (or the table ``vllm_tp_specs`` returns). Tensor parallel cuts, by
module (the name's second-last part):

* column parallel, rows cut plainly: ``q_proj``, ``gate_proj``, ``up_proj``,
  ``embed_tokens``, ``lm_head`` (weights and biases);
* ``k_proj`` / ``v_proj``: rows cut by key-value head; where the TP size exceeds the
  number of kv heads, rank r holds head ``r * kv_heads // tp_size`` (replicated, as
  vLLM does);
* fused ``qkv_proj``: rank r holds ``[its q heads; its k heads; its v heads]`` of the
  global ``[all q; all k; all v]``; fused ``gate_up_proj``: ``[its gate; its up]``;
* row parallel, columns cut: ``o_proj.weight``, ``down_proj.weight``;
* everything else (norms, router, row-parallel biases) whole on every rank.

An FP8 block scale (``<weight>_scale_inv``) is cut as its weight, in grid units, so
each rank holds the scales of its own blocks (the block size must divide the shards).

Per-expert names (``mlp.experts.{e}.gate_proj``) follow the same rules; stacked
experts as vLLM's fused MoE holds them under tensor parallelism: ``w13_weight``
``[E, 2I, H]`` holds ``[its gate rows; its up rows]`` of every expert (dim 1),
``w2_weight`` ``[E, H, I]`` its columns (dim 2). A padded vocabulary is cut like
any column-parallel tensor (vLLM pads it to a multiple of the TP size); expert
parallelism is not described.

A tensor vLLM emptied (its CPU build leaves each packed linear's ``weight`` a ``[0]``
parameter) raises :class:`LayoutError` naming it as emptied: only the engine's
``load_weights`` can reach it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from ..errors import LayoutError
from ._described import Described, named_refit_tensors
from ._types import Box, Piece
from .explicit import Explicit, TensorSpec
from .sharding import shard_pieces

__all__ = ["vllm_tp_specs", "vllm_tp_shards", "vllm_tp_layout"]

_COLUMN = frozenset({"q_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"})
_ROW = frozenset({"o_proj", "down_proj"})


def vllm_tp_specs(
    model: nn.Module | Mapping[str, torch.Tensor],
    tp_rank: int,
    tp_size: int,
    *,
    num_heads: int,
    num_kv_heads: int,
) -> dict[str, TensorSpec]:
    """``{local name: TensorSpec}`` for the sharded tensors this rank holds (pass as
    ``dst_layout``; tensors left out are whole on every rank)."""
    if num_heads % tp_size or (num_kv_heads % tp_size and tp_size % num_kv_heads):
        raise LayoutError(
            f"vLLM-style TP {tp_size} needs it to divide num_heads {num_heads} and to divide "
            f"or be a multiple of num_kv_heads {num_kv_heads}")
    specs = {}
    for name, t in named_refit_tensors(model):
        spec = _spec(name, tuple(t.shape), tp_rank, tp_size, num_heads, num_kv_heads)
        if spec is not None:
            specs[name] = spec
    return specs


def vllm_tp_shards(
    shapes: Mapping[str, tuple[int, ...]],
    tp_rank: int,
    tp_size: int,
    *,
    num_heads: int,
    num_kv_heads: int,
) -> dict[str, TensorSpec]:
    """The other way round from :func:`vllm_tp_specs`: for whole tensors ``{name: global
    shape}``, the ``TensorSpec`` of the shard rank ``tp_rank`` holds of each one tensor
    parallel cuts (its local shape: :func:`local_shape`); tensors left out are whole on
    every rank. Raises :class:`LayoutError` naming a tensor that does not cut evenly."""
    vllm_tp_specs({}, tp_rank, tp_size, num_heads=num_heads, num_kv_heads=num_kv_heads)
    specs = {}
    for name, shape in shapes.items():
        shape = tuple(int(s) for s in shape)
        # every rule cuts one dim by a whole factor (the TP size, or the kv heads held):
        # the whole shape read as a shard's tells which dim and how much
        probe = _spec(name, shape, 0, tp_size, num_heads, num_kv_heads)
        if probe is None:
            continue
        dim = next(d for d, (g, s) in enumerate(zip(probe.global_shape, shape)) if g != s)
        local = shape[:dim] + (shape[dim] * shape[dim] // probe.global_shape[dim],) + shape[dim + 1:]
        spec = _spec(name, local, tp_rank, tp_size, num_heads, num_kv_heads)
        if spec is None or spec.global_shape != shape:
            raise LayoutError(f"{name}: a whole tensor of shape {list(shape)} does not cut into "
                              f"{tp_size} vLLM tensor-parallel shards")
        specs[name] = spec
    return specs


def local_shape(spec: TensorSpec) -> tuple[int, ...]:
    """The shape of the local tensor that holds ``spec``'s pieces."""
    return tuple(max(o + s for o, s in zip(dims_o, dims_s)) for dims_o, dims_s in zip(
        zip(*(p.local_offset for p in spec.pieces)), zip(*(p.box.size for p in spec.pieces))))


def _spec(name: str, shape: tuple[int, ...], rank: int, size: int, heads: int,
          kv: int) -> TensorSpec | None:
    if shape == (0,):
        raise LayoutError(
            f"{name}: vLLM has emptied this tensor (shape [0]): its values live in a kernel's "
            "packed copy (vLLM CPU packs linear weights for oneDNN), so nothing can be written "
            "into it; load it through the engine's load_weights inside vLLM's layerwise reload "
            "(the torchrefit vLLM backend routes it so), or keep the weights as parameters")
    parts = name.split(".")
    module, leaf = (parts[-2], parts[-1]) if len(parts) > 1 else ("", name)
    if size == 1 or not shape:
        return None
    if module in _COLUMN:
        return TensorSpec(name, *shard_pieces(shape, 0, rank, size, name=name))
    if module in _ROW and leaf in ("weight", "weight_scale_inv"):
        return TensorSpec(name, *shard_pieces(shape, 1, rank, size, name=name))
    if leaf in ("w13_weight", "w13_weight_scale_inv"):
        half = _divide(shape[1], 2, name, "rows of [gate; up] per expert")
        return TensorSpec(name, *shard_pieces(shape, 1, rank, size, sizes=[half, half], name=name))
    if leaf in ("w2_weight", "w2_weight_scale_inv"):
        return TensorSpec(name, *shard_pieces(shape, 2, rank, size, name=name))
    if module == "gate_up_proj":
        half = _divide(shape[0], 2, name, "rows of [gate; up]")
        return TensorSpec(name, *shard_pieces(shape, 0, rank, size, sizes=[half, half], name=name))
    if module in ("k_proj", "v_proj"):
        return _kv_spec(name, shape, rank, size, kv)
    if module == "qkv_proj":
        return _qkv_spec(name, shape, rank, size, heads, kv)
    return None


def _kv_heads_held(rank: int, size: int, kv: int) -> tuple[int, int]:
    """(first kv head, kv heads) rank ``rank`` holds; one replicated head when TP > kv."""
    if size >= kv:
        return rank * kv // size, 1
    return rank * (kv // size), kv // size


def _kv_spec(name: str, shape: tuple[int, ...], rank: int, size: int, kv: int) -> TensorSpec:
    first, n = _kv_heads_held(rank, size, kv)
    d = _divide(shape[0], n, name, f"rows over {n} local kv heads")
    rest = shape[1:]
    zeros = (0,) * len(rest)
    piece = Piece(Box((first * d,) + zeros, (n * d,) + rest), (0,) * len(shape))
    return TensorSpec(name, (kv * d,) + rest, (piece,))


def _qkv_spec(name: str, shape: tuple[int, ...], rank: int, size: int, heads: int,
              kv: int) -> TensorSpec:
    q_n = heads // size
    first, kv_n = _kv_heads_held(rank, size, kv)
    d = _divide(shape[0], q_n + 2 * kv_n, name, f"rows over {q_n} q + 2 x {kv_n} kv local heads")
    rest = shape[1:]
    zeros = (0,) * len(rest)
    blocks = [  # (global row, local row, rows)
        (rank * q_n * d, 0, q_n * d),
        ((heads + first) * d, q_n * d, kv_n * d),
        ((heads + kv + first) * d, (q_n + kv_n) * d, kv_n * d),
    ]
    pieces = tuple(Piece(Box((g,) + zeros, (n,) + rest), (lo,) + zeros) for g, lo, n in blocks)
    return TensorSpec(name, ((heads + 2 * kv) * d,) + rest, pieces)


def _divide(n: int, k: int, name: str, what: str) -> int:
    if n % k:
        raise LayoutError(f"{name}: local extent {n} does not divide into {k} ({what})")
    return n // k


def vllm_tp_layout(tp_rank: int, tp_size: int, *, num_heads: int,
                   num_kv_heads: int) -> Callable[[nn.Module], Described]:
    """A ``dst_layout`` adapter built on :func:`vllm_tp_specs`: the ``Refitter`` calls it
    while describing, so a layout error in it reaches every rank of the refit."""
    def describe(model: nn.Module) -> Described:
        specs = vllm_tp_specs(model, tp_rank, tp_size, num_heads=num_heads,
                              num_kv_heads=num_kv_heads)
        return Explicit(specs)(model)
    return describe
