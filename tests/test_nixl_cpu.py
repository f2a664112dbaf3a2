"""The nixl transport's own logic on CPU, against a stand-in for the ``nixl_cu13`` package.

NIXL needs a GPU; what this covers runs without one: NIXL's progress thread is off unless
asked for (``TORCHREFIT_NIXL_PROGRESS_THREAD=1`` or ``progress_thread=True``: on an H200 the
thread doubled the refit's time, BENCHMARKS.md "Tenth session"); ``finish_writes`` polls
each posted WRITE until NIXL says DONE (each poll is what progresses UCX's worker with the
thread off), raises naming the peer when one ends in ERR or never completes; and
``wait_done`` polls notifications until the peer's arrives, keeping others for later
waits, and raises naming the peer when it never comes. One spawned process runs every case.
"""

from __future__ import annotations

import os
import sys
import types

import torch

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
        return self.states.pop(0) if self.states else "PROC"

    def get_new_notifs(self) -> dict:
        return self.notifs.pop(0) if self.notifs else {}


class _Config:
    def __init__(self, enable_prog_thread: bool = True, backends=("UCX",)) -> None:
        self.enable_pthread = enable_prog_thread


def _install_fake() -> None:
    api = types.ModuleType("nixl_cu13._api")
    api.nixl_agent, api.nixl_agent_config = _Agent, _Config
    pkg = types.ModuleType("nixl_cu13")
    pkg._api = api
    sys.modules.update({"nixl_cu13": pkg, "nixl_cu13._api": api})


def _cases(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from torchrefit.errors import TransportError
    from torchrefit.transport import nixl

    _install_fake()
    group, cuda = dist.group.WORLD, torch.device("cuda", 0)  # require_cuda reads the type only
    out: dict = {}
    os.environ.pop("TORCHREFIT_NIXL_PROGRESS_THREAD", None)
    out["thread default"] = nixl.NixlTransport(group, cuda)._agent.config.enable_pthread
    os.environ["TORCHREFIT_NIXL_PROGRESS_THREAD"] = "1"
    out["thread env"] = nixl.NixlTransport(group, cuda)._agent.config.enable_pthread
    os.environ.pop("TORCHREFIT_NIXL_PROGRESS_THREAD")
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
    nixl._TIMEOUT_S = 0.05
    t._agent.states, t._posted = [], [(4, "d")]
    try:
        t.finish_writes()
        out["timeout"] = None
    except TransportError as e:
        out["timeout"] = str(e)

    t._agent.notifs = [{}, {"x": [b"torchrefit:7"]}, {}, {"y": [b"torchrefit:5"]}]
    t.global_rank = lambda peer: peer  # the fake world has one rank: peers are labels here
    t.wait_done(5, b"")
    out["kept"] = list(t._pending_notifs)
    t.wait_done(7, b"")  # arrived earlier, kept for this wait
    out["kept after"] = list(t._pending_notifs)
    try:
        t.wait_done(6, b"")
        out["no notif"] = None
    except TransportError as e:
        out["no notif"] = str(e)
    return out


def test_nixl_progress_thread_and_polled_waits() -> None:
    (got,) = run_world(_cases, 1, timeout=120)
    assert got["thread default"] is False and got["thread env"] is True and got["thread arg"] is True, got
    assert got["polls to done"] == 9 and got["posted after"] == 0, got  # both WRITEs polled to DONE
    assert "rank 3 failed (ERR)" in got["err"], got
    assert "rank 4 did not complete" in got["timeout"], got
    assert got["kept"] == [b"torchrefit:7"] and got["kept after"] == [], got
    assert "no write notification from rank 6" in got["no notif"], got
