"""The fleet's coordinator, on the trainer's rank 0: admission, membership, seeding and
the rounds of each update. It decides; the ranks of every job act on its tasks.

A background thread admits joiners (checking their proof of the secret; a refusal is
logged and answered, and the joiner is never named in any task, so it never receives a
byte), watches heartbeats (a replica whose ranks stop beating for ``drop_after`` seconds
is dropped: killed, host lost or hung), and seeds newcomers from a peer holding the current
version whole. ``update`` (on the trainer's call) plans the relay, posts one task per job,
runs the trainer's own part, collects every job's result, and feeds the orphans of a
dropped relay node in further rounds. Every wait is bounded; a dropped replica is named in
the report, never raised.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .board import Board, open_store
from .links import edge_tag
from .relay import TRAINER, Edge, Holding, refeed_sources, relay_edges, seed_source
from .report import FleetReport, MemberState, ReplicaOutcome
from .secret import check, prove

__all__ = ["Coordinator", "MAX_ROUNDS"]

_log = logging.getLogger("torchrefit.fleet")

#: rounds an update may take: the first, then feeding orphans of dropped relay nodes
MAX_ROUNDS = 3
_TICK = 0.05  # seconds between two looks of the watcher
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


@dataclass
class _Member:
    name: str
    ranks: int
    staged: bool
    host: str
    order: int
    parts: int = 1
    state: str = "arming"
    version: int = 0
    mixed: bool = False
    reason: str = ""
    since: float = field(default_factory=time.monotonic)
    beats: list[tuple[int, float]] = field(default_factory=list)
    seed: dict | None = None
    reported: bool = False

    def holding(self) -> Holding:
        return Holding(self.name, self.version, self.mixed)

    def public(self) -> MemberState:
        return MemberState(self.name, self.ranks, self.state, self.version, self.mixed, self.reason)


class Coordinator:
    """Rank 0 of the trainer: hosts the store and runs the fleet (see the module docstring)."""

    def __init__(self, address: str, port: int, key: bytes, trainer_ranks: int, timeout: float,
                 drop_after: float, join_timeout: float, fanout: int,
                 relay: bool = True, chunks: int = 4) -> None:
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, not {chunks}")
        self.key, self.trainer_ranks, self.timeout = key, trainer_ranks, timeout
        self.drop_after, self.join_timeout, self.fanout, self.relay = drop_after, join_timeout, fanout, relay
        self.store = open_store(address, port, True, timeout)
        self.board = Board(self.store)
        self._wboard = Board(open_store(address, port, False, timeout))  # the watcher's own client
        self.salt = secrets.token_hex(16)
        self.board.put("chunks", chunks)
        self.board.put("salt", self.salt)
        self.version = 0
        self.inflight: int | None = None
        self.members: dict[str, _Member] = {}
        self._lock = threading.RLock()
        self._tasks: dict[str, int] = {}
        self._gen: dict[tuple[str, str], int] = {}
        self._words = 0
        self._open: dict[str, tuple[str, int]] = {}  # words not yet certain -> (the sender's job, parts)
        self._collecting: dict[str, int] = {}  # job -> the task whose results update() waits for
        self._trash: list[str] = []  # keys of finished tasks, deleted by the watcher (off the update's path)
        self._joins_seen = 0
        self._unnamed: dict[int, float] = {}  # join indices counted but not yet named
        self._order = 0
        #: every seed that made a replica ready: (newcomer, peer, version, seconds)
        self.seeds: list[tuple[str, str, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="torchrefit-fleet", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ tasks
    def post(self, board: Board, job: str, task: dict[str, Any]) -> int:
        n, task = self._number(job, task)
        board.put(f"task/{job}/{n}", task)
        return n

    def _number(self, job: str, task: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        n = self._tasks.get(job, 0)
        self._tasks[job] = n + 1
        return n, {**task, "n": n, "live": self._live()}

    def _live(self) -> list[str]:
        return [TRAINER] + [m.name for m in self.members.values() if m.state != "dropped"]

    def _world(self, job: str) -> int:
        return self.trainer_ranks if job == TRAINER else self.members[job].ranks

    def _staged(self, job: str) -> bool:
        return False if job == TRAINER else self.members[job].staged

    def _edge(self, src: str, dst: str, toward: str) -> dict:
        """Edge ``src -> dst`` as ``toward``'s end sees it (its peer is the other end)."""
        peer = dst if toward == src else src
        self._words += 1
        tag = edge_tag(src, dst, self._gen.get((src, dst), 0))
        return {"tag": tag, "word": f"{tag}@{self._words}", "peer": peer,
                "peer_world": self._world(peer), "stage": self._staged(dst), "parts": self.members[dst].parts}

    def _post_edges(self, board: Board, edges: list[Edge], kind: str, version: int,
                    expect: int | None = None) -> tuple[dict[str, int], dict[str, str], dict[str, Any]]:
        """One task per job named by ``edges`` (posted in one store call); the edge dicts of
        both ends share one word key. Returns each job's task number, each target's word
        (each recorded as open: a drop of its sender skips it), and each task as its job
        reads it, by key (the trainer's own runs from it, without reading it back)."""
        ins: dict[str, dict] = {}
        outs: dict[str, list[dict]] = {}
        for e in edges:
            d = self._edge(e.src, e.dst, e.src)
            outs.setdefault(e.src, []).append(d)
            ins[e.dst] = {**d, "peer": e.src, "peer_world": self._world(e.src)}
        posted, tasks = {}, {}
        for job in dict.fromkeys([e.src for e in edges] + [e.dst for e in edges]):
            task = {"kind": kind, "version": version, "in": ins.get(job), "outs": outs.get(job, [])}
            if expect is not None:
                task["expect"] = expect
            posted[job], tasks[f"task/{job}/{posted[job]}"] = self._number(job, task)
        words = {dst: d["word"] for dst, d in ins.items()}
        for e in edges:
            self._open[words[e.dst]] = (e.src, ins[e.dst]["parts"])
        return posted, words, board.put_many(tasks)

    # --------------------------------------------------------------- watching
    def _watch(self) -> None:
        b = self._wboard
        while not self._stop.wait(_TICK):
            try:
                with self._lock:
                    self._admit_new(b)
                    self._check_members(b)
                    self._check_seeds(b)
                    self._start_seeds(b)
                    trash, self._trash = self._trash, []
                for key in trash:
                    b.delete(key)
            except Exception:
                if self._stop.is_set():
                    return
                _log.exception("fleet watcher: unexpected error (continuing)")

    def _admit_new(self, b: Board) -> None:
        count = b.add("joins", 0)
        while self._joins_seen < count:
            self._joins_seen += 1
            self._unnamed[self._joins_seen] = time.monotonic()
        for k, since in list(self._unnamed.items()):
            name = b.get(f"joins/{k}")
            if name is None:
                if time.monotonic() - since > self.join_timeout:
                    del self._unnamed[k]
                    _log.warning("fleet: refused join request %d: it never named itself", k)
                continue
            del self._unnamed[k]
            self._judge(b, str(name))

    def _judge(self, b: Board, name: str) -> None:
        req = b.get(f"join/{name}") if _NAME.match(name) else None
        why = self._refusal(name, req)
        if why is not None:
            host = req.get("host", "?") if isinstance(req, dict) else "?"
            pid = req.get("pid", "?") if isinstance(req, dict) else "?"
            _log.warning("fleet: refused joiner %r (host %s, pid %s): %s", name[:128], host, pid, why)
            if _NAME.match(name):
                b.put_once(f"admit/{name}", {"ok": False, "why": why})
            return
        self._order += 1
        self.members[name] = _Member(name, int(req["ranks"]), bool(req["staged"]), str(req["host"]),
                                     self._order, int(req["parts"]))
        b.put_once(f"admit/{name}", {"ok": True, "proof": prove(self.key, "admit", self.salt, name)})
        _log.info("fleet: admitted %s (%d rank(s) on %s, %s)", name, int(req["ranks"]), req["host"],
                  "staged" if req["staged"] else "unstaged")

    def _refusal(self, name: str, req: Any) -> str | None:
        if not _NAME.match(name):
            return "its name is not [A-Za-z0-9._-]{1,128}"
        if (not isinstance(req, dict) or not isinstance(req.get("ranks"), int) or req["ranks"] < 1
                or not isinstance(req.get("parts"), int) or req["parts"] < 1):
            return "malformed join request"
        if name in self.members or name == TRAINER:
            return "a replica of that name already joined (a restart joins under a new name)"
        proof = req.get("proof")
        if not proof:
            return "no secret presented"
        if not check(self.key, proof, "join", self.salt, name, str(req["ranks"])):
            return "wrong secret"
        return None

    def _check_members(self, b: Board) -> None:
        now = time.monotonic()
        for m in list(self.members.values()):
            if m.state == "dropped":
                continue
            if m.state == "arming":
                if all(b.has(f"armed/{m.name}/{r}") for r in range(m.ranks)):
                    m.state, m.beats = "joined", [(-1, now)] * m.ranks
                elif now - m.since > self.join_timeout:
                    self.drop(b, m.name, f"went silent after joining: not all of its {m.ranks} rank(s) "
                                         f"started within {self.join_timeout:g} s")
                continue
            if b.has(f"left/{m.name}"):
                self.drop(b, m.name, "left the fleet")
                continue
            for r in range(m.ranks):
                count = b.add(f"hb/{m.name}/{r}", 0)
                if count != m.beats[r][0]:
                    m.beats[r] = (count, now)
                elif now - m.beats[r][1] > self.drop_after:
                    self.drop(b, m.name, f"rank {r} stopped beating for {self.drop_after:g} s "
                                         "(killed, host lost or hung)")
                    break

    def drop(self, b: Board, name: str, why: str) -> None:
        """Take ``name`` out of the fleet: later tasks leave it out, its pending edges are
        skipped (so no peer waits on it), and it is told to stop if it still listens."""
        m = self.members[name]
        if m.state == "dropped":
            return
        m.state, m.reason = "dropped", why
        _log.warning("fleet: dropped %s: %s", name, why)
        b.put("dropped/" + name, why)
        self.post(b, name, {"kind": "stop", "why": why})
        for word, (src, parts) in list(self._open.items()):
            if src == name:
                self._skip(b, word, parts, f"{name} was dropped: {why}")
        if name in self._collecting:  # wake update(): no result of this job is to come
            n = self._collecting[name]
            for r in range(m.ranks):
                b.put_once(f"done/{name}/{n}/{r}", None)

    def _skip(self, b: Board, word: str, parts: int, why: str) -> None:
        """Skip every part of an edge, over any word said on it (its sender is gone)."""
        b.put_many({f"edge/{word}/{p}": {"go": False, "version": 0, "why": why} for p in range(parts)})

    # ---------------------------------------------------------------- seeding
    def _start_seeds(self, b: Board) -> None:
        if self.inflight is not None:
            return  # the update feeds everyone it can; seeds start after it
        busy = frozenset(m.seed["src"] for m in self.members.values() if m.seed)
        for m in sorted(self.members.values(), key=lambda m: m.order):
            if m.state not in ("joined", "waiting"):
                continue
            peers = [p.holding() for p in sorted(self.members.values(), key=lambda p: p.order)
                     if p.state == "ready"]
            src = seed_source(peers, self.version, busy)
            if src is None:
                m.state = "waiting"
                continue
            posted, words, _ = self._post_edges(b, [Edge(src, m.name)], "seed", self.version, expect=self.version)
            word = words[m.name]
            m.state = "seeding"
            m.seed = {"src": src, "n": posted[m.name], "word": word, "version": self.version,
                      "t0": time.monotonic()}
            busy = busy | {src}
            _log.info("fleet: seeding %s from %s at version %d", m.name, src, self.version)

    def _check_seeds(self, b: Board) -> None:
        for m in self.members.values():
            if m.seed is None:
                continue
            if m.state == "dropped":
                self._open.pop(m.seed["word"], None)
                m.seed = None
                continue
            done = [b.get(f"done/{m.name}/{m.seed['n']}/{r}") for r in range(m.ranks)]
            if any(d is None for d in done):
                continue
            seed, m.seed = m.seed, None
            self._open.pop(seed["word"], None)
            self._forget_words(seed["word"], m.name)
            self._bump(seed["src"], m.name)  # the seeding edge's group is gone: the next one meets anew
            self._forget_task(m.name, seed["n"], m.ranks)
            got = done[0]["in"]
            m.version, m.mixed = done[0]["version"], any(d["mixed"] for d in done)
            newest = m.version == self.version and self.inflight is None
            if got["agreed"] and newest and not m.mixed:
                m.state = "ready"
                self.post(b, m.name, {"kind": "ready", "version": m.version})
                self.seeds.append((m.name, seed["src"], m.version, time.monotonic() - seed["t0"]))
                del self.seeds[:-1000]  # a bounded record
                _log.info("fleet: %s seeded by %s at version %d: ready", m.name, seed["src"], m.version)
            else:
                m.state = "joined"  # seeded again: from a peer at the newest version
                if not got["agreed"]:
                    self._bump(seed["src"], m.name)
                _log.info("fleet: seeding %s from %s ended at version %d (fleet at %d): %s", m.name,
                          seed["src"], m.version, self.version, got["error"] or "newer version since")

    def _forget_task(self, job: str, n: int, ranks: int) -> None:
        """Delete a finished task's keys (every rank of the job has read and answered it), so
        the store holds a bounded number of keys however long the fleet runs. The watcher
        deletes them, off the update's path."""
        parts = self.members[job].parts if job in self.members else 0
        self._trash += [f"task/{job}/{n}", f"got/{job}/{n}", f"agreed/{job}/{n}"]
        self._trash += [f"done/{job}/{n}/{r}" for r in range(ranks)]
        self._trash += [f"held/{job}/{n}/{p}" for p in range(parts)]  # a relay's count per part

    def _forget_words(self, word: str, dst: str) -> None:
        """Delete an edge's words (one per part) once both ends answered."""
        self._trash += [f"edge/{word}/{p}" for p in range(self.members[dst].parts)]

    def _bump(self, src: str, dst: str) -> None:
        self._gen[(src, dst)] = self._gen.get((src, dst), 0) + 1

    # ----------------------------------------------------------------- update
    def update(self, version: int, run_own: Callable[[dict], dict]) -> FleetReport:
        """Feed every replica that has joined to ``version`` (see the module docstring);
        ``run_own(task)`` runs the trainer's part of a round on this rank."""
        t0 = time.monotonic()
        with self._lock:
            self.inflight = version
            targets = [m.name for m in sorted(self.members.values(), key=lambda m: (m.state != "ready", m.order))
                       if m.state in ("ready", "joined", "waiting")]
        outcomes: dict[str, ReplicaOutcome] = {}
        egress, rounds, sources, pending = 0, 0, [TRAINER], targets
        while pending and rounds < MAX_ROUNDS:
            rounds += 1
            with self._lock:
                pending = [t for t in pending if self.members[t].state != "dropped"]
                edges = (relay_edges(sources, pending, self.fanout) if self.relay else
                         [Edge(sources[0], t) for t in pending])
                posted, words, tasks = self._post_edges(self.board, edges, "update", version)
                self._collecting = dict(posted)
                for e in edges:
                    if e.src != TRAINER and self.members[e.src].state == "dropped":
                        self._skip(self.board, words[e.dst], self.members[e.dst].parts, f"{e.src} was dropped")
            if TRAINER in posted:
                run_own(tasks[f"task/{TRAINER}/{posted[TRAINER]}"])
            # every edge of the tree may take the timeout, one after another along a chain
            results = self._collect(posted, time.monotonic() + self.timeout * (len(edges) + 2)
                                    + self.drop_after)
            egress += sum(o["bytes"] for d in results.get(TRAINER) or () for o in d["outs"].values())
            with self._lock:
                self._collecting = {}
                pending = self._settle(edges, results, version, t0, outcomes, words)
                for job, n in posted.items():
                    if results.get(job) is not None:
                        self._forget_task(job, n, self._world(job))
                for dst, word in words.items():
                    self._forget_words(word, dst)
                holders = [m.holding() for m in sorted(self.members.values(), key=lambda m: m.order)
                           if m.state != "dropped"]
                sources = refeed_sources(holders, version)
        return self._finish(version, t0, egress, rounds, pending, outcomes)

    def _collect(self, posted: dict[str, int], until: float) -> dict[str, list | None]:
        """Every posted job's per-rank results; None for a job dropped before it finished.
        Blocks in the store until every result is there: a drop wakes it (``drop`` fills the
        dropped job's results with null); at ``until`` the jobs still out are dropped."""
        keys = {job: [f"done/{job}/{n}/{r}" for r in range(self._world(job))] for job, n in posted.items()}
        got = self.board.wait_for([k for ks in keys.values() for k in ks], until)
        out: dict[str, list | None] = {}
        with self._lock:
            for job, ks in keys.items():
                values = [self.board.get(k) for k in ks] if got is None else [got.pop(0) for _ in ks]
                if job != TRAINER and self.members[job].state == "dropped":
                    out[job] = None
                elif all(v is not None for v in values):
                    out[job] = values
                elif job != TRAINER:
                    self.drop(self.board, job, "timed out: no result within the update's deadline")
                    out[job] = None
                else:
                    _log.error("fleet: a trainer rank gave no result for its part of the update")
                    out[job] = []
        return out

    def _settle(self, edges: list[Edge], results: dict, version: int, t0: float,
                outcomes: dict[str, ReplicaOutcome], words: dict[str, str]) -> list[str]:
        """Record each target's outcome; the orphans (alive, not fed) to feed again."""
        orphans = []
        for e in edges:
            self._open.pop(words[e.dst], None)
            m, got = self.members[e.dst], results.get(e.dst)
            if got is None or m.state == "dropped":
                continue
            inn = [d["in"] for d in got]
            m.version, m.mixed = got[0]["version"], any(d["mixed"] for d in got)
            if all(i["agreed"] for i in inn):
                outcomes[e.dst] = ReplicaOutcome(e.dst, version, False, sum(i["bytes"] for i in inn),
                                                 time.monotonic() - t0, e.src)
                if m.state != "ready":
                    m.state = "ready"
                    self.post(self.board, m.name, {"kind": "ready", "version": version})
            else:
                self._bump(e.src, e.dst)
                orphans.append(e.dst)
                outcomes[e.dst] = ReplicaOutcome(e.dst, m.version, m.mixed, 0, time.monotonic() - t0,
                                                 e.src, "")
                m.reason = next((i["error"] for i in inn if i["error"]), "")
        return orphans

    def _finish(self, version: int, t0: float, egress: int, rounds: int, pending: list[str],
                outcomes: dict[str, ReplicaOutcome]) -> FleetReport:
        with self._lock:
            for name in pending:
                self.drop(self.board, name, f"not fed version {version} within {MAX_ROUNDS} rounds: "
                                            f"{self.members[name].reason}")
            for m in self.members.values():
                if m.state == "dropped" and not m.reported:
                    m.reported = True
                    outcomes[m.name] = ReplicaOutcome(m.name, m.version, m.mixed, 0,
                                                      time.monotonic() - t0, "", m.reason)
            self.members = {k: m for k, m in self.members.items() if not m.reported}
            self.version = version
            self.inflight = None
            report = FleetReport(version, time.monotonic() - t0, egress, rounds,
                                 tuple(outcomes[k] for k in sorted(outcomes)))
            if self.trainer_ranks > 1:  # the others' last task of this update
                self.post(self.board, TRAINER, {"kind": "end", "version": version, "report": _encode(report)})
        return report

    def table(self) -> list[MemberState]:
        with self._lock:
            return [m.public() for m in sorted(self.members.values(), key=lambda m: m.order)]

    def close(self, wait: float = 5.0) -> None:
        """Tell every replica to stop, and wait (up to ``wait`` seconds) until they have read
        it: the store this rank hosts goes with it."""
        with self._lock:
            live = [m for m in self.members.values() if m.state != "dropped"]
            for m in live:
                self.post(self.board, m.name, {"kind": "stop", "why": "the fleet closed"})
        self._stop.set()
        self._thread.join(timeout=5)
        until = time.monotonic() + wait
        for m in live:
            for r in range(m.ranks):
                self.board.wait(f"bye/{m.name}/{r}", until)


def _encode(report: FleetReport) -> dict:
    return {"version": report.version, "seconds": report.seconds, "egress": report.trainer_bytes_sent,
            "rounds": report.rounds, "replicas": [list(r.__dict__.values()) for r in report.replicas]}


def decode(d: dict) -> FleetReport:
    return FleetReport(d["version"], d["seconds"], d["egress"], d["rounds"],
                       tuple(ReplicaOutcome(*r) for r in d["replicas"]))
