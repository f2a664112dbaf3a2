"""Fleet planning and admission proofs, pure (no processes): relay trees (a chain, fan-out
trees, every target fed once, only the first source sending), re-feed sources (whole
replicas first, the trainer last), the seed source (only a peer whole at the current
version, never a mixed one, never a busy one, none before the first version), and the
secret (required, never a default; proofs that a wrong secret or other parts cannot make).
One rank's worker, over a real store with a stand-in Refitter: a sender never relays or
seeds a mix; a receive cut by a dying sender marks an unstaged replica as holding a mix
(its version kept) and leaves a staged one whole, until its next complete receive."""

from __future__ import annotations

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
    assert w._what_to_send(task, True)[1] == "r holds a mix of versions"
    w.whole.mixed = False
    assert w._what_to_send(task, True) == (7, None)
    assert "holds version 7, not 8" in w._what_to_send({"version": 8}, True)[1]
    assert "did not receive version 8 whole" in w._what_to_send({"version": 8}, False)[1]
    trainer = Worker(None, None, TRAINER, 0, 2, 1.0)
    assert trainer._what_to_send({"version": 8}, True) == (8, None)


class _Refitter:
    def __init__(self, fail: bool) -> None:
        self.fail, self.committed = fail, 0

    def _go(self, version):
        if self.fail:
            from torchrefit.errors import TransportError
            raise TransportError("injected: the sender died mid-transfer")
        return self

    def refit(self, version):
        return self._go(version).wait()

    def stage(self, version):
        self._go(version)
        return self

    def wait(self):
        return type("R", (), {"bytes_received": 10})()

    def commit(self):
        self.committed += 1


class _Links:
    def __init__(self, refitter) -> None:
        self.refitter, self.forgotten = refitter, []

    def get(self, tag, peer_world):
        return self

    def forget(self, tag):
        self.forgotten.append(tag)

    def keep_only(self, live):
        pass


@pytest.mark.parametrize("staged", [False, True])
def test_a_cut_receive_marks_an_unstaged_replica_mixed_until_its_next_whole_one(staged: bool) -> None:
    """A replica whose sender died mid-transfer: unstaged, its live weights are marked as a
    mix (and its version kept); staged, nothing was committed and it stays whole at its
    version. The next complete receive installs the version and clears the mark."""
    import torch.distributed as dist

    from torchrefit.fleet.board import Board
    from torchrefit.fleet.worker import Whole, Worker
    from torchrefit.testing.jobs import free_port

    board = Board(dist.TCPStore("127.0.0.1", free_port(), None, is_master=True, wait_for_workers=False))
    seen = []
    links = _Links(_Refitter(fail=True))
    w = Worker(board, links, "r", 0, 1, 5.0, Whole(version=3), on_version=seen.append)
    edge = {"tag": "trainer>r#0", "word": "w1", "peer": TRAINER, "peer_world": 2, "stage": staged}
    board.put("edge/w1", {"go": True, "version": 4, "why": None})
    out = w.run({"n": 0, "kind": "update", "version": 4, "in": edge, "outs": [], "live": [TRAINER, "r"]})
    assert not out["in"]["agreed"] and "sender died" in out["in"]["error"]
    assert (w.whole.version, w.whole.mixed) == (3, not staged)
    assert board.get("done/r/0/0")["mixed"] == (not staged) and links.forgotten == ["trainer>r#0"]
    assert seen == []
    # a skipped edge moves no byte: no mix from it
    board.put("edge/w2", {"go": False, "version": 0, "why": "trainer was dropped"})
    w.run({"n": 1, "kind": "update", "version": 4, "in": {**edge, "word": "w2"}, "outs": []})
    assert w.whole.mixed == (not staged)
    links.refitter = _Refitter(fail=False)
    board.put("edge/w3", {"go": True, "version": 5, "why": None})
    out = w.run({"n": 2, "kind": "update", "version": 5, "in": {**edge, "word": "w3"}, "outs": []})
    assert out["in"]["agreed"] and (w.whole.version, w.whole.mixed) == (5, False) and seen == [5]
    assert links.refitter.committed == (1 if staged else 0)
