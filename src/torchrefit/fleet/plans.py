"""Plans kept per distinct pair of layouts, not per edge.

Every edge of a fleet builds its Refitters collectively, and each plans the moves between
the two jobs' layouts. Replicas of one layout (a restart, a scale-up, a relay re-chained
around a dropped replica) give the same rosters on every rank, so the same plan: a rank
keeps the plans it made, keyed by every rank's rosters and what else a plan depends on
(this rank's place, its local keys, the cast, skip and fp8 rules, the name map, the
transport's protocol), and a new edge between layouts seen before reuses its plan.
"""

from __future__ import annotations

import threading
from typing import Any

from ..refitter import Refitter

__all__ = ["PlanCache", "CachedPlanRefitter"]


class PlanCache:
    """The plans one rank made (``built``: how many it had to make; ``reused``)."""

    def __init__(self, most: int = 64) -> None:
        self.most, self.built, self.reused = most, 0, 0
        self._plans: dict[Any, tuple] = {}
        self._lock = threading.Lock()  # a relay builds edges from two threads

    def get(self, key: Any) -> tuple | None:
        with self._lock:
            got = self._plans.get(key)
            if got is not None:
                self.reused += 1
            return got

    def put(self, key: Any, value: tuple) -> None:
        with self._lock:
            self.built += 1
            if len(self._plans) >= self.most:  # a bounded record: the oldest goes
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = value


class CachedPlanRefitter(Refitter):
    """A ``Refitter`` that takes its plan from ``plans`` where one for the same layouts was
    made before (pass ``plans=`` with the other arguments)."""

    def __init__(self, *args, plans: PlanCache, **kwargs) -> None:
        self._plans = plans
        super().__init__(*args, **kwargs)

    def _plan(self, infos, name_map, cast, skip, fp8_block):
        key = (tuple((i.src, i.dst) for i in infos), self.rank, self.world,
               tuple(k for k, _ in self._src.layout) if self._src else None,
               tuple(k for k, _ in self._dst.layout) if self._dst else None,
               repr(cast), tuple(skip), tuple(fp8_block), self._transport_cls.protocol,
               "identity" if type(name_map).__name__ == "Identity" else id(name_map))
        got = self._plans.get(key)
        if got is not None:
            self._planner, self._plan_error, plan = got
            return plan
        plan = super()._plan(infos, name_map, cast, skip, fp8_block)
        if self._plan_error is None:  # an error is raised on every rank: nothing to keep
            self._plans.put(key, (self._planner, None, plan))
        return plan
