"""Running one fleet task on one rank of a job (a trainer rank or a replica rank).

A task names at most one incoming edge and any number of outgoing ones, in the order the
coordinator planned. Each edge moves the version in parts (``parts``), and a replica that
relays forwards part ``i`` while it receives part ``i + 1`` (its sending runs on a thread
of its own): the relay is pipelined along the chain or tree.

Incoming, part after part: wait for the sender's word on the part (go, or skip when it has
nothing whole to send or was dropped; a skip of the whole edge counts for every part),
receive it through the part's ``Refitter`` (into the live weights, or the staging copy
where the replica stages), and where this job relays, tell its rank 0 through the store.
Then agree with the job's other ranks: only if every rank received every part is the
version installed (the staging copy copied into the live weights under the replica's
lock where staged). Outgoing: the job's rank 0 says go on a part only once every rank of
the job holds it (relays: each rank received that part; others: the job holds the version
whole), so a relay never forwards a byte of a mix; every rank then sends, edge after edge.
A failed edge is that edge's failure, never the sender's: its later parts are skipped.
The rank's result goes to ``fleet/done/<job>/<n>/<r>``.
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
        outs = task.get("outs", ())
        if task.get("in") and outs:  # a relay: forward each part while receiving the next
            sending = threading.Thread(target=lambda: out["outs"].update(self._send(task, outs, True)),
                                       name=f"fleet-relay-{self.job}", daemon=True)
            sending.start()
            out["in"] = self._receive(task, task["in"], relays=True)
            sending.join()
        elif task.get("in"):
            out["in"] = self._receive(task, task["in"], relays=False)
        elif outs:
            out["outs"] = self._send(task, outs, False)
        if task["kind"] == "seed":  # seeds are rare: keep no group for them
            for e in [task["in"]] if task.get("in") else outs:
                self.links.forget(e["tag"])
        if self.whole is not None:
            out["version"], out["mixed"] = self.whole.version, self.whole.mixed
        self.board.put(f"done/{self.job}/{task['n']}/{self.rank}", out)
        return out

    # --------------------------------------------------------------- receiving
    def _receive(self, task: dict, e: dict, relays: bool) -> dict:
        t0 = perf_counter()
        res = {"ok": False, "agreed": False, "bytes": 0, "error": "", "from": e["peer"]}
        version, wrote, n = None, False, task["n"]
        for p in range(e["parts"]):
            word = self._word(e["word"], p)
            if word is None or not word["go"]:
                res["error"] = (f"{e['peer']} did not send: {word['why']}" if word is not None
                                else "stopped while waiting for the sender")
                break
            version, wrote = word["version"], True
            try:
                r = self.links.get(e["tag"], e["peer_world"], e["parts"]).parts[p]
                res["bytes"] += r.refit(version=version).bytes_received
            except Exception as ex:  # the sender died or timed out: this edge only
                res["error"] = f"receiving from {e['peer']}: {type(ex).__name__}: {_line(ex)}"
                self.links.forget(e["tag"])
                break
            if relays:
                self.board.put(f"part/{self.job}/{n}/{p}/{self.rank}", True)
        else:
            res["ok"] = True
        if relays and not res["ok"]:
            self.board.put(f"part/{self.job}/{n}/{p}/{self.rank}", False)  # no later part follows
        res["agreed"] = self._agree(n, res["ok"])
        if res["agreed"]:
            self._install(e, version)
        else:
            if wrote and not e["stage"]:
                self.whole.mixed = True  # some ranks wrote part of the version into live weights
            if res["ok"]:
                self.links.forget(e["tag"])  # a sibling failed: the pair gets a new group
                res["error"] = "another rank of this replica did not receive its part"
        res["seconds"] = perf_counter() - t0
        return res

    def _word(self, word: str, part: int) -> dict | None:
        """The sender's word on ``part`` of an edge, or on the whole edge (a skip, which
        overrides: the sender was dropped, or its sending failed)."""
        keys, pause = (f"edge/{word}", f"edge/{word}/{part}"), 0.0005
        while True:
            for k in keys:
                if self.board.has(k):
                    return self.board.get(k)
            if self.stop():
                return None
            time.sleep(pause)
            pause = min(2 * pause, SHORT)

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
        with w.lock:  # the engine's forward holds it: no pass sees half a commit
            self.links.sides.install()
        w.version, w.mixed = version, False
        if self.on_version is not None:
            self.on_version(version)

    # ----------------------------------------------------------------- sending
    def _send(self, task: dict, outs: list[dict], relays: bool) -> dict[str, dict]:
        """Send every part on every edge of ``outs``. A relay's rank 0 says go on a part once
        every rank of the job received it, the other ranks follow its word; any other sender
        holds the whole version or not, so its words are said at once and every rank knows
        them without asking."""
        t0 = perf_counter()
        res = {e["tag"]: {"ok": True, "bytes": 0, "seconds": 0.0, "error": "", "skipped": False} for e in outs}
        version, why = (task["version"], None) if relays else self._what_to_send(task)
        if not relays and self.rank == 0:
            for p in range(max(e["parts"] for e in outs)):
                self._say(outs, p, version, why, res)
        for p in range(max(e["parts"] for e in outs)):
            if relays and self.rank == 0:
                why = why or self._part_held(task, p)
                self._say(outs, p, version, why, res)
            for e in outs:
                if p < e["parts"] and res[e["tag"]]["ok"]:
                    word = None if relays and self.rank else {"go": why is None, "version": version, "why": why}
                    self._send_part(e, p, res[e["tag"]], word)
        for r in res.values():
            r["seconds"] = perf_counter() - t0
        return res

    def _say(self, outs: list[dict], p: int, version: int, why: str | None, res: dict) -> None:
        for e in outs:
            if p < e["parts"] and res[e["tag"]]["ok"]:
                self.board.put_once(f"edge/{e['word']}/{p}", {"go": why is None, "version": version, "why": why})

    def _send_part(self, e: dict, p: int, res: dict, word: dict | None) -> None:
        word = word or self._word(e["word"], p)
        if word is None or not word["go"]:
            res.update(ok=False, skipped=True, error=word["why"] if word else "stopped")
            return
        try:
            r = self.links.get(e["tag"], e["peer_world"], e["parts"]).parts[p]
            res["bytes"] += r.refit(version=word["version"]).bytes_sent
        except Exception as ex:  # the receiver died or timed out: this edge only
            self.links.forget(e["tag"])
            res.update(ok=False, error=f"sending to {e['peer']}: {type(ex).__name__}: {_line(ex)}")
            if self.rank == 0:  # the receivers' later parts: skipped, not waited for
                self.board.put_once(f"edge/{e['word']}", {"go": False, "version": 0, "why": res["error"]})

    def _part_held(self, task: dict, p: int) -> str | None:
        """A relay's rank 0: None once every rank of the job received part ``p``, else why not."""
        until = time.monotonic() + self.timeout
        for r in range(self.world):
            told = self.board.wait(f"part/{self.job}/{task['n']}/{p}/{r}", until, self.stop, SHORT)
            if not told:
                return f"{self.job} did not receive version {task['version']} whole"
        return None

    def _what_to_send(self, task: dict) -> tuple[int, str | None]:
        """The version this job sends, and why it sends nothing (None: it sends)."""
        w = self.whole
        if w is None:  # the trainer: its weights are the version it was told
            return task["version"], None
        want = task.get("expect", task["version"])
        if w.mixed:
            return w.version, f"{self.job} holds a mix of versions"
        if w.version != want:
            return w.version, f"{self.job} holds version {w.version}, not {want}"
        return w.version, None


def _line(e: BaseException) -> str:
    return str(e).splitlines()[0][:300] if str(e) else ""
