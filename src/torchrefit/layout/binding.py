"""Which attribute of the model holds each described tensor, to notice a replaced one.

An engine that sleeps and wakes, a trainer that re-wraps its modules, or user code
doing ``module.weight = nn.Parameter(new)`` puts a new tensor object where the model
was described with the old one: a refit would then write into (or read from) a tensor
the model no longer uses, silently. A :class:`Binding` remembers, per local key, the
dict (``module._parameters``, ``module._buffers`` or a mapping model) and the name
that held the tensor when the model was described. ``Refitter.refit()`` asks it
before every refit (``watch="manual"``: only ``Refitter.rebind()`` does), on this rank
only (one identity check per tensor, no collective); where one changed it takes the
model's current tensor if it has the same shape, dtype and device (the plan stays
valid: only compiled views are rebuilt) and otherwise raises :class:`LayoutError`
naming it.

``param.data = new`` keeps the Parameter object and moves its storage, or views the
same storage another way (``param.data = param.data.t()``): the compiled program
notices either itself (``Program.storage_moved``) and recompiles.

Not bound (only their storage is watched): tensors an adapter derived from the
model (views, or a DTensor's local tensor that is not the DTensor's own), and whole
submodules replaced (the old module's dicts are still the ones checked): build a new
Refitter after such a change.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, MutableMapping

import torch
from torch import nn

from .._native.watch import holders_check
from .._util.identity import identity
from ..errors import LayoutError
from .walk import named_modules

__all__ = ["Binding", "Meta", "check_same_meta", "meta_of"]

#: what a compiled refit assumes of a local tensor: shape, dtype, device
Meta = tuple[tuple[int, ...], torch.dtype, torch.device]


def meta_of(t: torch.Tensor) -> Meta:
    return tuple(t.shape), t.dtype, t.device


class Binding:
    """The holders of one rank's described tensors of one model (one side)."""

    def __init__(self, model, tensors: Mapping[str, torch.Tensor], side: str) -> None:
        self.side = side
        where = _holders(model)
        self.keys: list[str] = []
        self._dicts: list[MutableMapping] = []
        self._names: list[str] = []
        self._local: list[bool] = []  # a DTensor held, its local tensor described
        self._held: list[torch.Tensor] = []
        for key, t in tensors.items():
            got = where.get(identity(t))
            if got is None:
                continue
            self.keys.append(key)
            self._dicts.append(got[0])
            self._names.append(got[1])
            self._local.append(got[2])
            self._held.append(t)
        self._any_local = any(self._local)
        # module._parameters / _buffers are plain dicts: dict.get as the mapped function
        # keeps the per-refit check in C (half the host time of a Python helper per
        # tensor: qwen3-30b-a3b, 8 layers, holds 4218 tensors); mapping models may not be
        self._get = dict.get if all(type(d) is dict for d in self._dicts) else _get
        # made now, while the Refitter's construction pauses the collector: made at the
        # first refit, its lists of every holder set off a collection there
        self._native = self._native_check()

    def __len__(self) -> int:
        return len(self.keys)

    def changed(self) -> dict[str, torch.Tensor | None]:
        """Keys whose holder now holds another tensor (None: it holds nothing), with it.
        Called before every refit: C-level passes (no Python frame per tensor) where
        nothing changed."""
        if self._native is not None and self._native.unchanged():
            return {}
        now = list(map(self._get, self._dicts, self._names))
        if self._any_local:
            now = [_local_of(t) if local else t for t, local in zip(now, self._local)]
        if all(map(operator.is_, now, self._held)):
            return {}
        return {k: t for k, t, old in zip(self.keys, now, self._held) if t is not old}

    def adopt(self, tensors: Mapping[str, torch.Tensor], changed: Mapping[str, torch.Tensor | None],
              rank: int) -> dict[str, torch.Tensor]:
        """``tensors`` with the changed keys taken from the model, each checked to be a
        drop-in for the old one (raises :class:`LayoutError` naming it otherwise)."""
        out = dict(tensors)
        for key, new in changed.items():
            check_same_meta(self.side, key, meta_of(tensors[key]), new, rank)
            out[key] = new
        self._held = [out[k] for k in self.keys]
        self._native = self._native_check()  # the old one holds the old tensors
        return out

    def renew_native(self) -> None:
        """Take the native check now (a build landed since this binding was made)."""
        self._native = self._native_check()

    @property
    def native(self) -> bool:
        """Whether ``changed()`` asks the native check first."""
        return self._native is not None

    def _native_check(self):
        """The same check as one C++ call where it was built (``_native.watch``), over
        the tensors held now: plain dicts holding the described tensors themselves
        only; None otherwise or without it."""
        if self._get is not dict.get or self._any_local:
            return None
        return holders_check(self._dicts, self._names, self._held)


def check_same_meta(side: str, key: str, was: Meta, new: torch.Tensor | None, rank: int) -> None:
    """Raise unless ``new`` can take ``old``'s place in a compiled refit (same local
    shape, dtype and device: the plan's boxes and casts still hold)."""
    role = "source" if side == "src" else "destination"
    if new is None:
        raise LayoutError(f"{role} tensor {key!r} on rank {rank} was removed from the model since "
                          "the Refitter was built: build a new Refitter", ranks=(rank,),
                          rule="tensor replaced", tensor=key)
    now = meta_of(new)
    if was != now:
        raise LayoutError(
            f"{role} tensor {key!r} on rank {rank} was replaced, reallocated or re-viewed since the "
            f"Refitter was built, with shape, dtype, device {now} instead of {was}: the plan no longer "
            "fits it; nothing was written on this rank; build a new Refitter (its peers raise "
            "TransportError naming this rank once their timeout passes)",
            ranks=(rank,), rule="tensor replaced", tensor=key)


def _get(d: MutableMapping, name: str):
    return d.get(name)


def _local_of(t):
    return None if t is None else getattr(t, "_local_tensor", t)


def _holders(model) -> dict[int, tuple[MutableMapping, str, bool]]:
    """identity(tensor) -> (the dict holding it, its name there, whether it is a DTensor's
    local tensor), for every parameter and buffer of every chunk of ``model``."""
    out: dict[int, tuple[MutableMapping, str, bool]] = {}
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        if isinstance(chunk, MutableMapping):
            for name, t in chunk.items():
                out.setdefault(identity(t), (chunk, name, False))
            continue
        if not isinstance(chunk, nn.Module):
            continue
        for _, module in named_modules(chunk):
            for d in (module._parameters, module._buffers):
                for name, t in d.items():
                    if t is None:
                        continue
                    out.setdefault(identity(t), (d, name, False))
                    local = getattr(t, "_local_tensor", None)
                    if local is not None:
                        out.setdefault(identity(local), (d, name, True))
    return out
