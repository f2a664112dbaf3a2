"""Fleet planning and admission proofs, pure (no processes): relay trees (a chain, fan-out
trees, every target fed once, only the first source sending), re-feed sources (whole
replicas first, the trainer last), the seeding peer (only a replica whole at the current
version, never a mixed one, never a busy one, none before the first version), and the
secret (required, never a default; proofs that a wrong secret or other parts cannot make).
One rank's worker, over a real store with stand-in Refitters (one per part): a sender never
relays or seeds a mix; a receive cut by a dying sender marks an unstaged replica as holding
a mix (its version kept) and leaves a staged one whole, until its next complete receive; a
relay forwards each part once it holds it and skips the parts it lacks. The cut into
parts: balanced runs of whole tensors, the same on every rank."""

from __future__ import annotations

import time

import pytest

from torchrefit import settings
from torchrefit.fleet.relay import TRAINER, Edge, Holding, refeed_sources, relay_edges, seed_source
from torchrefit.fleet.secret import check, group_prefix, prove, read_secret


def test_chain_feeds_every_target_once_from_one_source() -> None:
    edges = relay_edges([TRAINER, "x"], ["a", "b", "c"])
    assert edges == [Edge(TRAINER, "a"), Edge("a", "b"), Edge("b", "c")]
    assert [e for e in edges if e.src == TRAINER] == [Edge(TRAINER, "a")]  # egress: one replica


@pytest.mark.parametrize("fanout", [1, 2, 3])
def test_tree_feeds_each_once(fanout: int) -> None:
    targets = [f"r{i}" for i in range(9)]
    edges = relay_edges([TRAINER], targets, fanout)
    assert sorted(e.dst for e in edges) == sorted(targets)
    assert sum(e.src == TRAINER for e in edges) == 1
    fed = {TRAINER}
    for e in edges:  # each sender was fed before it sends
        assert e.src in fed
        fed.add(e.dst)
    assert max(sum(e.src == s for e in edges) for s in fed) <= fanout
    assert edges == relay_edges([TRAINER], targets, fanout)  # deterministic


def test_refeed_prefers_whole_replicas_and_the_trainer_last() -> None:
    holders = [Holding("a", 4), Holding("b", 5, mixed=True), Holding("c", 5)]
    assert refeed_sources(holders, 5) == ["c", TRAINER]


def test_seed_source_only_whole_at_the_current_version() -> None:
    peers = [Holding("mixed", 7, mixed=True), Holding("old", 6), Holding("busy", 7), Holding("good", 7)]
    assert seed_source(peers, 7, frozenset({"busy"})) == "good"
    assert seed_source(peers[:2], 7) is None  # a mix is never a seed
    assert seed_source([Holding("a", 0)], 0) is None  # nothing to seed before the first version


def test_secret_is_required_and_proofs_bind_it(tmp_path) -> None:
    with settings.overridden(fleet_secret=""):
        with pytest.raises(ValueError, match="no fleet secret"):
            read_secret(None, None, "Fleet")
    f = tmp_path / "secret"
    f.write_text("s3cret\n")
    key = read_secret(None, str(f), "join")
    assert key == b"s3cret"
    with settings.overridden(fleet_secret="from-env"):
        assert read_secret(None, None, "join") == b"from-env"
    p = prove(key, "join", "salt", "name", "2")
    assert check(key, p, "join", "salt", "name", "2")
    assert not check(b"wrong", p, "join", "salt", "name", "2")
    assert not check(key, p, "join", "salt", "name", "3")
    assert not check(key, "", "join", "salt", "name", "2")
    assert group_prefix(key, "salt", "t>a#0") != group_prefix(b"wrong", "salt", "t>a#0")


def test_a_relay_or_seed_source_never_sends_a_mix() -> None:
    """The sender's own check, behind the coordinator's choice: a replica sends only when it
    holds the version asked for, whole (a mixed one says why it does not)."""
    from torchrefit.fleet.worker import Whole, Worker

    w = Worker(None, None, "r", 0, 1, 1.0, Whole(version=7, mixed=True))
    task = {"version": 8, "expect": 7}
    assert w._what_to_send(task)[1] == "r holds a mix of versions"
    w.whole.mixed = False
    assert w._what_to_send(task) == (7, None)
    assert "holds version 7, not 8" in w._what_to_send({"version": 8})[1]
    trainer = Worker(None, None, TRAINER, 0, 2, 1.0)
    assert trainer._what_to_send({"version": 8}) == (8, None)


class _Refitter:
    """One part of an edge: fails (a peer died mid-transfer) or moves 10 bytes; waits for
    ``gate`` first and sets ``done`` after, where given (to order two ranks' threads)."""

    def __init__(self, fail: bool = False, gate=None, done=None) -> None:
        self.fail, self.calls, self.gate, self.done = fail, 0, gate, done

    def refit(self, version):
        if self.gate is not None:
            assert self.gate.wait(30)
        if self.done is not None:
            self.done.set()
        if self.fail:
            from torchrefit.errors import TransportError
            raise TransportError("injected: the sender died mid-transfer")
        self.calls += 1
        return type("R", (), {"bytes_received": 10, "bytes_sent": 10})()


class _Sides:
    def __init__(self) -> None:
        self.installed = 0

    def install(self) -> None:
        self.installed += 1


class _Links:
    """Edges of one rank: ``parts[tag]`` lists each part's stand-in Refitter."""

    def __init__(self, parts: dict[str, list[_Refitter]]) -> None:
        self.parts, self.forgotten, self.sides = parts, [], _Sides()

    def get(self, tag, peer_world, parts, store=None, gone=None):
        return type("L", (), {"parts": self.parts[tag]})()

    def forget(self, tag):
        self.forgotten.append(tag)

    def keep_only(self, live):
        pass


def _board():
    import torch.distributed as dist

    from torchrefit.fleet.board import Board
    from torchrefit.testing.jobs import free_port

    return Board(dist.TCPStore("127.0.0.1", free_port(), None, is_master=True, wait_for_workers=False))


@pytest.mark.parametrize("staged", [False, True])
def test_a_cut_receive_marks_an_unstaged_replica_mixed_until_its_next_whole_one(staged: bool) -> None:
    """A replica whose sender died mid-transfer: unstaged, its live weights are marked as a
    mix (and its version kept); staged, nothing was committed and it stays whole at its
    version. The next complete receive installs the version and clears the mark."""
    from torchrefit.fleet.worker import Whole, Worker

    board = _board()
    seen = []
    links = _Links({"trainer>r#0": [_Refitter(), _Refitter(fail=True)]})
    w = Worker(board, links, "r", 0, 1, 5.0, Whole(version=3), on_version=seen.append)
    edge = {"tag": "trainer>r#0", "word": "w1", "peer": TRAINER, "peer_world": 2, "stage": staged, "parts": 2}
    for p in range(2):
        board.put(f"edge/w1/{p}", {"go": True, "version": 4, "why": None})
    out = w.run({"n": 0, "kind": "update", "version": 4, "in": edge, "outs": [], "live": [TRAINER, "r"]})
    assert not out["in"]["agreed"] and "sender died" in out["in"]["error"]
    assert (w.whole.version, w.whole.mixed) == (3, not staged)
    assert board.get("done/r/0/0")["mixed"] == (not staged) and links.forgotten == ["trainer>r#0"]
    assert seen == []
    # a skipped edge moves no byte: no mix from it
    for p in range(2):  # the sender was dropped: every part of its edge is skipped
        board.put(f"edge/w2/{p}", {"go": False, "version": 0, "why": "trainer was dropped"})
    w.run({"n": 1, "kind": "update", "version": 4, "in": {**edge, "word": "w2"}, "outs": []})
    assert w.whole.mixed == (not staged)
    links.parts["trainer>r#0"] = [_Refitter(), _Refitter()]
    for p in range(2):
        board.put(f"edge/w3/{p}", {"go": True, "version": 5, "why": None})
    out = w.run({"n": 2, "kind": "update", "version": 5, "in": {**edge, "word": "w3"}, "outs": []})
    assert out["in"]["agreed"] and (w.whole.version, w.whole.mixed) == (5, False) and seen == [5]
    assert out["in"]["bytes"] == 20 and links.sides.installed == 1


def test_a_relay_forwards_each_part_it_holds_and_skips_the_rest() -> None:
    """A relay between a sender that dies at part 2 of 3 and a receiver: parts 0 and 1 are
    forwarded (each once every rank of the relay holds it), part 2 is skipped, never sent,
    and the relay installs nothing (it keeps its version and forwards no byte it lacks)."""
    from torchrefit.fleet.worker import Whole, Worker

    board = _board()
    up = [_Refitter(), _Refitter(), _Refitter(fail=True)]
    down = [_Refitter(), _Refitter(), _Refitter()]
    links = _Links({"trainer>r#0": up, "r>s#0": down})
    w = Worker(board, links, "r", 0, 1, 5.0, Whole(version=3))
    inn = {"tag": "trainer>r#0", "word": "w1", "peer": TRAINER, "peer_world": 2, "stage": True, "parts": 3}
    out_edge = {"tag": "r>s#0", "word": "w2", "peer": "s", "peer_world": 1, "stage": True, "parts": 3}
    for p in range(3):
        board.put(f"edge/w1/{p}", {"go": True, "version": 4, "why": None})
    out = w.run({"n": 0, "kind": "update", "version": 4, "in": inn, "outs": [out_edge]})
    assert [r.calls for r in down] == [1, 1, 0]
    assert [board.get(f"edge/w2/{p}")["go"] for p in range(3)] == [True, True, False]
    assert "did not receive version 4 whole" in board.get("edge/w2/2")["why"]
    sent = out["outs"]["r>s#0"]
    assert not sent["ok"] and sent["skipped"] and sent["bytes"] == 20
    assert not out["in"]["agreed"] and (w.whole.version, w.whole.mixed) == (3, False)
    assert links.sides.installed == 0


def test_parts_are_balanced_runs_of_whole_tensors() -> None:
    from torchrefit.fleet.parts import cut, part_of
    from torchrefit.layout import describe
    from torchrefit.testing import Mesh, ModelSpec, build_toy

    sizes = {"a": 10, "b": 10, "c": 10, "d": 10, "e": 1}
    parts = cut(sizes, 4)
    assert parts == [frozenset("a"), frozenset("b"), frozenset("c"), frozenset("de")]
    assert cut(sizes, 1) == [frozenset(sizes)] and len(cut({"a": 5}, 4)) == 1
    with pytest.raises(ValueError):
        cut(sizes, 0)
    spec = ModelSpec(layers=2)
    one = describe(build_toy(spec, Mesh(tp=1, ranks=1), 0, seed=0))
    two = describe(build_toy(spec, Mesh(tp=2, ranks=2), 1, seed=0))
    sizes = {t.name: t.global_shape for _, t in one.layout}
    assert sizes == {t.name: t.global_shape for _, t in two.layout}
    from torchrefit.fleet.parts import global_sizes
    got = cut(global_sizes(one.layout), 4)
    assert got == cut(global_sizes(two.layout), 4) and len(got) >= 3  # a TP1 and a TP2 replica agree
    assert sorted(n for p in got for n in p) == sorted(sizes)
    shares = [sum(global_sizes(one.layout)[n] for n in p) for p in got]
    assert max(shares) < 0.6 * sum(shares)
    sub = part_of(one, got[0])
    assert {t.name for _, t in sub.layout} == got[0] and set(sub.tensors) == {k for k, _ in sub.layout}


def test_a_relay_of_two_ranks_forwards_a_part_only_once_both_hold_it() -> None:
    """A relay job of two ranks whose rank 1 misses part 1 of 3 (its sender's transfer
    failed there), after rank 0 received every part: part 0 is forwarded by both ranks (both
    hold it), parts 1 and 2 are skipped downstream (rank 0 holds them, rank 1 does not: a
    forwarded part would be a mix), and neither rank installs the version (they agree)."""
    import threading

    from torchrefit.fleet.board import Board
    from torchrefit.fleet.worker import Whole, Worker

    board = _board()
    held = threading.Event()  # rank 1 fails only once rank 0 received every part
    ups = [[_Refitter(), _Refitter(), _Refitter(done=held)], [_Refitter(), _Refitter(fail=True, gate=held), _Refitter()]]
    downs = [[_Refitter(), _Refitter(), _Refitter()] for _ in range(2)]
    links = [_Links({"trainer>r#0": ups[r], "r>s#0": downs[r]}) for r in range(2)]
    workers = [Worker(Board(board.store.clone()), links[r], "r", r, 2, 5.0, Whole(version=3)) for r in range(2)]
    inn = {"tag": "trainer>r#0", "word": "w1", "peer": TRAINER, "peer_world": 2, "stage": True, "parts": 3}
    out_edge = {"tag": "r>s#0", "word": "w2", "peer": "s", "peer_world": 1, "stage": True, "parts": 3}
    for p in range(3):
        board.put(f"edge/w1/{p}", {"go": True, "version": 4, "why": None})
    outs = [None, None]

    def run(r: int) -> None:
        outs[r] = workers[r].run({"n": 0, "kind": "update", "version": 4, "in": inn, "outs": [out_edge]})

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [r.calls for r in ups[0]] == [1, 1, 1] and [r.calls for r in ups[1]] == [1, 0, 0]
    assert [[r.calls for r in d] for d in downs] == [[1, 0, 0], [1, 0, 0]]
    assert [board.get(f"edge/w2/{p}")["go"] for p in range(3)] == [True, False, False]
    for r in range(2):
        assert not outs[r]["in"]["agreed"] and not outs[r]["outs"]["r>s#0"]["ok"]
        assert (workers[r].whole.version, workers[r].whole.mixed) == (3, False)
        assert links[r].sides.installed == 0
    assert board.get("agreed/r/0") is False


def test_a_link_build_stops_when_its_peer_is_dropped_and_what_it_made_is_closed() -> None:
    """``Links.get`` builds on a thread of its own and leaves as soon as ``gone()`` says the
    peer job was dropped; the build, once it ends, closes what it made (no group is kept for
    an edge nobody holds). A build that ends first is handed over; a failed one raises."""
    import threading

    from torchrefit.fleet.links import Links, PeerDropped

    class _Store:
        def clone(self):
            return self

    class _Made:
        closed = 0

        def close(self) -> None:
            self.closed += 1

    release, made = threading.Event(), _Made()
    links = Links(_Store(), b"k", "salt", "r", 0, 1, None, 5.0)
    links._build = lambda *args: (release.wait(10), made)[1]
    dropped = threading.Event()
    threading.Timer(0.2, dropped.set).start()
    t0 = time.monotonic()
    with pytest.raises(PeerDropped, match="trainer was dropped"):
        links.get("trainer>r#0", 2, 1, gone=dropped.is_set)
    assert time.monotonic() - t0 < 2 and made.closed == 0 and "trainer>r#0" not in links._links
    release.set()
    deadline = time.monotonic() + 5
    while made.closed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert made.closed == 1
    # a build that ends while the peer is alive: the link, kept
    assert links.get("trainer>r#1", 2, 1) is made and links._links["trainer>r#1"] is made
    links._build = lambda *args: (_ for _ in ()).throw(RuntimeError("rendezvous timed out"))
    with pytest.raises(RuntimeError, match="rendezvous timed out"):
        links.get("trainer>r#2", 2, 1)
