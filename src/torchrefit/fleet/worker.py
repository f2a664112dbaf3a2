"""Running one fleet task on one rank of a job (a trainer rank or a replica rank).

A task names at most one incoming edge and any number of outgoing ones, in the order the
coordinator planned. Each edge moves the version in parts (``parts``), and a replica that
relays forwards part ``i`` while it receives part ``i + 1`` (its sending runs on a thread
of its own): the relay is pipelined along the chain or tree.

Incoming, part after part: wait for the sender's word on the part (go, or skip when it has
nothing whole to send or was dropped), receive it through the part's ``Refitter`` (into the
live weights, or the staging copy where the replica stages), and where this job relays,
count it held: the rank whose count makes every rank of the job hold the part says go on it
downstream, so a relay never forwards a byte of a mix; a rank that misses a part says skip
on it and every later one (the first word on a part holds). Then agree with the job's other
ranks: only if every rank received every part is the version installed (the staging copy
copied into the live weights under the replica's lock where staged). Outgoing: every rank
sends each part on the word it reads (a relay's, above; any other sender's rank 0 says every
word at once, since it holds the whole version or not). A failed edge is that edge's
failure, never the sender's: its later parts are skipped.
The rank's result goes to ``fleet/done/<job>/<n>/<r>``.

Every wait blocks in the store and is woken by the word it waits for (no polling): words
a relay's sending thread waits for end by its timeout, where it says skip itself. The one
exception is an edge's first use: its group is built while the rank looks every 50 ms
whether the peer job was dropped (``links``), since a rendezvous cannot be woken.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from .board import Board
from .links import Link, Links

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
        self._relay_board: Board | None = None  # the relay thread's own client (it blocks)

    def run(self, task: dict[str, Any]) -> dict[str, Any]:
        """Run ``task`` on this rank and publish the result; returns it."""
        self.links.keep_only(set(task.get("live", ())))
        out: dict[str, Any] = {"in": None, "outs": {}}
        outs = task.get("outs", ())
        if task.get("in") and outs:  # a relay: forward each part while receiving the next
            if self._relay_board is None:
                self._relay_board = self.board.for_thread()
            b = self._relay_board
            sending = threading.Thread(target=lambda: out["outs"].update(self._send(b, task, outs, True)),
                                       name=f"fleet-relay-{self.job}", daemon=True)
            sending.start()
            out["in"] = self._receive(task, task["in"], outs)
            sending.join()
        elif task.get("in"):
            out["in"] = self._receive(task, task["in"], [])
        elif outs:
            out["outs"] = self._send(self.board, task, outs, False)
        if task["kind"] == "seed":  # seeds are rare: keep no group for them
            for e in [task["in"]] if task.get("in") else outs:
                self.links.forget(e["tag"])
        if self.whole is not None:
            out["version"], out["mixed"] = self.whole.version, self.whole.mixed
        self.board.put(f"done/{self.job}/{task['n']}/{self.rank}", out)
        return out

    # --------------------------------------------------------------- receiving
    def _receive(self, task: dict, e: dict, outs: list[dict]) -> dict:
        """Receive every part of edge ``e``; a relay (``outs``) tells on each part it holds."""
        t0 = perf_counter()
        res = {"ok": False, "agreed": False, "bytes": 0, "error": "", "from": e["peer"]}
        version, wrote, n = None, False, task["n"]
        for p in range(e["parts"]):
            word = self._word(self.board, e["word"], p)
            if word is None or not word["go"]:
                res["error"] = (f"{e['peer']} did not send: {word['why']}" if word is not None
                                else "stopped while waiting for the sender")
                break
            version, wrote = word["version"], True
            try:
                r = self._link(self.board, e).parts[p]
                res["bytes"] += r.refit(version=version).bytes_received
            except Exception as ex:  # the sender died or timed out: this edge only
                res["error"] = f"receiving from {e['peer']}: {type(ex).__name__}: {_line(ex)}"
                self.links.forget(e["tag"])
                break
            if outs:
                self._held(task, outs, p, version)
        else:
            res["ok"] = True
        if outs and not res["ok"]:  # this rank lacks part p: no rank forwards it, nor any later one
            why = f"{self.job} did not receive version {task['version']} whole"
            for q in range(p, max(o["parts"] for o in outs)):
                self._say(self.board, outs, q, task["version"], why)
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

    def _link(self, b: Board, e: dict) -> Link:
        """Edge ``e``'s link, met over ``b`` (this thread's client); a build stops as soon as
        the peer job is dropped (``fleet/dropped/<peer>``)."""
        return self.links.get(e["tag"], e["peer_world"], e["parts"], b.store,
                              gone=lambda: b.has(f"dropped/{e['peer']}"))

    def _held(self, task: dict, outs: list[dict], p: int, version: int) -> None:
        """A relay rank received part ``p``: the rank that makes every rank of the job hold
        it says go on it downstream (one count per part and job, not a word per rank)."""
        if self.world == 1 or self.board.add(f"held/{self.job}/{task['n']}/{p}", 1) == self.world:
            self._say(self.board, outs, p, version, None)

    def _word(self, b: Board, word: str, part: int, until: float | None = None) -> dict | None:
        """The sender's word on ``part`` of an edge (a skip of the whole edge overwrites
        every part's); None where ``stop()`` says so or ``until`` passed."""
        return b.wait_for(f"edge/{word}/{part}", until, self.stop)

    def _agree(self, n: int, ok: bool) -> bool:
        """Every rank of this job received its part: the rank whose count makes all of them
        says so; a rank that did not, or that waited past its timeout, says no. The first
        word holds, so every rank installs or none does."""
        if self.world == 1:
            return ok
        key = f"agreed/{self.job}/{n}"
        if not ok:
            return bool(self.board.put_once(key, False))
        if self.board.add(f"got/{self.job}/{n}", 1) == self.world:
            return bool(self.board.put_once(key, True))
        told = self.board.wait_for(key, time.monotonic() + self.timeout, self.stop)
        return bool(told if told is not None else self.board.put_once(key, False))

    def _install(self, e: dict, version: int) -> None:
        w = self.whole
        with w.lock:  # the engine's forward holds it: no pass sees half a commit
            self.links.sides.install()
        w.version, w.mixed = version, False
        if self.on_version is not None:
            self.on_version(version)

    # ----------------------------------------------------------------- sending
    def _send(self, b: Board, task: dict, outs: list[dict], relays: bool) -> dict[str, dict]:
        """Send every part on every edge of ``outs`` (over ``b``, this thread's client). A
        relay's words come from the ranks that receive (``_held``); any other sender holds
        the whole version or not, so its rank 0 says every word at once. The trainer's ranks
        send on the word they know (go: a trainer holds what it is told to send); a
        replica's other ranks, and a relay's every rank, on the word they read."""
        t0 = perf_counter()
        res = {e["tag"]: {"ok": True, "bytes": 0, "seconds": 0.0, "error": "", "skipped": False} for e in outs}
        parts = max(e["parts"] for e in outs)
        said = None
        if self.whole is None:  # the trainer holds the version it is told: every rank knows it
            said = {"go": True, "version": task["version"], "why": None}
            if self.rank == 0:  # no one else says a word on its edges first
                b.put_many({f"edge/{e['word']}/{p}": said for e in outs for p in range(e["parts"])})
        elif not relays and self.rank == 0:  # a seeding peer: a drop's skip may be there already, and holds
            version, why = self._what_to_send(task)
            said = {"go": why is None, "version": version, "why": why}
            for p in range(parts):
                self._say(b, outs, p, version, why)
        for p in range(parts):
            for e in outs:
                if p < e["parts"] and res[e["tag"]]["ok"]:
                    self._send_part(b, task, e, p, res[e["tag"]], said, relays)
        for r in res.values():
            r["seconds"] = perf_counter() - t0
        return res

    def _say(self, b: Board, outs: list[dict], p: int, version: int, why: str | None) -> None:
        for e in outs:
            if p < e["parts"]:
                b.put_once(f"edge/{e['word']}/{p}", {"go": why is None, "version": version, "why": why})

    def _send_part(self, b: Board, task: dict, e: dict, p: int, res: dict, said: dict | None,
                   relays: bool) -> None:
        word = said
        if word is None:
            word = self._word(b, e["word"], p, time.monotonic() + self.timeout if relays else None)
            if word is None and relays:  # the job's ranks did not all hold it in time: skip it
                why = f"{self.job} did not receive version {task['version']} whole within {self.timeout:g} s"
                word = b.put_once(f"edge/{e['word']}/{p}", {"go": False, "version": 0, "why": why})
        if word is None or not word["go"]:
            res.update(ok=False, skipped=True, error=word["why"] if word else "stopped")
            return
        try:
            r = self._link(b, e).parts[p]
            res["bytes"] += r.refit(version=word["version"]).bytes_sent
        except Exception as ex:  # the receiver died or timed out: this edge only
            self.links.forget(e["tag"])
            res.update(ok=False, error=f"sending to {e['peer']}: {type(ex).__name__}: {_line(ex)}")
            if self.rank == 0:  # the receivers' later parts: skipped, not waited for
                skip = {"go": False, "version": 0, "why": res["error"]}
                if p + 1 < e["parts"]:
                    b.put_many({f"edge/{e['word']}/{q}": skip for q in range(p + 1, e["parts"])})

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
