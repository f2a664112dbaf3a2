"""Buckets: the order in which destination tensors are refit when a rank is a sink.

A ``load_weights`` sink (``layout.sink``) receives into one buffer of at most
``bucket_bytes`` and hands each bucket to the engine before the next one reuses
the buffer. Senders must send bucket by bucket too, so the bucket sequence is part
of the pure plan: every rank derives it from the gathered rosters and each sink
rank's budget, identically. A refit with sinks then runs one phase per bucket
(:func:`split_plan`); destination tensors that no sink holds go in the first phase.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import PlanError
from ..layout.sink import SINK_ALIGN as ALIGN
from .roster import decode_roster
from .types import RankPlan, itemsize

__all__ = ["ALIGN", "align", "plan_buckets", "split_plan"]

def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _local_bytes(blob: bytes) -> list[tuple[str, int]]:
    """(global name, bytes this rank holds of it), in the sink's own order."""
    out = []
    for name, _, dtype, _, boxes in decode_roster(blob).entries:
        numel = 0
        for _, size in boxes:
            n = 1
            for s in size:
                n *= s
            numel += n
        out.append((name, numel * itemsize(dtype)))
    return out


def plan_buckets(
    sinks: Mapping[int, tuple[bytes, int]], other_names: Sequence[str] = (),
    scales: Mapping[str, str] | None = None,
) -> tuple[tuple[str, ...], ...]:
    """The bucket sequence: tuples of destination global names.

    ``sinks`` maps each sink rank to its roster bytes and its ``bucket_bytes``. Names
    follow the lowest sink rank's order (then names only other sinks hold, by rank);
    a bucket closes when adding the next name would push any sink rank's buffer
    (tensors at :data:`ALIGN`-ed offsets) past its budget. ``scales`` maps an FP8
    weight to its scale tensor: the scale goes right after its weight, in the same
    bucket (the quantize step writes both at once, and the engine loads them together).
    ``other_names`` (destination tensors no sink holds) join the first bucket.
    """
    classes: dict[tuple[bytes, int], list[int]] = {}
    for rank in sorted(sinks):
        classes.setdefault(sinks[rank], []).append(rank)
    held = [(ranks, dict(_local_bytes(blob)), budget)
            for (blob, budget), ranks in classes.items()]
    scales = scales or {}
    order = _order(sinks)
    derived = set(scales.values())
    buckets: list[list[str]] = []
    used = [0] * len(held)
    for name in order:
        if name in derived:
            continue  # placed with its weight
        unit = [name, scales[name]] if name in scales else [name]
        _check_fits(unit, held)
        need = _add(used, unit, held)
        if not buckets or any(n > budget for n, (_, _, budget) in zip(need, held)):
            buckets.append([])
            need = _add([0] * len(held), unit, held)
        buckets[-1].extend(unit)
        used = need
    sink_names = set(order)
    rest = [n for n in other_names if n not in sink_names]
    if rest:
        if not buckets:
            buckets.append([])
        buckets[0].extend(sorted(rest))
    return tuple(tuple(b) for b in buckets)


def _order(sinks: Mapping[int, tuple[bytes, int]]) -> list[str]:
    seen: dict[str, None] = {}
    for rank in sorted(sinks):
        for name, _ in _local_bytes(sinks[rank][0]):
            seen.setdefault(name, None)
    return list(seen)


def _add(used: list[int], unit: list[str], held) -> list[int]:
    """Each sink class's buffer bytes after laying ``unit``'s tensors out at aligned offsets."""
    out = []
    for u, (_, h, _) in zip(used, held):
        for name in unit:
            if name in h:
                u = align(u) + h[name]
        out.append(u)
    return out


def _check_fits(unit: list[str], held) -> None:
    for ranks, h, budget in held:
        need = _add([0], unit, [(ranks, h, budget)])[0]
        if need > budget:
            what = unit[0] if len(unit) == 1 else f"{unit[0]} with its scale {unit[1]}"
            raise PlanError(
                f"{what}: {need} bytes on sink ranks {ranks[:8]} exceed their bucket_bytes "
                f"{budget}; raise bucket_bytes to at least the largest tensor a sink receives")


def split_plan(plan: RankPlan, buckets: Sequence[Sequence[str]]) -> list[RankPlan]:
    """This rank's plan cut into one plan per bucket (by destination global name);
    each keeps the agreed (peer, name, region) order of the whole plan."""
    phase = {name: i for i, names in enumerate(buckets) for name in names}
    parts: list[tuple[list, list, list, list]] = [([], [], [], []) for _ in buckets]
    for c in plan.local:
        parts[phase[c.name]][0].append(c)
    for t in plan.sends:
        parts[phase[t.name]][1].append(t)
    for t in plan.recvs:
        parts[phase[t.name]][2].append(t)
    for q in plan.quantize:
        parts[phase[q.name]][3].append(q)
    return [RankPlan(plan.rank, plan.world, tuple(lo), tuple(se), tuple(re), tuple(qu))
            for lo, se, re, qu in parts]
