"""Running a table of cases on every rank of a test world, one result per case.

The suites that run many cases in one world (layouts, maps, transforms, transports,
planning faults) all need the same loop: run each case, record what it returned or
raised, and meet the other ranks before the next case, so that one failing case neither
stops the others nor leaves a rank waiting in the next case's collectives (torchrefit's
errors reach every rank, so every rank records one).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["run_cases"]

Case = TypeVar("Case")


def run_cases(cases: Iterable[Case], run: Callable[[Case], Any], *,
              key: Callable[[Case], str] = lambda case: case.id, trace: bool = False,
              group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """``{key(case): run(case)}`` for every case, in order, on this rank. A case that
    raises records ``{"error": "<class>: <message>"}`` (with the traceback after it where
    ``trace``); after each case every rank of ``group`` (default: the world) meets in a
    barrier."""
    out: dict[str, Any] = {}
    for case in cases:
        try:
            out[key(case)] = run(case)
        except Exception as e:  # recorded per case; the next case still runs on every rank
            detail = f"\n{traceback.format_exc()}" if trace else ""
            out[key(case)] = {"error": f"{type(e).__name__}: {e}{detail}"}
        dist.barrier(group)
    return out
