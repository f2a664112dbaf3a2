"""``swap_model_weights``: a drop-in for Megatron-core's function of that name, and the
cache of Refitters behind it (one per model pair, transport, group and keywords).

Every rank calls it with the same arguments each step; the first call plans (a
collective :class:`~torchrefit.refitter.Refitter` construction), later ones only refit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ._util.weak_models import alive, identity, weak
from .connect import Connection
from .maps import Identity, NameMap
from .refitter import RefitReport, Refitter
from .transport.base import DEFAULT_TIMEOUT, Transport

__all__ = ["swap_model_weights", "clear_caches"]


@dataclass
class _Cached:
    """A cached Refitter and weak references to the models it was built for."""

    src: tuple
    dst: tuple
    refitter: Refitter


_CACHE: dict[tuple, _Cached] = {}
_GLOO_GROUPS: dict[tuple, dist.ProcessGroup] = {}


def swap_model_weights(
    src_model,
    target_model,
    refit_method: str | Transport = "nccl",
    group: dist.ProcessGroup | Connection | None = None,
    src_rank_offset: int = 0,
    dst_rank_offset: int = 0,
    timeout: float | None = DEFAULT_TIMEOUT,
    **kwargs,
) -> RefitReport:
    """Drop-in for Megatron-core's ``swap_model_weights``: refit ``target_model`` from
    ``src_model``, planning once and caching the plan per model pair. Collective.

    The cache is keyed by the models' identities, the transport, the group, the offsets
    and every keyword (lists and name maps included); it holds the models weakly and
    drops an entry as soon as one of its models is garbage collected. Every rank must
    hit or miss it together: a rank that replaces its model must do so on all ranks, or
    call :func:`clear_caches` everywhere.

    ``refit_method="gloo"`` on a group without a Gloo backend (an NCCL world) builds a
    Gloo group over the same ranks once, and reuses it, as megatron-core does.
    """
    if refit_method == "gloo":
        group = _gloo_group(group)
    key = (identity(src_model), identity(target_model), _freeze(refit_method), id(group),
           src_rank_offset, dst_rank_offset, timeout, _freeze(kwargs))
    hit = _CACHE.get(key)
    if hit is None or not (alive(hit.src, src_model) and alive(hit.dst, target_model)):
        refitter = Refitter(src_model, target_model, transport=refit_method, group=group,
                            src_rank_offset=src_rank_offset, dst_rank_offset=dst_rank_offset,
                            timeout=timeout, **kwargs)
        drop = _dropper(key)
        hit = _CACHE[key] = _Cached(weak(src_model, drop), weak(target_model, drop), refitter)
    return hit.refitter.refit()


def _gloo_group(group):
    """``group`` if it has a Gloo backend, else a Gloo group over the same ranks (made
    once per group; collective over its ranks only)."""
    if isinstance(group, Connection):
        return group  # tr.connect's group: its backend was chosen there
    group = group if group is not None else dist.group.WORLD
    if "gloo" in str(dist.get_backend(group)):
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    got = _GLOO_GROUPS.get(ranks)
    if got is None:
        got = _GLOO_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo",
                                                   use_local_synchronization=True)
    return got


def _dropper(key: tuple):
    def drop(_ref) -> None:  # a model of this entry was garbage collected
        entry = _CACHE.pop(key, None)
        if entry is not None:
            entry.refitter.close()
    return drop


def _freeze(value) -> object:
    """A hashable, equal-for-equal-values form of a keyword value, for the cache key."""
    if isinstance(value, (str, bytes, int, float, bool, type(None))):
        return value
    if isinstance(value, NameMap):
        if type(value).cache_key is NameMap.cache_key and type(value) is not Identity:
            return ("map", id(value))  # a map that does not say what identifies it
        return ("map", value.cache_key())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(map(repr, value))))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(k), _freeze(v)) for k, v in value.items())))
    try:
        hash(value)
        return value
    except TypeError:
        return ("id", id(value))  # an unhashable object: the same object hits


def clear_caches() -> None:
    """Drop every cached Refitter of :func:`swap_model_weights` (and with it its plan,
    programs and message pools). Not collective, but call it on every rank, since ranks
    must hit or miss the cache together."""
    for entry in list(_CACHE.values()):
        entry.refitter.close()
    _CACHE.clear()
