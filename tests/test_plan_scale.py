"""Planning at 1024 ranks, simulated on one CPU: what every rank would plan from the
gathered rosters, checked on sampled ranks.

For a Llama-70B-shaped and a DeepSeek-V3-shaped model (fewer layers, world size
1024), collocated and not: what sampled senders send each peer equals what that
peer plans to receive from them (same regions, same order), every element of a
sampled destination rank is written exactly once, the whole-world traffic agrees
with the ranks' plans, replicas share the sending within 1.1x, and planning is
deterministic. Also the byte sharing among replicas on its own, layout strings, model shapes,
and the ``torchrefit plan`` command's JSON.
"""

from __future__ import annotations

import json
import math
import random
import sys

import pytest

from torchrefit.cli import main
from torchrefit.plan.planner import Planner
from torchrefit.plan.shares import ClassBlock, ShareLine, split_pair
from torchrefit.plan.world_plan import check_agreement
from torchrefit.simulate import global_tensors, parse_mesh, preset, simulated_rosters
from torchrefit.simulate.report import time_rank
from torchrefit.simulate.traffic import traffic

WORLD = 1024

CASES = {
    # name: (preset, fewer layers for speed, src, dst, ranks sampled)
    "llama tp8pp4->tp4 collocated": ("llama-70b", 8, "tp8pp4", "tp4", 8),
    "llama tp8pp4->tp4 disjoint": ("llama-70b", 8, "tp8pp4@0:512", "tp4@512:1024", 8),
    "llama tp4pp2->tp8 few engines": ("llama-70b", 8, "tp4pp2@0:960", "tp8@960:1024", 8),
    # Each expert lives on one source rank: every rank talks to ~130 peers.
    "deepseek pp16ep64->tp8ep8": ("deepseek-v3", 17, "pp16ep64", "tp8ep8", 3),
}


class _World:
    """One simulated case: rosters, a validated planner, whole-world traffic."""

    def __init__(self, case: str) -> None:
        name, layers, src, dst, self.samples = CASES[case]
        shape = preset(name).with_overrides(layers=layers)
        self.src = simulated_rosters(shape, parse_mesh(src, WORLD), WORLD)
        self.dst = simulated_rosters(shape, parse_mesh(dst, WORLD), WORLD)
        self.blobs = self.src.rosters(), self.dst.rosters()
        self.planner = Planner.from_rosters(self.blobs[0], self.blobs[1])
        self.planner.validate()
        self.traffic = traffic(self.planner, WORLD)
        self.plans: dict = {}

    def plan(self, rank: int, sends_only: bool = False):
        """Rank ``rank``'s plan, or only its sends where that is all a check needs
        (receiving may copy locally from the rank's source: it needs both halves)."""
        key = (rank, sends_only)
        if key not in self.plans:
            dst = None if sends_only else self.dst.layout(rank)
            self.plans[key] = self.planner.plan_rank(rank, WORLD, self.src.layout(rank), dst)
        return self.plans[key]

    def sampled(self) -> list[int]:
        """The busiest sender and receiver, then both ends and random ranks."""
        rng = random.Random(3)
        sent, received = self.traffic.sent(), self.traffic.received()
        picks = [max(range(WORLD), key=sent.__getitem__),
                 max(range(WORLD), key=received.__getitem__), 0, WORLD - 1,
                 *rng.sample(range(WORLD), 4)]
        return sorted(set(picks[:self.samples]))


_WORLDS: dict[str, _World] = {}


def world(case: str) -> _World:
    if case not in _WORLDS:
        _WORLDS[case] = _World(case)
    return _WORLDS[case]


class _Layouts:
    def __init__(self, role) -> None:
        self.role = role

    def __getitem__(self, rank: int):
        return self.role.layout(rank)


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_ranks_agree_with_their_peers(case: str) -> None:
    w = world(case)
    for r in w.sampled():
        plan = w.plan(r)
        for peer in plan.send_peers:
            got = [_id(t) for t in w.plan(peer).recvs if t.peer == r]
            assert [_id(t) for t in plan.sends if t.peer == peer] == got, \
                f"{case}: rank {r} -> rank {peer}: sends and receives differ"
        for peer in plan.recv_peers:
            sent = [_id(t) for t in w.plan(peer, sends_only=True).sends if t.peer == r]
            assert sent == [_id(t) for t in plan.recvs if t.peer == peer], \
                f"{case}: rank {peer} -> rank {r}: sends and receives differ"
    # Every element of a sampled destination rank written exactly once.
    check_agreement({r: w.plan(r) for r in w.sampled()}, _Layouts(w.dst))


def _id(t) -> tuple:
    return t.name, t.region, t.wire_dtype


@pytest.mark.parametrize("case", list(CASES))
def test_traffic_matches_the_ranks_plans(case: str) -> None:
    w = world(case)
    t = w.traffic
    sent, received = t.sent(), t.received()
    for r in w.sampled():
        plan = w.plan(r)  # its sends come from the sender's share line, the traffic from receivers'
        for (kind, peer), nbytes in plan.bytes_by_peer().items():
            cell = t.link(r, peer) if kind == "send" else t.link(peer, r)
            assert cell == nbytes, f"{case}: rank {r} {kind} {peer}: plan {nbytes}, traffic {cell}"
        assert sent[r] == plan.bytes_sent
        assert received[r] == plan.bytes_received
        assert w.traffic.local[r] == plan.bytes_local


SMALL = [
    # (preset, layers, src, dst, world): every rank planned
    ("llama-70b", 4, "tp8pp2", "tp4", 64),
    ("llama-70b", 4, "tp2pp4@0:48", "tp8@40:64", 64),  # overlapping ranges
    ("llama-70b", 3, "tp4pp3@0:60", "tp8@56:64", 64),  # 5 replicas per region: rows split at cuts
    ("deepseek-v3", 5, "pp4ep8", "tp8ep8", 64),
    ("deepseek-v3", 5, "tp2pp2ep4@0:32", "tp4ep2@32:64", 64),
]


def _summed_plans(plans: dict) -> tuple[dict, list[int]]:
    """Bytes per (sender, receiver) from the senders' plans and per rank copied locally,
    checked against the receivers' plans: the oracle the whole-world traffic must equal."""
    pairs: dict = {}
    for r, plan in plans.items():
        for (kind, peer), n in plan.bytes_by_peer().items():
            key = (r, peer) if kind == "send" else (peer, r)
            assert pairs.setdefault(key, n) == n, f"ranks {key}: sender and receiver differ"
    return pairs, [plans[r].bytes_local for r in sorted(plans)]


@pytest.mark.parametrize("case", SMALL, ids=lambda c: f"{c[0]}-{c[2]}-{c[3]}")
def test_traffic_is_every_ranks_plan_summed(case) -> None:
    """The closed-form traffic (per holder set and destination rank) equals the bytes
    of every rank's own plan, pair by pair, at a world small enough to plan every rank."""
    name, layers, src, dst, world = case
    shape = preset(name).with_overrides(layers=layers)
    s = simulated_rosters(shape, parse_mesh(src, world), world)
    d = simulated_rosters(shape, parse_mesh(dst, world), world)
    planner = Planner.from_rosters(s.rosters(), d.rosters())
    planner.validate()
    plans = {r: planner.plan_rank(r, world, s.layout(r), d.layout(r)) for r in range(world)}
    pairs, local = _summed_plans(plans)
    t = traffic(planner, world)
    assert {k: n for k, n in t.pairs.items() if n} == pairs
    assert list(t.local) == local


def test_traffic_over_overlapping_source_boxes() -> None:
    """Source ranks whose boxes overlap (one holds the whole tensor, two its halves,
    one its columns): regions are cut into cells of every holder combination, and
    share lines and traffic still find them (Holdings.held_by's overlapping path)."""
    from torchrefit.layout._types import Box, ModelLayout, Piece, TensorLayout
    from torchrefit.plan.roster import encode_roster

    def held(*boxes):
        pieces, row = [], 0
        for off, size in boxes:  # stacked along dim 0 in the local tensor
            pieces.append(Piece(Box(off, size), (row, 0)))
            row += size[0]
        width = boxes[0][1][1]
        return ModelLayout((("w", TensorLayout("w", (8, 6), "float32", (row, width),
                                                tuple(pieces))),), ())

    src = [held(((0, 0), (8, 6))), held(((0, 0), (4, 6))), held(((4, 0), (4, 6))),
           held(((0, 0), (8, 3))), None, None, None, None]
    dst = [None, None, None, None] + [held(((2 * i, 0), (2, 6))) for i in range(4)]
    enc = [[None if x is None else encode_roster(x) for x in side] for side in (src, dst)]
    planner = Planner.from_rosters(*enc)
    planner.validate()
    assert not planner.src.tensors["w"].disjoint
    plans = {r: planner.plan_rank(r, 8, src[r], dst[r]) for r in range(8)}
    check_agreement(plans, dst)
    pairs, local = _summed_plans(plans)
    t = traffic(planner, 8)
    assert {k: n for k, n in t.pairs.items() if n} == pairs and list(t.local) == local
    assert sum(pairs.values()) == 8 * 6 * 4


@pytest.mark.parametrize("case", list(CASES))
def test_replicas_share_the_sending(case: str) -> None:
    """Within 1.1x of the least the busiest sender could send under any replica choice
    (with 8 layers the embedding's stage sends more whatever the choice), and every rank
    that holds a replica of something sent takes a share (not one replica for all)."""
    t = world(case).traffic
    assert t.max_send_over_floor() <= 1.1, f"{case}: {t.max_send_over_floor():.3f}x the floor"
    sent = t.sent()
    idle = [r for r in t.candidates if not sent[r]]
    assert not idle, f"{case}: replicas {idle[:8]} could send and send nothing"


@pytest.mark.parametrize("src,dst", [("tp8pp4", "tp4"), ("tp8pp4@0:512", "tp4@512:1024"),
                                     ("tp4pp2@0:960", "tp8@960:1024")])
def test_llama_70b_busiest_sender_within_1_1x_the_mean(src: str, dst: str) -> None:
    """The whole 80-layer model: here the layout is even, so the mean is reachable."""
    shape = preset("llama-70b")
    s, d = simulated_rosters(shape, parse_mesh(src, WORLD), WORLD), simulated_rosters(
        shape, parse_mesh(dst, WORLD), WORLD)
    planner = Planner.from_rosters(s.rosters(), d.rosters())
    planner.validate()
    ratio = traffic(planner, WORLD).max_send_over_mean()
    assert ratio <= 1.1, f"{src} -> {dst}: busiest sender {ratio:.3f}x the mean"


def test_planning_is_deterministic() -> None:
    w = world("deepseek pp16ep64->tp8ep8")
    again = _World("deepseek pp16ep64->tp8ep8")
    assert again.blobs == w.blobs, "simulated rosters differ between two builds"
    for r in w.sampled()[:3]:
        _, plan = time_rank(*again.blobs, r, WORLD, again.src.layout(r), again.dst.layout(r))
        assert plan == w.plan(r)


def test_metadata_is_compact() -> None:
    """Per rank a few KB at most, against hundreds of KB for pickled layout objects."""
    import pickle

    w = world("deepseek pp16ep64->tp8ep8")
    rank = 5
    mine = len(w.blobs[0][rank]) + len(w.blobs[1][rank])
    pickled = len(pickle.dumps((w.src.layout(rank), w.dst.layout(rank))))
    assert mine * 20 < pickled, (mine, pickled)


@pytest.mark.parametrize("seed", range(30))
def test_sharing_covers_every_pair_once_and_evenly(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    blocks = {}
    ranks = iter(rng.sample(range(200), 60))
    for c in range(rng.randint(1, 4)):
        b = ClassBlock(sorted(next(ranks) for _ in range(rng.randint(1, 12))))
        for k in range(rng.randint(1, 6)):
            rows = rng.randint(1, 50)
            b.add((c, k), rows * rng.choice([2, 4, 96]), rows)
        blocks[c] = b
    line = ShareLine(n, blocks)
    from_senders: dict = {}
    for i in range(n):
        for key, parts in line.sent_by(i).items():
            for d, lo, hi in parts:
                from_senders.setdefault((key, d), []).append((i, lo, hi))
    load = [0] * n
    for c, b in blocks.items():
        for d in b.ranks:
            for key, size, rows in zip(b.keys, b.sizes, b.rows):
                parts = line.senders(c, d, key)
                assert parts == from_senders.pop((key, d), []), "sender and receiver disagree"
                assert parts[0][1] == 0 and parts[-1][2] == rows
                assert all(a[2] == b2[1] for a, b2 in zip(parts, parts[1:])), "rows not tiled"
                for i, lo, hi in parts:
                    load[i] += (hi - lo) * (size // rows)
    assert not from_senders
    summed: dict = {}
    for c, b in blocks.items():
        for d in b.ranks:
            for key, size, rows in zip(b.keys, b.sizes, b.rows):
                for i, lo, hi in line.senders(c, d, key):
                    if hi > lo:
                        summed[i, d] = summed.get((i, d), 0) + (hi - lo) * (size // rows)
    closed = {(i, d): n for i, d, n in line.bytes_by_pair()}
    assert closed == summed, "the closed-form pair bytes differ from the senders' rows"
    biggest_row = max(s // r for b in blocks.values() for s, r in zip(b.sizes, b.rows))
    assert max(load) - min(load) <= 2 * biggest_row + 1


def test_split_pair_rounds_to_rows() -> None:
    cut = [0, 50, 100]
    assert split_pair(0, 100, 10, cut) == [(0, 0, 5), (1, 5, 10)]
    assert split_pair(45, 20, 1, cut) == [(1, 0, 1)]  # one row: the holder of its midpoint


def test_layout_strings() -> None:
    m = parse_mesh("tp8pp4", 1024)
    assert (m.tp, m.pp, m.ep, m.etp, m.dp, m.offset, m.end) == (8, 4, 1, 8, 32, 0, 1024)
    m = parse_mesh("tp8ep8", 1024)
    assert (m.tp, m.ep, m.etp, m.dp) == (8, 8, 1, 128)
    assert [m.coords(r).ep for r in range(8, 16)] == list(range(8))  # engines of 8 ranks
    m = parse_mesh("TP4 x PP2 @512:1024", 1024)
    assert (m.tp, m.pp, m.offset, m.end, m.coords(511)) == (4, 2, 512, 1024, None)
    for bad in ("tp3", "tq8", "tp8@0:2000", "tp8dp5"):
        with pytest.raises(ValueError):
            parse_mesh(bad, 1024)


@pytest.mark.parametrize("name,tensors,params", [
    ("gpt-4b", 245, 4.46e9), ("llama-70b", 483, 70.55e9), ("deepseek-v3", 30486, 671.0e9),
    ("kimi-k2", 46874, 1026.4e9)])
def test_presets_have_the_real_sizes(name: str, tensors: int, params: float) -> None:
    ts = [t for t in global_tensors(preset(name)) if t.persistent]
    total = sum(math.prod(t.shape) for t in ts if not t.buffer)
    assert len(ts) == tensors and abs(total - params) / params < 0.005, (len(ts), total)



def test_plan_command_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    code = main(["plan", "--model", "llama-70b", "--layers", "4", "--src", "tp8pp2",
                 "--dst", "tp4@64:128", "--world", "128", "--samples", "3", "--rank", "70",
                 "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    for key in ("plan_seconds", "peak_rss_bytes", "metadata_bytes_per_rank", "bytes_total",
                "max_send_over_mean", "max_send_over_floor", "local_fraction", "timings"):
        assert key in data, key
    assert data["bytes_total"] == data["bytes_remote"] + data["bytes_local"] > 0
    assert data["max_send_over_mean"] <= 1.1
    text = capsys.readouterr().out
    assert "balance" in text and "rank 70 of 128" in text


def test_plan_command_rejects_bad_layouts(capsys) -> None:
    assert main(["plan", "--src", "tp3", "--world", "8"]) == 2
    assert "tp3" in capsys.readouterr().err


def test_heatmap_without_matplotlib_says_what_to_install(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    code = main(["plan", "--layers", "4", "--src", "tp2", "--dst", "tp1", "--world", "4",
                 "--samples", "2", "--heatmap", str(tmp_path / "h.png")])
    assert code == 2
    assert "pip install 'torchrefit[bench]'" in capsys.readouterr().err


def test_heatmap_draws(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "h.png"
    assert main(["plan", "--layers", "4", "--src", "tp2", "--dst", "tp1@4:8", "--world", "8",
                 "--samples", "2", "--heatmap", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
