"""The planner on its own: pure, in one process, over whole simulated worlds.

For many layout pairs it checks that each rank's sends to a peer equal that peer's
receives (same regions, same order), that every destination element is written
exactly once, that planning is deterministic, that replicas are preferred locally
and balanced, and the message cutting both ends share.
"""

from __future__ import annotations

import itertools
import pickle
import random
from dataclasses import replace

import pytest
import torch

from torchrefit._util.format import format_bytes
from torchrefit.errors import PlanError
from torchrefit.layout import megatron, shard_pieces
from torchrefit.layout._types import Box
from torchrefit.maps import NameMap
from torchrefit.plan.messages import ALIGN, cut_messages
from torchrefit.plan.types import Transfer
from torchrefit.plan.world_plan import check_agreement, plan_world
from torchrefit.simulate.shapes import GlobalTensor
from torchrefit.testing import Mesh, ModelSpec, build_toy
from torchrefit.testing.toy import _oracle_shard


def _layouts(spec: ModelSpec, mesh: Mesh, world: int):
    out = []
    for r in range(world):
        m = build_toy(spec, mesh, r, 0)
        out.append(megatron(m).layout if m is not None else None)
    return out


PAIRS = [
    ("dense tp2->tp4", ModelSpec(), Mesh(2, ranks=8), Mesh(4, ranks=8), 8),
    ("dense tp4pp2->tp2", ModelSpec(), Mesh(4, 2, ranks=8), Mesh(2, ranks=8), 8),
    ("moe ep2->ep4 etp", ModelSpec(experts=8), Mesh(2, ep=2, etp=1, ranks=8), Mesh(1, ep=4, ranks=8), 8),
    ("mamba tp2->tp4", ModelSpec(mamba=True), Mesh(2, ranks=8), Mesh(4, ranks=8), 8),
    ("non-collocated 16", ModelSpec(), Mesh(2, 2, ranks=8), Mesh(4, ranks=8, offset=8), 16),
    ("tp3->tp2", ModelSpec(heads=6, groups=6, hidden=24, ffn=48, vocab=96), Mesh(3, ranks=6),
     Mesh(2, ranks=6), 6),
]


@pytest.mark.parametrize("name,spec,src,dst,world", PAIRS, ids=[p[0] for p in PAIRS])
def test_plans_agree_and_cover(name, spec, src, dst, world) -> None:
    s, d = _layouts(spec, src, world), _layouts(spec, dst, world)
    plans = plan_world(s, d)
    check_agreement(plans, d, s)
    assert plans == plan_world(s, d), "planning is not deterministic"


def _swapped_regions(plans: dict, s: int, d: int) -> dict:
    """The plans with the regions of the first two transfers of one tensor from rank
    ``s`` to rank ``d`` swapped on both ends: sends still match receives, every
    element is still covered once, yet each region lands where the other belongs."""
    sends = [i for i, t in enumerate(plans[s].sends) if t.peer == d]
    recvs = [i for i, t in enumerate(plans[d].recvs) if t.peer == s]
    pairs = [(a, b) for a, b in itertools.combinations(range(len(sends)), 2)
             if plans[s].sends[sends[a]].name == plans[s].sends[sends[b]].name
             and plans[s].sends[sends[a]].region.size == plans[s].sends[sends[b]].region.size]
    if not pairs:
        return {}
    a, b = pairs[0]
    out = dict(plans)
    for rank, field, idx in ((s, "sends", sends), (d, "recvs", recvs)):
        ts = list(getattr(plans[rank], field))
        i, j = idx[a], idx[b]
        ts[i], ts[j] = replace(ts[i], region=ts[j].region), replace(ts[j], region=ts[i].region)
        out[rank] = replace(plans[rank], **{field: tuple(ts)})
    return out


def test_agreement_fails_when_both_ends_are_wrong_alike() -> None:
    """Both ends of a pair wrong the same way (sends equal receives, coverage intact):
    the check still fails, because each region must land where the layout holds it."""
    spec = ModelSpec()
    # TP2 x DP2 -> TP1 x DP4 on other ranks: a TP2 rank sends both halves (gate, up) of
    # its fused fc1 shard to one peer, two transfers of one tensor of the same size
    s, d = _layouts(spec, Mesh(2, ranks=4), 8), _layouts(spec, Mesh(1, ranks=4, offset=4), 8)
    plans = plan_world(s, d)
    check_agreement(plans, d, s)
    swapped = next(w for r in range(4) for peer in plans[r].send_peers
                   if (w := _swapped_regions(plans, r, peer)))
    with pytest.raises(AssertionError, match="where its layout holds it"):
        check_agreement(swapped, d)
    sender = next(r for r in range(4) if plans[r].sends)
    # a sender reading the wrong place, the receiver none the wiser: only the source layout tells
    wrong = list(plans[sender].sends)
    box = wrong[0].local_box
    wrong[0] = replace(wrong[0], local_box=Box((box.offset[0] + 1,) + box.offset[1:], box.size))
    bad = {**plans, sender: replace(plans[sender], sends=tuple(wrong))}
    check_agreement(bad, d)
    with pytest.raises(AssertionError, match="send of"):
        check_agreement(bad, d, s)


def test_local_copy_preferred_when_collocated() -> None:
    spec = ModelSpec()
    s = _layouts(spec, Mesh(2, ranks=8), 8)
    plans = plan_world(s, s)  # the same layout on both sides: everything is local
    assert all(not p.sends and not p.recvs and p.local for p in plans.values())


def test_replicas_balance_sends() -> None:
    """TP1 x DP4 on ranks 0-3 -> TP1 x DP4 on ranks 4-7: each source serves one destination."""
    spec = ModelSpec()
    s = _layouts(spec, Mesh(1, ranks=4), 8)
    d = _layouts(spec, Mesh(1, ranks=4, offset=4), 8)
    plans = plan_world(s, d)
    sent = [plans[r].bytes_sent for r in range(4)]
    assert min(sent) > 0 and max(sent) <= 1.1 * (sum(sent) / 4), sent


@pytest.mark.parametrize("seed", range(20))
def test_shard_pieces_match_megatron_oracle(seed: int) -> None:
    """``shard_pieces`` places every local element where Megatron's own cut puts it."""
    rng = random.Random(seed)
    world = rng.choice([1, 2, 3, 4])
    stride = rng.choice([1, 2])
    parts = None if rng.random() < 0.5 else tuple(world * rng.randint(1, 3) for _ in range(rng.randint(2, 4)))
    rows = sum(parts) if parts else world * stride * rng.randint(1, 3)
    g = torch.arange(rows * 3).view(rows, 3)
    d = GlobalTensor("t", (rows, 3), "tp", 0, stride if parts is None else 1, parts=parts)
    rebuilt = torch.full_like(g, -1)
    for r in range(world):
        local = _oracle_shard(g, d, r, world)
        sizes = [p // world for p in parts] if parts else None
        gshape, pieces = shard_pieces(local.shape, 0, r, world, stride=d.stride, sizes=sizes)
        assert gshape == g.shape
        for p in pieces:
            rebuilt[p.box.slices()] = local[p.local_box.slices()]
    assert torch.equal(rebuilt, g)


def _t(name: str, rows: int, cols: int = 8) -> Transfer:
    box = Box((0, 0), (rows, cols))
    return Transfer(1, name, box, name, box, "float32", "float32")


def test_messages_respect_limit_and_alignment() -> None:
    ts = [_t("a", 3), _t("b", 100), _t("c", 1), _t("d", 7)]
    msgs = cut_messages(1, ts, limit=1024)
    for m in msgs:
        assert m.nbytes <= 1024
        assert all(ch.offset % ALIGN == 0 for ch in m.chunks)
    per = {}
    for m in msgs:
        for ch in m.chunks:
            per[ch.index] = per.get(ch.index, 0) + ch.nbytes
    assert per == {i: t.nbytes for i, t in enumerate(ts)}
    big = [ch for m in msgs for ch in m.chunks if ch.index == 1]
    assert len(big) == 4 and big[0].rows == (0, 32)  # 100 rows of 32 bytes in blocks of 32


@pytest.mark.parametrize("seed", range(30))
def test_message_chunks_tile_each_transfer_and_never_overlap(seed: int) -> None:
    """Random transfers (row sizes of 1 to 10 bytes: most not multiples of ``ALIGN``) and
    limits: within a message the chunks sit at aligned offsets, in order, each starting
    past the previous one's end, the message within ``limit`` unless it is one row too
    large; each transfer's chunks are its rows in order, each row exactly once."""
    rng = random.Random(seed)
    dtypes = {"int8": 1, "bfloat16": 2, "float32": 4, "float64": 8}
    ts = []
    for i in range(rng.randint(1, 12)):
        dtype = rng.choice(list(dtypes))
        rows, cols = rng.randint(1, 60), rng.choice([1, 3, 5, 10])
        box = Box((rng.randint(0, 4), 0), (rows, cols))
        ts.append(Transfer(1, f"t{i}", box, f"t{i}", box, dtype, dtype))
    limit = rng.choice([ALIGN, 40, 100, 256, 1000, 1 << 20])
    msgs = cut_messages(1, ts, limit)
    seen: list[tuple[int, tuple[int, int]]] = []
    for m in msgs:
        end = 0
        for ch in m.chunks:
            assert ch.offset % ALIGN == 0 and ch.offset >= end, (m, ch)
            t = ts[ch.index]
            rows = ch.rows or (0, t.region.size[0])
            assert ch.nbytes == (rows[1] - rows[0]) * (t.nbytes // t.region.size[0]), ch
            end = ch.offset + ch.nbytes
            seen.append((ch.index, rows))
        assert m.nbytes <= limit or len(m.chunks) == 1, (m.nbytes, limit)
        assert m.chunks[0].offset == 0
    want_order = sorted(seen)
    assert seen == want_order, "chunks out of transfer order"
    for i, t in enumerate(ts):
        mine = [rows for index, rows in seen if index == i]
        assert mine[0][0] == 0 and mine[-1][1] == t.region.size[0], (i, mine)
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:])), f"transfer {i}: rows {mine}"


def test_plan_error_is_one_line_with_its_parts_as_attributes() -> None:
    # The destination has biases the source lacks (no source) and is bfloat16 (no cast).
    src = _layouts(ModelSpec(bias=False), Mesh(2, ranks=4), 4)
    dst = _layouts(ModelSpec(dtype=torch.bfloat16), Mesh(1, ranks=4), 4)
    with pytest.raises(PlanError) as got:
        plan_world(src, dst, cast=False)
    err = got.value
    assert "\n" not in str(err)
    first = err.detail.splitlines()[0]
    assert str(err).startswith(first) and err.tensor in first and "dst rank 0" in first
    assert (err.ranks, err.rule) == ((0, 1, 2, 3), "dtype")
    lines = err.detail.splitlines()
    assert any("has no source tensor" in line for line in lines[:-1])
    assert any("dtype mismatch" in line for line in lines) and len(lines) > 2
    assert f"(and {len(lines) - 1} more; err.detail lists them)" in str(err)
    back = pickle.loads(pickle.dumps(err))  # survives a process boundary, class and parts
    assert type(back) is PlanError and (back.detail, back.ranks, back.rule) == (err.detail, err.ranks, err.rule)


def test_explain_accounts_for_every_region_and_byte() -> None:
    src = _layouts(ModelSpec(), Mesh(2, ranks=4), 4)
    dst = _layouts(ModelSpec(dtype=torch.bfloat16), Mesh(1, ranks=4), 4)
    plan = plan_world(src, dst, cast=True)[1]
    text = plan.explain()
    rows = [" ".join(line.split()) for line in text.splitlines() if line.startswith("  ")]
    kinds = [row.split()[0] for row in rows]
    assert kinds.count("copy") == len(plan.local) > 0
    assert kinds.count("receive") == len(plan.recvs) > 0
    assert kinds.count("send") == len(plan.sends) > 0
    def dtypes(a: str, b: str) -> str:
        return a if a == b else f"{a} -> {b}"

    for t in plan.recvs:  # wire dtype, then what the receiver converts it to
        want = (f"receive {t.region} rank {t.peer} -> rank 1 "
                f"{dtypes(t.wire_dtype, t.local_dtype)} {format_bytes(t.nbytes)}")
        assert want in rows, want
    for t in plan.sends:  # the sender narrows fp32 to bf16 before sending
        assert t.local_dtype == "float32" and t.wire_dtype == "bfloat16"
        want = (f"send {t.region} rank 1 -> rank {t.peer} float32 -> bfloat16 "
                f"{format_bytes(t.nbytes)}")
        assert want in rows, want
    copies = [r for r in rows if r.startswith("copy")]
    assert all("float32 -> bfloat16" in r for r in copies)
    t = plan.recvs[0]
    mine = plan.explain([t.name]).splitlines()
    assert mine[1].startswith(f"{t.name}: ") and all(line.startswith("  ") for line in mine[2:])


def test_many_tensors_without_a_source_fail_fast(monkeypatch) -> None:
    """Close-name hints (difflib against every source name, 0.1 s each on a loaded CPU)
    go with the first three tensors without a source only: a model missing all its
    biases still fails in well under a second on every rank."""
    import torchrefit.plan.planner as planner

    calls = []
    real = planner.difflib.get_close_matches
    monkeypatch.setattr(planner.difflib, "get_close_matches",
                        lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    src = _layouts(ModelSpec(layers=4, bias=False), Mesh(2, ranks=4), 4)
    dst = _layouts(ModelSpec(layers=4), Mesh(1, ranks=4), 4)
    with pytest.raises(PlanError) as err:
        plan_world(src, dst)
    missing = [line for line in err.value.detail.split("\n") if "has no source" in line]
    assert len(missing) == 16 and len(calls) == 3, (len(missing), calls)
    assert all("closest source names" in line for line in missing[:3])
    assert not any("closest source names" in line for line in missing[3:])
    assert "closest source names: 'decoder.layers.0.mlp.linear_fc1.weight'" in str(err.value)


def _whole(name: str, shape: tuple[int, ...], dtype: str = "float32"):
    from torchrefit.layout._types import Piece, TensorLayout

    return name, TensorLayout(name, shape, dtype, shape, (Piece(Box.whole(shape), (0,) * len(shape)),))


class _Through(NameMap):
    """Identity through a map of its own segments (the planner's general path, where the
    validity key is built from segments rather than from the two tensors alone)."""

    def segments(self, dst_name, dst_shape, src_names, src_aliases):
        return super().segments(dst_name, dst_shape, src_names, src_aliases)


@pytest.mark.parametrize("name_map", [None, _Through()], ids=["whole-tensor map", "segments map"])
@pytest.mark.parametrize("src_b,rule", [(((4, 5), "float32"), "global shape"),
                                        (((4, 4), "bfloat16"), "dtype")])
def test_each_pair_of_geometries_is_checked(name_map, src_b, rule) -> None:
    """Validation checks each distinct (destination geometry, source geometry) once: ``b``
    looks like the valid ``a`` on the destination, but its source differs, so it is
    checked too and named."""
    from torchrefit.layout._types import ModelLayout

    src = ModelLayout((_whole("a", (4, 4)), _whole("b", *src_b)))
    dst = ModelLayout((_whole("a", (4, 4)), _whole("b", (4, 4))))
    with pytest.raises(PlanError) as err:
        plan_world([src, None], [None, dst], name_map=name_map, cast=False)
    assert (err.value.tensor, err.value.rule, err.value.ranks) == ("b", rule, (1,))


def test_planning_pauses_the_collector_and_restores_it() -> None:
    """Planning runs with Python's cyclic GC paused (hundreds of thousands of acyclic
    objects at 16k ranks) and leaves it as it found it, also where a caller paused it."""
    import gc

    seen: list[bool] = []

    class Spy(NameMap):
        def segments(self, *args):
            seen.append(gc.isenabled())
            return super().segments(*args)

    src, dst = _layouts(ModelSpec(), Mesh(2, ranks=4), 4), _layouts(ModelSpec(), Mesh(1, ranks=4), 4)
    assert gc.isenabled()
    plan_world(src, dst, name_map=Spy())
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()
    try:
        plan_world(src, dst, name_map=Spy())
        assert not gc.isenabled()
    finally:
        gc.enable()
