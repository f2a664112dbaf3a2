"""Running one fleet task on one rank of a job (a trainer rank or a replica rank).

A task names at most one incoming edge and any number of outgoing ones, in the order the
coordinator planned. Incoming: wait for the sender's word on the edge (go, or skip when it
has nothing whole to send or was dropped), receive through the edge's ``Refitter``
(``stage`` where the replica stages, else ``refit``), then agree with the job's other ranks
through the store: only if every rank received its part is the version installed
(``commit`` under the replica's lock where staged). Outgoing, only from a job that holds
the version whole: say go on the edge, then send, edge after edge; a failed edge is that
edge's failure, never the sender's. The rank's result goes to ``fleet/done/<job>/<n>/<r>``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from .board import SHORT, Board
from .links import Links

__all__ = ["Worker", "Whole"]

_log = logging.getLogger(__name__)


@dataclass
class Whole:
    """What this rank's job holds: the version of its live weights, and whether they are a
    mix of two versions (an unstaged receive that did not complete on every rank)."""

    version: int = 0
    mixed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class Worker:
    """Runs the tasks of one rank. ``whole`` is None for trainer ranks (always whole at the
    version they are told to send)."""

    def __init__(self, board: Board, links: Links, job: str, rank: int, world: int, timeout: float,
                 whole: Whole | None = None, on_version: Callable[[int], None] | None = None,
                 stop: Callable[[], bool] = lambda: False) -> None:
        self.board, self.links, self.job = board, links, job
        self.rank, self.world, self.timeout = rank, world, timeout
        self.whole, self.on_version, self.stop = whole, on_version, stop

    def run(self, task: dict[str, Any]) -> dict[str, Any]:
        """Run ``task`` on this rank and publish the result; returns it."""
        self.links.keep_only(set(task.get("live", ())))
        out: dict[str, Any] = {"in": None, "outs": {}}
        holds = True
        if task.get("in"):
            out["in"] = self._receive(task, task["in"])
            holds = out["in"]["agreed"]
        for e in task.get("outs", ()):
            out["outs"][e["tag"]] = self._send(task, e, holds)
        if task["kind"] == "seed":  # seeds are rare: keep no group or staging for them
            for e in [task["in"]] if task.get("in") else task.get("outs", ()):
                self.links.forget(e["tag"])
        if self.whole is not None:
            out["version"], out["mixed"] = self.whole.version, self.whole.mixed
        self.board.put(f"done/{self.job}/{task['n']}/{self.rank}", out)
        return out

    # --------------------------------------------------------------- receiving
    def _receive(self, task: dict, e: dict) -> dict:
        t0 = perf_counter()
        res = {"ok": False, "agreed": False, "bytes": 0, "error": "", "from": e["peer"]}
        word = self.board.wait(f"edge/{e['word']}", stop=self.stop, most=SHORT)
        version = None
        if word is None:
            res["error"] = "stopped while waiting for the sender"
        elif not word["go"]:
            res["error"] = f"{e['peer']} did not send: {word['why']}"
        else:
            version = word["version"]
            try:
                r = self.links.get(e["tag"], e["peer_world"]).refitter
                rep = r.stage(version=version).wait() if e["stage"] else r.refit(version=version)
                res["ok"], res["bytes"] = True, rep.bytes_received
            except Exception as ex:  # the sender died or timed out: this edge only
                res["error"] = f"receiving from {e['peer']}: {type(ex).__name__}: {_line(ex)}"
                self.links.forget(e["tag"])
        res["agreed"] = self._agree(task["n"], res["ok"])
        if res["agreed"]:
            self._install(e, version)
        else:
            if word is not None and word["go"] and not e["stage"]:
                self.whole.mixed = True  # some ranks wrote part of the version into live weights
            if res["ok"]:
                self.links.forget(e["tag"])  # a sibling failed: the pair gets a new group
                res["error"] = "another rank of this replica did not receive its part"
        res["seconds"] = perf_counter() - t0
        return res

    def _agree(self, n: int, ok: bool) -> bool:
        """Every rank of this job received its part (siblings tell through the store; one
        that never tells within the timeout counts as failed)."""
        self.board.put(f"sib/{self.job}/{n}/{self.rank}", ok)
        until = time.monotonic() + self.timeout
        for r in range(self.world):
            told = self.board.wait(f"sib/{self.job}/{n}/{r}", until, self.stop, SHORT)
            if not told:
                return False
        return True

    def _install(self, e: dict, version: int) -> None:
        w = self.whole
        if e["stage"]:
            with w.lock:  # the engine's forward holds it: no pass sees half a commit
                self.links.get(e["tag"], e["peer_world"]).refitter.commit()
        w.version, w.mixed = version, False
        if self.on_version is not None:
            self.on_version(version)

    # ----------------------------------------------------------------- sending
    def _send(self, task: dict, e: dict, holds: bool) -> dict:
        t0 = perf_counter()
        version, why = self._what_to_send(task, holds)
        if self.rank == 0:  # one word per edge; every rank computed the same
            word = {"go": why is None, "version": version, "why": why}
            self.board.put_once(f"edge/{e['word']}", word)
        if why is not None:
            return {"ok": False, "bytes": 0, "seconds": 0.0, "error": why, "skipped": True}
        try:
            r = self.links.get(e["tag"], e["peer_world"]).refitter
            rep = r.stage(version=version).wait() if e["stage"] else r.refit(version=version)
            return {"ok": True, "bytes": rep.bytes_sent, "seconds": perf_counter() - t0, "error": ""}
        except Exception as ex:  # the receiver died or timed out: this edge only
            self.links.forget(e["tag"])
            return {"ok": False, "bytes": 0, "seconds": perf_counter() - t0,
                    "error": f"sending to {e['peer']}: {type(ex).__name__}: {_line(ex)}"}

    def _what_to_send(self, task: dict, holds: bool) -> tuple[int, str | None]:
        """The version this job sends, and why it sends nothing (None: it sends)."""
        w = self.whole
        if w is None:  # the trainer: its weights are the version it was told
            return task["version"], None
        if not holds:
            return w.version, f"{self.job} did not receive version {task['version']} whole"
        want = task.get("expect", task["version"])
        if w.mixed:
            return w.version, f"{self.job} holds a mix of versions"
        if w.version != want:
            return w.version, f"{self.job} holds version {w.version}, not {want}"
        return w.version, None


def _line(e: BaseException) -> str:
    return str(e).splitlines()[0][:300] if str(e) else ""
