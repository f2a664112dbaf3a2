"""DTensor layout: FSDP2 (``fully_shard``), torchtitan-style TP, or any ``DeviceMesh`` model.

Per parameter and persistent buffer that is a ``DTensor``: the global shape and
dtype are the DTensor's, and the pieces its local tensor holds follow from this
rank's mesh coordinate and the placements (``layout.placements``). Tensors that are
not DTensors (the buffers FSDP2 leaves alone) are held whole, as ``replicated``
describes them. Called once per rank while a ``Refitter`` is built, never on the
hot path.

Global names are the qualified names without the wrapper modules torchtitan and
``torch.compile`` insert (``_checkpoint_wrapped_module``, ``_orig_mod``, FSDP1's
``_fsdp_wrapped_module``), so a compiled, checkpointed trainer's names match a plain
engine's. The tensor torchrefit reads and writes is the DTensor's local tensor (for
FSDP2 a view into its padded shard), so a refit writes the parameter itself.

Only this rank's mesh coordinate is read: each rank describes what it holds, and
the refit group may order or subset its ranks as it likes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..errors import LayoutError
from ._described import Described, chunk_key, named_refit_tensors, unwrap_chunks
from ._types import ModelLayout, TensorLayout, dtype_name
from .placements import placement_pieces
from .replicated import whole_tensor_layout

__all__ = ["dtensor", "is_dtensor_model", "global_name"]

#: module names that wrappers insert into qualified names (activation checkpointing,
#: torch.compile, FSDP1); FSDP2 and DDP-style ``.module`` wrappers add none here
WRAPPER_NAMES = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def global_name(qualified: str) -> str:
    """``layers.0._checkpoint_wrapped_module._orig_mod.attn.wq.weight`` -> ``layers.0.attn.wq.weight``."""
    return ".".join(p for p in qualified.split(".") if p not in WRAPPER_NAMES)


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support has no DTensors
        return None
    return DTensor


def _chunks(model) -> list:
    return [model] if isinstance(model, Mapping) else unwrap_chunks(model)


def is_dtensor_model(model) -> bool:
    """Whether any parameter or persistent buffer of ``model`` is a DTensor."""
    cls = _dtensor_type()
    return cls is not None and any(
        isinstance(t, cls) for chunk in _chunks(model) for _, t in named_refit_tensors(chunk)
    )


def dtensor(model: nn.Module | list[nn.Module] | Mapping[str, torch.Tensor]) -> Described:
    """Describe a model whose parameters (some or all) are DTensors, on this rank."""
    cls = _dtensor_type()
    chunks = _chunks(model)
    entries, tensors = [], {}
    for i, chunk in enumerate(chunks):
        if isinstance(chunk, nn.Module):
            _check_fsdp_sharded(chunk)
        for qualified, t in named_refit_tensors(chunk):
            key = chunk_key(i, len(chunks), qualified)
            name = global_name(qualified)
            is_buffer = not isinstance(t, nn.Parameter)
            if cls is not None and isinstance(t, cls):
                layout, local = _describe_one(name, t, is_buffer)
            else:
                layout, local = whole_tensor_layout(name, t, is_buffer=is_buffer), t
            entries.append((key, layout))
            tensors[key] = local
    return Described(ModelLayout(tuple(entries)), tensors)


def _describe_one(name: str, t, is_buffer: bool) -> tuple[TensorLayout, torch.Tensor]:
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise LayoutError(
            f"{name}: this rank is not in the DTensor's device mesh {mesh}; a rank that "
            "holds none of a model passes None for it"
        )
    local_shape, pieces = placement_pieces(
        tuple(t.shape), tuple(mesh.shape), coordinate, tuple(t.placements),
        order=_order(t), name=name,
    )
    with torch.no_grad():
        local = t.to_local()  # without grad: the local tensor itself, or a view of it
    if tuple(local.shape) != local_shape:
        # The placements and the local tensor disagree: a torch whose DTensor cuts
        # differently from ``placements``' reading. Refuse rather than write wrongly.
        raise LayoutError(
            f"{name}: placements {list(t.placements)} at mesh coordinate {list(coordinate)} "
            f"give a local shape {list(local_shape)}, but the local tensor is "
            f"{list(local.shape)}"
        )
    layout = TensorLayout(name, tuple(t.shape), dtype_name(t.dtype), local_shape, pieces, is_buffer)
    return layout, local


def _order(t) -> list[int] | None:
    """Mesh dims in the order their shardings apply, where the spec says (``shard_order``
    in torch versions that have it); None for left to right, DTensor's default."""
    spec = getattr(t, "_spec", None)
    shard_order = getattr(spec, "shard_order", None)
    if not shard_order or getattr(spec, "use_strided_shard_as_shard_order", True):
        return None  # _StridedShard placements encode the order themselves
    order = [m for entry in shard_order for m in entry.mesh_dims]
    return order + [m for m in range(len(t.placements)) if m not in order]


def _check_fsdp_sharded(model: nn.Module) -> None:
    """FSDP2 swaps a module's parameters for unsharded ones between its forward and
    backward (and keeps them after a forward with ``reshard_after_forward=False``);
    those are freed later, so describing them would refit into dead storage."""
    names = None
    for mod in model.modules():
        state = getattr(mod, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
        for fp in getattr(group, "fsdp_params", ()):
            info, sharded = getattr(fp, "_module_info", None), getattr(fp, "sharded_param", None)
            held = getattr(info.module, info.param_name, None) if info is not None else None
            if sharded is None or held is None or held is sharded:
                continue
            names = names or {id(p): n for n, p in model.named_parameters()}
            raise LayoutError(
                f"{names.get(id(held), info.param_name)}: FSDP2 holds this parameter unsharded "
                "(between forward and backward, or after a forward with "
                "reshard_after_forward=False); call model.reshard() before building the Refitter"
            )
