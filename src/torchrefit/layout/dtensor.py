"""DTensor layout: FSDP2 (``fully_shard``), torchtitan-style TP, or any ``DeviceMesh`` model.

Per parameter and persistent buffer that is a ``DTensor``: the global shape and
dtype are the DTensor's, and the pieces its local tensor holds follow from this
rank's mesh coordinate and the placements (``layout.placements``). Tensors that are
not DTensors (the buffers FSDP2 leaves alone) are held whole, as ``replicated``
describes them, unless ``spmd_types`` annotations say how they are cut
(``spmd_annotated``). Called once per rank while a ``Refitter`` is built; only the
``after_refit`` hook of an FSDP2 destination runs on every refit.

Global names are the qualified names without the wrapper modules torchtitan and
``torch.compile`` insert (``_checkpoint_wrapped_module``, ``_orig_mod``, FSDP1's
``_fsdp_wrapped_module``), so a compiled, checkpointed trainer's names match a plain
engine's. The tensor torchrefit reads and writes is the DTensor's local tensor (for
FSDP2 a view into its padded shard), so a refit writes the parameter itself.

FSDP2 models are described by their sharded parameters even while FSDP2 holds
unsharded copies (the root's stay after an inference forward), and a refit into an
FSDP2 model reshards it afterwards (``Described.after_refit``), so its next forward
all-gathers the new weights instead of using stale copies.

Only this rank's mesh coordinate is read: each rank describes what it holds, and
the refit group may order or subset its ranks as it likes.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from itertools import chain, repeat

import torch
from torch import nn

from .._util.identity import identity
from ..errors import LayoutError
from ._described import Described, chunk_key, named_refit_tensors, unwrap_chunks
from ._types import ModelLayout, TensorLayout, dtype_name
from .placements import placement_pieces
from .spmd_annotated import annotated_tensor_layout
from .walk import named_modules

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
    """Whether any parameter or persistent buffer of ``model`` is a DTensor, or any of
    its modules is FSDP2's (which may hold only unsharded copies right now)."""
    if "torch.distributed.tensor" not in sys.modules:
        # no DTensor (nor FSDP2 module, which imports it) can exist yet; importing it
        # only to check would cost seconds of a Refitter's construction on a cold
        # machine (it imports sympy)
        return False
    cls = _dtensor_type()
    chunks = _chunks(model)
    return cls is not None and (bool(_fsdp_modules(chunks)) or any(_holds(chunk, cls) for chunk in chunks))


def _holds(chunk, cls: type) -> bool:
    """Whether a parameter or persistent buffer of ``chunk`` is a ``cls``. Every process
    that imported DTensor asks it of every model it refits (megatron-core imports it):
    parameters in one C-level pass, without their names (``layout_kind`` of a
    qwen3-shaped megatron-core model, 8 layers, 3209 modules, on a 2-core CPU: 1.9 ms
    against 6.0 ms through ``named_refit_tensors``)."""
    if not isinstance(chunk, nn.Module) or type(chunk).named_parameters is not nn.Module.named_parameters:
        return any(isinstance(t, cls) for _, t in named_refit_tensors(chunk))
    modules = [m for _, m in named_modules(chunk)]
    params = chain.from_iterable(m._parameters.values() for m in modules)
    if any(map(isinstance, params, repeat(cls))):
        return True
    return any(isinstance(b, cls) for m in modules if m._buffers for name, b in m._buffers.items()
               if name not in m._non_persistent_buffers_set)


def dtensor(model: nn.Module | list[nn.Module] | Mapping[str, torch.Tensor]) -> Described:
    """Describe a model whose parameters (some or all) are DTensors, on this rank."""
    cls = _dtensor_type()
    chunks = _chunks(model)
    fsdp = _fsdp_modules(chunks)
    sharded = _fsdp_sharded(fsdp)
    entries, tensors = [], {}
    for i, chunk in enumerate(chunks):
        for qualified, t in named_refit_tensors(chunk):
            key = chunk_key(i, len(chunks), qualified)
            name = global_name(qualified)
            is_buffer = not isinstance(t, nn.Parameter)
            t = sharded.get(identity(t), t)
            if cls is not None and isinstance(t, cls):
                layout, local = _describe_one(name, t, is_buffer)
            else:
                # whole, or cut as its spmd_types annotations say (a buffer that
                # torchtitan's spmd_types backend shards and FSDP2 leaves alone)
                layout, local = annotated_tensor_layout(name, t, is_buffer=is_buffer), t
            entries.append((key, layout))
            tensors[key] = local
    after = functools.partial(_reshard, fsdp) if fsdp else None
    return Described(ModelLayout(tuple(entries)), tensors, after)


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


def _fsdp_modules(chunks: list) -> tuple[nn.Module, ...]:
    """The FSDP2 modules (``fully_shard``) of a model's chunks."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return ()
    return tuple(m for c in chunks if isinstance(c, nn.Module) for _, m in named_modules(c)
                 if isinstance(m, FSDPModule))


def _fsdp_sharded(modules: tuple[nn.Module, ...]) -> dict[int, torch.Tensor]:
    """id of each parameter an FSDP2 module holds now -> FSDP2's sharded DTensor for it.

    FSDP2 swaps a module's parameters for unsharded copies between forward and
    backward, and keeps the root's after a forward without backward (inference);
    those copies are freed or go stale, while the sharded parameters are what the
    optimizer steps and what the next all-gather reads. So the sharded ones are
    described, in whichever state the model is. FSDP2 keeps this map in private
    attributes (torch 2.13); where they are missing the registered parameters are
    described, which are the sharded ones whenever the model is resharded.
    """
    out = {}
    for mod in modules:
        for fp in _fsdp_params(mod):
            info, sharded = getattr(fp, "_module_info", None), getattr(fp, "sharded_param", None)
            held = getattr(info.module, info.param_name, None) if info is not None else None
            if held is not None and sharded is not None:
                out[identity(held)] = sharded
    return out


def _fsdp_params(mod: nn.Module) -> list:
    state = mod._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch versions with one group per module
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return [fp for g in groups for fp in getattr(g, "fsdp_params", ())]


def _reshard(modules: tuple[nn.Module, ...]) -> None:
    """After a refit into an FSDP2 model: drop unsharded copies of the old weights, so
    the next forward all-gathers the new ones (a no-op for modules already sharded)."""
    for m in modules:
        m.reshard()
