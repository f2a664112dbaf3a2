"""The deduplicated metadata gather: digests from every rank, each distinct roster once.

In process: on a grid of simulated layouts (dense and MoE, collocated and not, with
and without replicas), the rosters rebuilt from digests and the owners' broadcasts
give every rank the same plan, bit for bit, as the full per-rank gather did; the
bytes a rank gathers grow with the distinct rosters, not the world; owners are the
lowest holders and a roster equal in two roles travels once; a corrupted or
mis-sized broadcast is caught. In a 5-rank gloo world: ``all_gather_rosters``
returns exactly what the old full gather returned, receiving only the distinct
rosters, and ``Refitter`` refits replicated layouts (ranks whose rosters differ
beside DP replicas) into the oracle's values with the plan the full gather gives.
"""

from __future__ import annotations

import pytest
import torch

import torchrefit as tr
from torchrefit.layout import describe
from torchrefit.plan.metadata import Gathered, RosterRef, assemble, owners, ref_of, split
from torchrefit.plan.planner import Planner
from torchrefit.plan.roster import encode_roster
from torchrefit.simulate import parse_mesh, preset, simulated_rosters
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local, run_world
from torchrefit.transport.collectives import all_gather_pickled, all_gather_rosters

GRID = [
    # (preset, layers, src, dst, world)
    ("llama-70b", 4, "tp8pp2", "tp4", 64),
    ("llama-70b", 4, "tp2pp2@0:32", "tp4@32:64", 64),
    ("llama-70b", 4, "tp4", "tp4", 32),  # identical layouts: every rank copies locally
    ("llama-70b", 4, "tp2pp4@0:48", "tp8@40:64", 64),  # overlapping ranges
    ("deepseek-v3", 5, "pp4ep8", "tp8ep8", 64),
    ("deepseek-v3", 5, "tp2pp2ep4@0:32", "tp4ep2@32:64", 64),
]


def _full_gather(blobs: list[bytes | None]) -> list[bytes | None]:
    """Today's path: every rank's own roster bytes, a separate object per rank."""
    return [None if b is None else bytes(bytearray(b)) for b in blobs]


def _dedup_gather(src: list[bytes | None], dst: list[bytes | None]):
    """The new protocol without processes: refs, owners, their concatenated rosters."""
    refs = [(ref_of(s), ref_of(d)) for s, d in zip(src, dst)]
    distinct: dict[bytes, bytes] = {}
    for owner, theirs in owners(refs).items():
        mine = {ref.digest: b for ref, b in zip(refs[owner], (src[owner], dst[owner])) if ref}
        distinct.update(split(b"".join(mine[r.digest] for r in theirs), theirs))
    return assemble(refs, distinct, 0), assemble(refs, distinct, 1), refs


@pytest.mark.parametrize("case", GRID, ids=lambda c: f"{c[0]}-{c[2]}-{c[3]}")
def test_deduplicated_rosters_plan_every_rank_bit_for_bit(case) -> None:
    name, layers, src, dst, world = case
    shape = preset(name).with_overrides(layers=layers)
    s = simulated_rosters(shape, parse_mesh(src, world), world)
    d = simulated_rosters(shape, parse_mesh(dst, world), world)
    full = Planner.from_rosters(_full_gather(s.rosters()), _full_gather(d.rosters()))
    got_src, got_dst, refs = _dedup_gather(s.rosters(), d.rosters())
    assert got_src == s.rosters() and got_dst == d.rosters()
    dedup = Planner.from_rosters(got_src, got_dst)
    full.validate()
    dedup.validate()
    for r in range(world):
        a = full.plan_rank(r, world, s.layout(r), d.layout(r))
        b = dedup.plan_rank(r, world, s.layout(r), d.layout(r))
        assert a == b, f"{case}: rank {r} plans differently from deduplicated rosters"
    distinct = {b for b in s.rosters() + d.rosters() if b is not None}
    gathered = Gathered.of([100] * world, refs)
    assert gathered.rosters == sum(len(b) for b in distinct)
    assert gathered.owners <= len(s.classes) + len(d.classes)


def test_gathered_bytes_grow_with_distinct_rosters_not_the_world() -> None:
    shape = preset("deepseek-v3").with_overrides(layers=5)
    got = {}
    for world in (64, 256, 1024):
        s = simulated_rosters(shape, parse_mesh("pp4ep8", world), world)
        d = simulated_rosters(shape, parse_mesh("tp8ep8", world), world)
        refs = [(ref_of(a), ref_of(b)) for a, b in zip(s.rosters(), d.rosters())]
        got[world] = Gathered.of([64] * world, refs)
        full = sum(len(b) for b in s.rosters() + d.rosters() if b is not None)
        assert got[world].rosters * (world // 64) <= full
    assert got[64].rosters == got[256].rosters == got[1024].rosters  # 32 + 8 distinct, whatever the world
    assert got[1024].records == 1024 * 64


def test_owners_are_the_lowest_holders_and_equal_rosters_travel_once() -> None:
    a, b, c = (ref_of(x) for x in (b"a" * 5, b"b" * 7, b"c" * 3))
    refs = [(None, b), (a, b), (a, c), (c, None), (a, a)]
    assert owners(refs) == {0: [b], 1: [a], 2: [c]}
    assert Gathered.of([10] * 5, refs) == Gathered(50, 15, 3)


def test_a_corrupted_or_missized_broadcast_is_caught() -> None:
    blob_a, blob_b = b"x" * 10, b"y" * 4
    sent = [ref_of(blob_a), ref_of(blob_b)]
    assert split(blob_a + blob_b, sent) == {sent[0].digest: blob_a, sent[1].digest: blob_b}
    with pytest.raises(ValueError, match="different digest"):
        split(blob_a[:-1] + b"z" + blob_b, sent)
    with pytest.raises(ValueError, match="sent 15 B"):
        split(blob_a + blob_b + b"!", sent)
    assert ref_of(None) is None and isinstance(sent[0], RosterRef) and len(sent[0].digest) == 16


# ------------------------------------------------------------------ real gloo world
SPEC = ModelSpec(layers=2)
# (source mesh, destination mesh): DP replicas whose rosters are equal, beside ranks
# whose rosters differ (another TP or PP coordinate, or no model at all).
MESHES = [
    (Mesh(tp=2, ranks=4), Mesh(tp=1, ranks=5)),  # rank 4: no source; 5 equal destinations
    (Mesh(pp=2, ranks=4), Mesh(tp=2, ranks=4, offset=1)),  # rank 0: no destination
    (Mesh(tp=2, ranks=2, offset=3), Mesh(tp=1, pp=2, ranks=4)),  # 2 distinct sources, no replica
]


def _gather_world(rank: int, world: int) -> list[dict]:
    out = []
    # Synthetic rosters: replicas, a rank with none, a roster equal in both roles.
    blobs = {0: (b"A" * 9, None), 1: (b"A" * 9, b"X" * 5), 2: (b"B" * 4, b"A" * 9),
             3: (None, b"X" * 5), 4: (b"B" * 4, b"Y" * 6)}[rank]
    extras, tables, gathered = all_gather_rosters(("extra", rank), blobs, torch.distributed.group.WORLD)
    old = all_gather_pickled(blobs, torch.distributed.group.WORLD)
    out.append({"extras": extras, "same": tables == [[o[0] for o in old], [o[1] for o in old]],
                "shared": tables[0][0] is tables[0][1] is tables[1][2],
                "rosters": gathered.rosters, "owners": gathered.owners})
    for i, (ms, md) in enumerate(MESHES):
        src = build_toy(SPEC, ms, rank, 10 + i)
        dst = build_toy(SPEC, md, rank, 20 + i)
        r = tr.Refitter(src, dst)
        r.refit()
        want = expected_local(SPEC, md, rank, 10 + i)
        ok = dst is None or all(torch.equal(v, want[k]) for k, v in dst.state_dict().items())
        mine = tuple(encode_roster(describe(m).layout) if m is not None else None for m in (src, dst))
        old = all_gather_pickled(mine, torch.distributed.group.WORLD)
        full = Planner.from_rosters([o[0] for o in old], [o[1] for o in old])
        full.validate()
        plan = full.plan_rank(rank, world, describe(src).layout if src else None,
                              describe(dst).layout if dst else None)
        distinct = {b for o in old for b in o if b is not None}
        out.append({"values": ok, "same_plan": plan == r.plan, "rosters": r.metadata.rosters,
                    "distinct": sum(len(b) for b in distinct),
                    "full": sum(len(b) for o in old for b in o if b is not None),
                    "owners": r.metadata.owners})
        r.close()
    return out


def test_gloo_world_gathers_each_distinct_roster_once() -> None:
    results = run_world(_gather_world, 5, timeout=600)
    for rank, (synthetic, *cases) in enumerate(results):
        assert synthetic["extras"] == [("extra", r) for r in range(5)], rank
        assert synthetic["same"], f"rank {rank}: rebuilt tables differ from the full gather"
        assert synthetic["shared"], f"rank {rank}: replicas' rosters are not one object"
        assert synthetic["rosters"] == 9 + 5 + 4 + 6 and synthetic["owners"] == 4, synthetic
        for i, got in enumerate(cases):
            assert got["values"], f"case {i}, rank {rank}: destination differs from the oracle"
            assert got["same_plan"], f"case {i}, rank {rank}: plan differs from the full gather's"
            assert got["rosters"] == got["distinct"], (i, rank, got)
            if i < 2:  # these have replicas: fewer bytes than every rank's roster
                assert got["rosters"] < got["full"], (i, rank, got)
