"""Fleet admission on real processes (CPU, gloo): a 2-rank trainer job and one honest TP1
replica job, while the test process plays the joiners the fleet must refuse:

* ``join`` with a wrong secret raises ``JoinRefused`` ("wrong secret");
* a request without a proof (no secret) is answered "refused: no secret presented";
* a raw TCP connection to the fleet's store that sends nothing, held open throughout;
* a request counted but never completed (it never names itself);
* a joiner that presents the secret and then goes silent (its ranks never start): dropped
  after the join timeout.

Checked: each refusal is logged by the trainer; a refused joiner is never given a task (so
never a byte of weights) and the silent one only its stop; updates go on meanwhile at their
pace (no joiner stalls the fleet); the honest replica is exact against the toy's oracle at
every version and ends at the last one. ``join`` without any secret raises at once.

A replica killed before it met its peer in an edge's group (it blocks in its build, never
publishing its address) is dropped within ``drop_after``: no peer waits out the fleet's
``timeout`` in the rendezvous, and the live replica is exact at every version.
"""

from __future__ import annotations

import os
import socket
import time

import fleet_scenarios as fs
import pytest

import torchrefit.fleet as fleet
from torchrefit import settings
from torchrefit.fleet.board import Board, open_store
from torchrefit.fleet.secret import prove
from torchrefit.testing import Mesh, build_toy
from torchrefit.testing.fleet_jobs import Job
from torchrefit.testing.jobs import free_ports

UPDATES, JOIN_TIMEOUT = 30, 3.0


def _raw_join(board: Board, name: str, proof: str, ranks: int = 1) -> None:
    board.put(f"join/{name}", {"ranks": ranks, "parts": 1, "staged": True, "host": "rogue", "pid": 0,
                               "proof": proof})
    board.put(f"joins/{board.add('joins', 1)}", name)


def test_admission_refuses_without_the_secret(tmp_path) -> None:
    port = free_ports(1)[0]
    hold = str(tmp_path / "hold")
    trainer = Job(fs.trainer, 2, port, UPDATES, 1, 10.0, 3.0, 0.1, None, True, 0, JOIN_TIMEOUT, hold)
    honest = Job(fs.replica, 1, port, "honest", True, str(tmp_path), 10.0)
    try:
        with settings.overridden(fleet_secret=""):
            with pytest.raises(ValueError, match="no fleet secret"):
                fleet.join(None, 0, 1, "127.0.0.1", port)
        model = build_toy(fs.SPEC, Mesh(tp=1, ranks=1), 0, seed=0)
        with pytest.raises(fleet.JoinRefused, match="wrong secret"):
            fleet.join(model, 0, 1, "127.0.0.1", port, name="wrong", secret="not-the-secret", timeout=60)
        board = Board(open_store("127.0.0.1", port, False, 30))
        silent_socket = socket.create_connection(("127.0.0.1", port))
        _raw_join(board, "nosecret", "")
        assert board.wait("admit/nosecret", time.monotonic() + 30) == {
            "ok": False, "why": "no secret presented"}
        board.add("joins", 1)  # counted, never named
        salt = board.get("salt")
        _raw_join(board, "mute", prove(fs.SECRET.encode(), "join", salt, "mute", "1"))
        assert board.wait("admit/mute", time.monotonic() + 30)["ok"]  # it holds the secret...
        stop = board.wait("task/mute/0", time.monotonic() + 30)  # ...but never starts: dropped
        assert stop["kind"] == "stop" and "went silent" in stop["why"]
        time.sleep(JOIN_TIMEOUT + 1)  # the unnamed request's refusal is due
        for name in ("wrong", "nosecret"):
            assert board.get(f"task/{name}/0") is None, f"{name} was given a task"
        assert board.get("task/mute/1") is None
        open(hold, "w").close()
        got = trainer.results(180)
        silent_socket.close()
    finally:
        open(hold, "w").close()
        trainer.kill()
        honest.kill()
    for g in got:
        assert g is not None and g[0], f"a trainer rank failed:\n{g}"
    t0 = got[0][1]
    warned = "\n".join(t0["warnings"])
    for expect in ("refused joiner 'wrong-", "wrong secret", "refused joiner 'nosecret'",
                   "no secret presented", "never named itself", "dropped mute: went silent"):
        assert expect in warned, f"{expect!r} not logged:\n{warned}"
    reports = t0["reports"]
    assert [r.version for r in reports] == list(range(1, UPDATES + 1))
    for r in reports:  # the honest replica is fed; the silent one appears only as dropped
        assert all(x.name.startswith("honest") or (x.name == "mute" and x.dropped) for x in r.replicas), str(r)
        assert sum(x.name.startswith("honest") for x in r.replicas) == (1 if r.replicas else 0), str(r)
    assert reports[-1].replicas[0].version == UPDATES
    assert t0["worst"] < 2.0, f"an update took {t0['worst']:.2f} s while joiners were refused"
    logs = fs.read_logs(str(tmp_path))
    assert logs and all(line["ok"] for line in logs)
    assert os.path.exists(hold)


def test_a_replica_killed_before_its_edge_is_built_holds_no_one_for_the_timeout(tmp_path) -> None:
    timeout, drop_after, updates = 60.0, 2.0, 3
    port = free_ports(1)[0]
    gate = str(tmp_path / "gate")
    trainer = Job(fs.trainer, 2, port, updates, 2, timeout, drop_after, 0.05)
    honest = Job(fs.replica, 1, port, "honest", True, str(tmp_path), timeout)
    victim = Job(fs.replica, 2, port, "victim", True, str(tmp_path), timeout, fs.SECRET, "cpu",
                 "auto", gate)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(f"{gate}.0") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.path.exists(f"{gate}.0"), "the victim never began building an edge"
        victim.kill()
        got = trainer.results(180)
    finally:
        trainer.kill()
        honest.kill()
        victim.kill()
    for g in got:
        assert g is not None and g[0], f"a trainer rank failed:\n{g}"
    t0 = got[0][1]
    first = t0["reports"][0]
    dropped = [x for x in first.replicas if x.dropped]
    assert [x.name.split("-")[0] for x in dropped] == ["victim"], str(first)
    assert "stopped beating" in dropped[0].dropped, str(first)
    # the update ended soon after the drop, not after a rendezvous's timeout
    assert t0["worst"] < timeout / 3, f"an update took {t0['worst']:.1f} s (timeout {timeout:g} s)"
    assert [r.replicas[0].version for r in t0["reports"][1:]] == list(range(2, updates + 1))
    logs = [line for line in fs.read_logs(str(tmp_path)) if line["name"].startswith("honest")]
    assert [line["v"] for line in logs] == list(range(1, updates + 1)) and all(line["ok"] for line in logs)
