"""The nixl transport's own logic on CPU, against a stand-in for the ``nixl_cu13`` package.

What this covers needs failures NIXL itself cannot be made to produce on cue
(``test_nixl_dram.py`` runs the real package): NIXL's progress thread is off unless
asked for (``progress_thread=True``: the thread and the host's polls contend for UCX's
worker); ``finish_writes`` polls
each posted WRITE until NIXL says DONE (each poll is what progresses UCX's worker with the
thread off), raises naming the peer when one ends in ERR or never completes; and
``wait_done`` polls notifications until the peer's arrives, keeping others for later
waits, and raises naming the peer when it never comes; NIXL's own exceptions (a peer that
died mid-transfer) become TransportError naming the peer; a transport error names the
peer's global rank only where it has one in the default group (not a ``tr.connect`` joint
group's stand-in). One spawned process runs every case.
"""

from __future__ import annotations

import sys
import types

import torch

from torchrefit import settings
from torchrefit.testing import run_world


class _Agent:
    """Records its config; WRITE states and notifications come from scripted lists."""

    made: list = []

    def __init__(self, name: str, config) -> None:
        self.config = config
        self.states: list[str] = []
        self.polls = 0
        self.notifs: list[dict] = []
        _Agent.made.append(self)

    def check_xfer_state(self, request) -> str:
        self.polls += 1
        state = self.states.pop(0) if self.states else "PROC"
        if state == "GONE":
            raise nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")
        return state

    def get_new_notifs(self) -> dict:
        got = self.notifs.pop(0) if self.notifs else {}
        if got == "GONE":
            raise nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")
        return got


class nixlRemoteDisconnectError(Exception):  # noqa: N801 (NIXL's own name)
    """What NIXL raises where the peer's process is gone."""


class _Config:
    def __init__(self, enable_prog_thread: bool = True, backends=("UCX",)) -> None:
        self.enable_pthread = enable_prog_thread


def _install_fake() -> None:
    api = types.ModuleType("nixl_cu13._api")
    api.nixl_agent, api.nixl_agent_config = _Agent, _Config
    bindings = types.ModuleType("nixl_cu13._bindings")
    bindings.nixlRemoteDisconnectError = nixlRemoteDisconnectError
    pkg = types.ModuleType("nixl_cu13")
    pkg._api, pkg._bindings = api, bindings
    sys.modules.update({"nixl_cu13": pkg, "nixl_cu13._api": api, "nixl_cu13._bindings": bindings})


def _cases(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from torchrefit.errors import TransportError
    from torchrefit.transport import nixl

    _install_fake()
    group, cuda = dist.group.WORLD, torch.device("cuda", 0)  # require_cuda reads the type only
    out: dict = {}
    out["thread default"] = nixl.NixlTransport(group, cuda)._agent.config.enable_pthread
    out["thread arg"] = nixl.NixlTransport(group, cuda, progress_thread=True)._agent.config.enable_pthread

    t = nixl.NixlTransport(group, cuda)
    t._agent.states = ["PROC"] * 5 + ["DONE"] + ["PROC", "PROC", "DONE"]
    t._posted = [(1, "a"), (2, "b")]
    t.finish_writes()
    out["polls to done"], out["posted after"] = t._agent.polls, len(t._posted)
    t._agent.states, t._posted = ["PROC", "ERR"], [(3, "c")]
    try:
        t.finish_writes()
        out["err"] = None
    except TransportError as e:
        out["err"] = str(e)
    settings.configure(nixl_timeout=0.05)
    t._agent.states, t._posted = [], [(4, "d")]
    try:
        t.finish_writes()
        out["timeout"] = None
    except TransportError as e:
        out["timeout"] = str(e)

    t._agent.notifs = [{}, {"x": [b"torchrefit:7"]}, {}, {"y": [b"torchrefit:5"]}]
    t.wait_done(5, b"")
    out["kept"] = list(t._pending_notifs)
    t.wait_done(7, b"")  # arrived earlier, kept for this wait
    out["kept after"] = list(t._pending_notifs)
    try:
        t.wait_done(6, b"")
        out["no notif"] = None
    except TransportError as e:
        out["no notif"] = str(e)

    # a peer's global rank is named only where it has one in this process's default group
    t._global = [0]
    out["named global"] = str(t.peer_error(0, "receive", RuntimeError("gone")))
    t._global = [1 << 24]  # a tr.connect joint group's stand-in
    out["stand-in"] = str(t.peer_error(0, "receive", RuntimeError("gone")))

    # a peer that died: NIXL's own exception becomes TransportError naming it
    settings.configure(nixl_timeout=5.0)
    t._agent.states, t._posted = ["PROC", "GONE"], [(2, "e")]
    try:
        t.finish_writes()
        out["gone writing"] = None
    except TransportError as e:
        out["gone writing"] = (str(e), e.ranks, e.rule)
    t._agent.notifs = [{}, "GONE"]
    try:
        t.wait_done(3, b"")
        out["gone waiting"] = None
    except TransportError as e:
        out["gone waiting"] = (str(e), e.ranks)
    return out


def test_nixl_progress_thread_and_polled_waits() -> None:
    (got,) = run_world(_cases, 1, timeout=120)
    assert got["thread default"] is False and got["thread arg"] is True, got
    assert got["polls to done"] == 9 and got["posted after"] == 0, got  # both WRITEs polled to DONE
    assert "rank 3 failed (ERR)" in got["err"], got
    assert "rank 4 did not complete" in got["timeout"], got
    assert got["kept"] == [b"torchrefit:7"] and got["kept after"] == [], got
    assert "no write notification from rank 6" in got["no notif"], got
    assert "receive from rank 0 (global rank 0) failed" in got["named global"], got
    assert "receive from rank 0 failed" in got["stand-in"] and "global rank" not in got["stand-in"], got
    msg, ranks, rule = got["gone writing"]
    assert "completing the WRITE with rank 2 failed (nixlRemoteDisconnectError" in msg and ranks == (2,), got
    assert rule == "nixl failure", got
    msg, ranks = got["gone waiting"]
    assert "notification with rank 3 failed" in msg and ranks == (3,), got
