"""Plan every rank of a world in one process, from layouts alone (no processes, no GPUs).

Used to test the planner's cross-rank agreement and to explain a refit before
launching it (``torchrefit plan``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..layout._types import Box, ModelLayout, TensorLayout
from ..maps import NameMap
from .planner import CastPolicy, Planner, _overlapping
from .roster import encode_roster
from .types import RankPlan, shadow_key

SHADOW = shadow_key("")  # the suffix of an FP8 destination's shadow key

__all__ = ["plan_world", "check_agreement"]


def plan_world(
    src: Sequence[ModelLayout | None],
    dst: Sequence[ModelLayout | None],
    *,
    name_map: NameMap | None = None,
    cast: CastPolicy = "buffers",
    ranks: Sequence[int] | None = None,
    fp8_block: tuple[int, int] = (128, 128),
    sender_transforms: bool = True,
) -> dict[int, RankPlan]:
    """The plans of ``ranks`` (default: all) of a world whose rank r holds ``src[r]``
    and ``dst[r]``; validates the whole refit first, as every rank would."""
    world = len(src)
    planner = Planner.from_rosters([encode_roster(s) if s is not None else None for s in src],
                                   [encode_roster(d) if d is not None else None for d in dst],
                                   name_map, cast=cast, fp8_block=fp8_block,
                                   sender_transforms=sender_transforms)
    planner.validate()
    chosen = range(world) if ranks is None else ranks
    return {r: planner.plan_rank(r, world, src[r], dst[r]) for r in chosen}


def check_agreement(plans: dict[int, RankPlan], dst: Sequence[ModelLayout | None],
                    src: Sequence[ModelLayout | None] | None = None) -> None:
    """Assert what a correct world of plans satisfies (raises AssertionError saying what not):

    * what each rank sends to a peer is what that peer receives from it, same order;
    * every element of every destination piece is written exactly once;
    * each receive and local copy writes its region where this rank's destination
      layout holds it (the local box follows from the pieces, not from the plan); with
      ``src``, each send and local copy reads a tensor of the same global name at
      the place the source layout holds the region (an identity map: where the names
      differ, a name map decides, and the read side is not checked).
    """
    for s, plan in plans.items():
        for d in plan.send_peers:
            if d not in plans:
                continue
            sent = [(t.name, t.region, t.wire_dtype) for t in plan.sends if t.peer == d]
            got = [(t.name, t.region, t.wire_dtype) for t in plans[d].recvs if t.peer == s]
            assert sent == got, f"rank {s} -> rank {d}: sends and receives differ"
    for r, plan in plans.items():
        layout = dst[r]
        want = {(t.name, p.box) for _, t in layout for p in t.pieces} if layout is not None else set()
        counts: dict[str, int] = {}
        for c in plan.local:
            counts[c.name] = counts.get(c.name, 0) + c.region.numel
        for t in plan.recvs:
            counts[t.name] = counts.get(t.name, 0) + t.region.numel
        need: dict[str, int] = {}
        for name, box in want:
            need[name] = need.get(name, 0) + box.numel
        assert counts == {k: v for k, v in need.items() if v}, f"rank {r}: coverage differs"
        _assert_disjoint(r, [(c.name, c.region) for c in plan.local] + [(t.name, t.region) for t in plan.recvs])
        held = dict(layout.tensors) if layout is not None else {}
        for t in plan.recvs:
            _assert_placed(r, "receive", held, t.name, t.region, t.key, t.local_box, strict=True)
        for c in plan.local:
            _assert_placed(r, "local copy", held, c.name, c.region, c.dst_key, c.dst_box, strict=True)
        if src is not None and src[r] is not None:
            held = dict(src[r].tensors)
            for t in plan.sends:
                _assert_placed(r, "send", held, t.name, t.region, t.key, t.local_box, strict=False)
            for c in plan.local:
                _assert_placed(r, "local copy", held, c.name, c.region, c.src_key, c.src_box, strict=False)


def _assert_placed(rank: int, what: str, held: dict[str, TensorLayout], name: str, region: Box,
                   key: str, local_box: Box, strict: bool) -> None:
    """``local_box`` of local tensor ``key`` is where ``held`` places ``region`` of
    global ``name``. ``strict``: ``key`` must hold ``name`` (a destination); else keys
    that hold another name or none (FP8 buffers) are left unchecked."""
    t = held.get(key.removesuffix(SHADOW))
    if t is None or t.name != name:
        assert not strict, (f"rank {rank}: {what} of {name} {region} into {key!r}, which holds "
                            f"{t.name if t is not None else 'nothing'}")
        return
    for p in t.pieces:
        if p.box.contains(region):
            want = Box(tuple(o - b + lo for o, b, lo in zip(region.offset, p.box.offset, p.local_offset)),
                       region.size)
            assert local_box == want, (f"rank {rank}: {what} of {name} {region} at {local_box} of "
                                       f"{key!r}, where its layout holds it at {want}")
            return
    raise AssertionError(f"rank {rank}: {what} of {name} {region}: no piece of {key!r} holds it")


def _assert_disjoint(rank: int, regions) -> None:
    by_name: dict[str, list] = {}
    for name, box in regions:
        by_name.setdefault(name, []).append(box)
    for name, boxes in by_name.items():
        if _overlapping(boxes):
            pair = next((a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]
                        if a.intersect(b) is not None)
            raise AssertionError(f"rank {rank}: {name} {pair[0]} and {pair[1]} overlap")
