"""Plain local tensors annotated with their sharding: torchtitan's ``spmd_types`` backend.

torchtitan's default backend (``parallelism.spmd_backend = "spmd_types"``) shards a
model's parameters and buffers into plain ``torch.Tensor`` local shards, not DTensors,
and records each one's sharding as attributes of the tensor object (the
``spmd_types`` package's ``_local_type``, a dict mesh axis -> ``R`` / ``I`` / ``V`` /
``P``, and ``_partition_spec``, which tensor dim each ``V`` axis cuts, in cutting
order). The tensor's shape is its local shape: read as a whole tensor, a shard would
pass for a smaller model's tensor.

Per annotated tensor: an axis of size 1, ``R`` or ``I`` cuts nothing; a ``V`` axis
that the partition spec names cuts that dim as DTensor's ``Shard`` does, axes named
together cutting it in the order named (``(dp, cp)``: by dp, then each dp slice by
cp). The global size of a cut dim is the local size times the axes' sizes (the even
split torchtitan's ``spmd_distribute_tensor`` makes; an uneven one gives ranks
different global shapes, which the planner refuses). This rank's index on an axis
comes from the axis' rank layout and the default group's rank. Refused, with a
``LayoutError`` naming the tensor and the rule: ``P`` (unreduced partial sums), ``V``
without a partition spec (varying data that is no cut of a global tensor).

The annotations live on the tensor object, so whatever replaces it drops them:
``model.to_empty()`` after ``Module.parallelize`` on the meta device keeps only the
buffers'. A torchtitan module that declares a sharded layout for a parameter holding
a plain tensor without annotations (backend ``spmd_types``, more than one rank) is
refused as well: its cut is no longer written anywhere torchrefit can read, and
reading it whole would move one rank's shard as the whole tensor.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import torch
from torch import nn

from ..errors import LayoutError
from ._described import Described, chunk_key, named_refit_tensors, unwrap_chunks
from ._types import ModelLayout, TensorLayout, dtype_name
from .placements import placement_pieces
from .replicated import whole_tensor_layout
from .walk import named_modules

__all__ = ["spmd_annotated", "is_spmd_annotated_model", "annotated_tensor_layout"]

_LOCAL_TYPE = "_local_type"  # spmd_types' attribute names (spmd_types 0.2)
_PARTITION_SPEC = "_partition_spec"
_FIX = ("build the trainer with parallelism.spmd_backend=\"partial_dtensor\" (or "
        "\"full_dtensor\"): its shards are DTensors, which torchrefit reads")


def _chunks(model) -> list:
    return [model] if isinstance(model, Mapping) else unwrap_chunks(model)


def is_spmd_annotated_model(model) -> bool:
    """Whether a refit tensor of ``model`` carries ``spmd_types`` annotations, or a
    torchtitan module parallelized by the ``spmd_types`` backend lost them."""
    if "spmd_types" not in sys.modules:
        return False  # no tensor can carry its annotations yet
    chunks = _chunks(model)
    return (any(hasattr(t, _LOCAL_TYPE) for c in chunks for _, t in named_refit_tensors(c))
            or bool(_unannotated_shards(chunks)))


def spmd_annotated(model: nn.Module | list[nn.Module] | Mapping[str, torch.Tensor]) -> Described:
    """Describe a model whose local tensors carry ``spmd_types`` annotations, on this rank."""
    chunks = _chunks(model)
    lost = _unannotated_shards(chunks)
    if lost:
        name, declared = lost[0]
        more = f" (and {len(lost) - 1} more)" if len(lost) > 1 else ""
        raise LayoutError(
            f"{name}: torchtitan's spmd_types backend declares it cut over mesh axes {declared}, "
            f"but the tensor carries no spmd_types annotation{more} (model.to_empty() after "
            f"parallelize replaces parameters and drops them), so whether and how this rank's "
            f"tensor is cut is unknown; {_FIX}, or keep the annotated tensors (parallelize a "
            f"model built on a real device)")
    entries, tensors = [], {}
    for i, chunk in enumerate(chunks):
        for qualified, t in named_refit_tensors(chunk):
            key = chunk_key(i, len(chunks), qualified)
            entries.append((key, annotated_tensor_layout(qualified, t,
                                                         is_buffer=not isinstance(t, nn.Parameter))))
            tensors[key] = t
    return Described(ModelLayout(tuple(entries)), tensors)


def annotated_tensor_layout(name: str, t: torch.Tensor, *, is_buffer: bool) -> TensorLayout:
    """The layout of a plain tensor: its annotations' cut, or whole where it has none."""
    local_type = getattr(t, _LOCAL_TYPE, None)
    if not local_type:
        return whole_tensor_layout(name, t, is_buffer=is_buffer)
    cuts = _cuts(name, local_type, getattr(t, _PARTITION_SPEC, None), t.dim())
    if not cuts:
        return whole_tensor_layout(name, t, is_buffer=is_buffer)
    global_shape = list(t.shape)
    for dim, size, _ in cuts:
        global_shape[dim] *= size
    from torch.distributed.tensor import Shard

    local_shape, pieces = placement_pieces(
        tuple(global_shape), [s for _, s, _ in cuts], [c for _, _, c in cuts],
        [Shard(d) for d, _, _ in cuts], name=name)
    if local_shape != tuple(t.shape):  # the even split failed to reproduce the local shape
        raise LayoutError(f"{name}: spmd_types annotations {local_type} give a local shape "
                          f"{list(local_shape)}, but the tensor is {list(t.shape)}")
    return TensorLayout(name, tuple(global_shape), dtype_name(t.dtype), local_shape, pieces, is_buffer)


def _cuts(name: str, local_type: Mapping, spec, ndim: int) -> list[tuple[int, int, int]]:
    """(tensor dim, axis size, this rank's index on the axis) per cutting axis, in
    cutting order."""
    import spmd_types as spmd

    by_axis = {}  # axis -> tensor dim it cuts, from the partition spec
    order = []
    for dim, entry in enumerate(spec or ()):
        for axis in (entry if isinstance(entry, tuple) else (entry,) if entry is not None else ()):
            by_axis[axis] = dim
            order.append(axis)
    cuts = []
    for axis in order:
        if _size(axis) > 1 and local_type.get(axis) not in (spmd.R, spmd.I):
            cuts.append((by_axis[axis], _size(axis), _index(name, axis)))
    for axis, kind in local_type.items():
        if _size(axis) == 1 or kind in (spmd.R, spmd.I) or axis in by_axis:
            continue
        what = ("partial sums (P): their sum over the axis is the tensor" if kind == spmd.P
                else "varying (V) with no partition spec saying which dim it cuts")
        raise LayoutError(f"{name}: spmd_types annotation {dict(local_type)}: on mesh axis "
                          f"{axis!r} it holds {what}; a refit moves only cuts of a global tensor")
    if any(d >= ndim for d, _, _ in cuts):
        raise LayoutError(f"{name}: partition spec {spec} names more dims than the tensor's {ndim}")
    return cuts


def _size(axis) -> int:
    return int(axis.size())


def _index(name: str, axis) -> int:
    """This rank's index on ``axis``: its place in the axis' group of ranks."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise LayoutError(f"{name}: sharded over spmd_types axis {axis!r} without a process group")
    rank = dist.get_rank()
    for group in axis.layout.global_ranks(dist.get_world_size()):
        if rank in group:
            return group.index(rank)
    raise LayoutError(f"{name}: rank {rank} is in no group of spmd_types axis {axis!r}")


def _unannotated_shards(chunks: list) -> list[tuple[str, str]]:
    """(name, declared layout) of parameters a torchtitan module, parallelized by the
    ``spmd_types`` backend over more than one rank, declares cut but holds as plain
    tensors without annotations."""
    utils = sys.modules.get("torchtitan.distributed.utils")
    import torch.distributed as dist

    if (utils is None or utils.get_spmd_backend() != "spmd_types"
            or not dist.is_initialized() or dist.get_world_size() == 1):
        return []
    import spmd_types as spmd
    from torch.distributed.tensor import DTensor

    out = []
    for chunk in chunks:
        if not isinstance(chunk, nn.Module):
            continue
        for prefix, module in named_modules(chunk):
            config = getattr(module, "_sharding_config", None)
            if not getattr(module, "_parallelized", False) or config is None:
                continue
            for pname, p in module._parameters.items():
                layout = getattr(config, "state_shardings", {}).get(pname)
                if (p is None or layout is None or isinstance(p, DTensor) or hasattr(p, _LOCAL_TYPE)
                        or all(k in (spmd.R, spmd.I) for k in layout.axis_types.values())):
                    continue
                out.append((f"{prefix}.{pname}" if prefix else pname, _declared(layout)))
    return out


def _declared(layout) -> str:
    axes = ", ".join(f"{getattr(a, 'value', a)}: {k!r}" for a, k in layout.axis_types.items())
    return "{" + axes + "}"
