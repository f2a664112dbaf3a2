"""Megatron-style layout: read the sharding attributes Megatron-core sets on parameters.

Per parameter: ``tensor_model_parallel`` with ``partition_dim``, ``partition_stride``
and ``partition_sizes``; ``allreduce=False`` marks expert parameters, whose local
expert index (``local_experts.K.`` or a ``weightK``/``biasK`` name) becomes a global
one through the expert-parallel rank, and whose tensor-parallel group is the
expert-TP group. Per module: ``layer_number`` (1-based, global) turns a pipeline
stage's local layer index into the global one; under pipeline parallelism a
``layers.K`` module without one is refused. Process groups come from the
module's ``pg_collection`` (``tp``, ``pp``, ``ep``, ``dp``, ``expt_tp``); only each
group's ``rank()`` and ``size()`` are read. A model that ties its output layer to
its word embedding (``share_embeddings_and_output_weights``) serves
``output_layer.weight`` from ``embedding.word_embeddings.weight``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from ..errors import LayoutError
from ._described import Described, chunk_key, named_refit_tensors, unwrap_chunks
from ._types import ModelLayout, TensorLayout, dtype_name
from .sharding import shard_pieces, whole_piece
from .walk import named_modules

__all__ = ["megatron", "is_megatron_model", "TIED_OUTPUT", "WORD_EMBEDDING"]

TIED_OUTPUT = "output_layer.weight"
WORD_EMBEDDING = "embedding.word_embeddings.weight"

_LOCAL_EXPERT = re.compile(r"(^|\.)local_experts\.(\d+)(\.|$)")
_GROUPED_EXPERT = re.compile(r"(^|\.)(weight|bias)(\d+)$")


def is_megatron_model(model) -> bool:
    return any(getattr(c, "pg_collection", None) is not None for c in unwrap_chunks(model))


def megatron(model: nn.Module | list[nn.Module]) -> Described:
    """Describe a Megatron-core model (or its virtual-pipeline chunks) on this rank."""
    chunks = unwrap_chunks(model)
    entries, tensors, aliases = [], {}, set()
    for i, core in enumerate(chunks):
        pg = getattr(core, "pg_collection", None)
        if pg is None:
            raise LayoutError(
                f"model chunk {i} ({type(core).__name__}) has no pg_collection; pass "
                "src_layout/dst_layout explicitly or set pg_collection (tp, pp, ep, dp, expt_tp)"
            )
        if getattr(core, "share_embeddings_and_output_weights", False):
            aliases.add((TIED_OUTPUT, WORD_EMBEDDING))
        for name, layout, t in _describe_chunk(core, pg):
            key = chunk_key(i, len(chunks), name)
            entries.append((key, layout))
            tensors[key] = t
    return Described(ModelLayout(tuple(entries), tuple(sorted(aliases))), tensors)


def _rank_size(group, what: str) -> tuple[int, int]:
    if group is None:
        return 0, 1
    try:
        return int(group.rank()), int(group.size())
    except Exception as e:  # a group this rank is not a member of, or a bad object
        raise LayoutError(f"cannot read rank and size of the {what} group {group!r}: {e}") from e


def _describe_chunk(core: nn.Module, pg) -> Iterable[tuple[str, TensorLayout, torch.Tensor]]:
    tp = _rank_size(getattr(pg, "tp", None), "tp")
    ep = _rank_size(getattr(pg, "ep", None), "ep")
    etp_group = getattr(pg, "expt_tp", None)
    etp = _rank_size(etp_group, "expt_tp") if etp_group is not None else tp
    pp = _rank_size(getattr(pg, "pp", None), "pp")
    layer_map = _layer_prefix_map(core, pp)
    named = list(named_refit_tensors(core))
    # without expert parallelism expert names are global already: nothing to count
    n_local = _local_expert_count(core, named, ep[1]) if ep[1] > 1 else 0
    for name, t in named:
        gname = _global_layer_name(name, layer_map)
        is_expert = not getattr(t, "allreduce", True)
        rank, size = tp
        if is_expert:
            gname = _global_expert_name(gname, ep, n_local, name)
            rank, size = etp
        sharded = bool(getattr(t, "tensor_model_parallel", False)) or (is_expert and size > 1)
        shape = tuple(t.shape)
        if sharded and size > 1:
            sizes = getattr(t, "partition_sizes", None)
            gshape, pieces = shard_pieces(
                shape, int(getattr(t, "partition_dim", 0)), rank, size,
                stride=int(getattr(t, "partition_stride", 1)),
                sizes=list(sizes) if sizes is not None else None, name=name,
            )
        else:
            gshape, pieces = shape, whole_piece(shape)
        is_buffer = not isinstance(t, nn.Parameter)
        yield name, TensorLayout(gname, gshape, dtype_name(t.dtype), shape, pieces, is_buffer), t


def _layer_prefix_map(core: nn.Module, pp: tuple[int, int]) -> dict[str, str]:
    """``decoder.layers.0`` -> ``decoder.layers.16`` for a module with ``layer_number`` 17.

    On a pipeline stage (``pp`` size over 1) a ``layers.K`` module without an integer
    ``layer_number`` is refused: its local index names some other stage's layer too."""
    out = {}
    for mod_name, mod in named_modules(core):
        # the name first (most end in no index), then the instance's own attributes
        # (Megatron's layers set it in __init__), the class's only where it has one:
        # nn.Module.__getattr__ raising for each of a MoE model's ~1000 experts (their
        # names end in an index too) cost more than the walk
        head, _, last = mod_name.rpartition(".")
        if not last.isdigit():
            continue
        number = vars(mod).get("layer_number")
        if number is None and hasattr(type(mod), "layer_number"):
            number = getattr(mod, "layer_number", None)
        if not isinstance(number, int) and pp[1] > 1 and head.rpartition(".")[2] == "layers":
            raise LayoutError(
                f"{mod_name}: a layer of pipeline stage {pp[0]} of {pp[1]} without an integer "
                f"layer_number (Megatron-core's 1-based global index; got {number!r}), so its "
                "tensors cannot be given global layer names; set layer_number or pass "
                "src_layout/dst_layout explicitly"
            )
        if isinstance(number, int) and int(last) != number - 1:
            # only layers whose local index is not their global one: none without
            # pipeline stages, and then no tensor's name is looked up at all
            out[mod_name] = f"{head}.{number - 1}" if head else str(number - 1)
    return out


def _global_layer_name(name: str, layer_map: dict[str, str]) -> str:
    """``name`` with its longest prefix in ``layer_map`` replaced. Every key ends in a
    layer index, so only prefixes ending in a digit part are looked up (an expert's
    name has one or two of those among its eight or nine parts)."""
    if not layer_map:
        return name
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i - 1].isdigit():
            mapped = layer_map.get(".".join(parts[:i]))
            if mapped is not None:
                return ".".join([mapped] + parts[i:])
    return name


def _expert_match(name: str) -> tuple[re.Match | None, int]:
    """The expert index's match in ``name`` (``local_experts.K`` or ``weightK``) and its
    group number; (None, 0) where there is none."""
    m = _LOCAL_EXPERT.search(name)
    if m is not None:
        return m, 2
    m = _GROUPED_EXPERT.search(name)
    return (m, 3) if m is not None else (None, 0)


def _local_expert_index(name: str) -> int | None:
    m, group = _expert_match(name)
    return None if m is None else int(m.group(group))


def _local_expert_count(core: nn.Module, named: list, ep_size: int) -> int:
    """Experts per expert-parallel rank: from the config where it says, else counted."""
    total = getattr(getattr(core, "config", None), "num_moe_experts", None)
    if isinstance(total, int) and total > 0:
        if total % ep_size:
            raise LayoutError(f"{total} experts do not divide over expert-parallel size {ep_size}")
        return total // ep_size
    indices = [_local_expert_index(n) for n, t in named if not getattr(t, "allreduce", True)]
    indices = [i for i in indices if i is not None]
    return max(indices) + 1 if indices else 0


def _global_expert_name(gname: str, ep: tuple[int, int], n_local: int, local_name: str) -> str:
    ep_rank, ep_size = ep
    if ep_size == 1:  # every expert is here under its global index already
        return gname
    m, group = _expert_match(gname)
    if m is None:
        # A fused tensor of all local experts is only global without expert parallelism.
        if ep_size > 1:
            raise LayoutError(
                f"{local_name}: expert parameter (allreduce=False) without a local expert index "
                "(local_experts.K or weightK) cannot be placed across expert-parallel ranks; "
                "describe it with an explicit layout"
            )
        return gname
    k = int(m.group(group))
    if k >= n_local:
        raise LayoutError(f"{local_name}: local expert {k} exceeds {n_local} local experts")
    return gname[: m.start(group)] + str(ep_rank * n_local + k) + gname[m.end(group):]


