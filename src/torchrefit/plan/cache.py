"""Plans kept across Refitters (``Refitter(plan_cache=...)``).

A plan is a pure function of what every rank described (the gathered rosters), this
rank's place and local names, and the arguments that shape it: the name map, the cast,
skip and FP8 rules, and the transport's class. Refitters that see the same of all of
these (many edges between replicas of one layout, a restart of a replica) can share one
plan instead of planning again: pass them one :class:`PlanCache`.

Keys hold what they are made of: a name map by its ``cache_key()`` where its class says
what identifies it, otherwise (like any other argument that is not a plain value) by the
object itself, held by the key, so an equal key never stands for another object that
happens to reuse a dead one's address. Such an object must not change after it was given.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

from ..maps.base import Identity, NameMap

__all__ = ["PlanCache", "plan_key"]


class PlanCache:
    """Plans kept for reuse, at most ``most`` of them (the oldest goes first). ``built``:
    plans made and kept here; ``reused``: plans taken from here instead of made. One per
    process or per rank; thread-safe (a fleet's relay builds edges from two threads)."""

    def __init__(self, most: int = 64) -> None:
        if most < 1:
            raise ValueError(f"PlanCache: most must be >= 1, not {most}")
        self.most, self.built, self.reused = most, 0, 0
        self._plans: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, key: Hashable) -> Any:
        """The value kept under ``key`` (counted as reused), or None."""
        with self._lock:
            got = self._plans.get(key)
            if got is not None:
                self.reused += 1
            return got

    def put(self, key: Hashable, value: Any) -> None:
        """Keep ``value`` under ``key`` (counted as built)."""
        with self._lock:
            self.built += 1
            self._plans.pop(key, None)
            if len(self._plans) >= self.most:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = value


class _Same:
    """An object compared by identity and held alive by the key it is part of."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def frozen(value: object) -> Hashable:
    """``value`` as a key part that is equal only for arguments that plan alike."""
    if value is None or isinstance(value, (str, bytes, int, float, bool)):
        return (type(value).__name__, value)
    if isinstance(value, NameMap):
        if type(value) is Identity or type(value).cache_key is not NameMap.cache_key:
            return ("map", value.cache_key())
        return ("map", _Same(value))  # a map that does not say what identifies it
    if isinstance(value, (list, tuple)):
        return ("seq", tuple(frozen(v) for v in value))
    return ("object", _Same(value))


def plan_key(rosters: tuple, kinds: tuple, rank: int, world: int, src_keys: tuple | None,
             dst_keys: tuple | None, name_map: NameMap, cast: object, skip: object, fp8_block: object,
             transport_cls: type) -> Hashable:
    """Everything one rank's plan depends on (see the module docstring)."""
    return (rosters, kinds, rank, world, src_keys, dst_keys, frozen(name_map), frozen(cast),
            frozen(tuple(skip)), frozen(tuple(fp8_block)), transport_cls)
