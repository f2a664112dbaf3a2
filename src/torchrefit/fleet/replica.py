"""``join``: an engine replica's side of a fleet.

Every rank of a replica job calls ``join`` (its own job: its own layout, size and process
count, its own default process group). Rank 0 asks the fleet for admission with a proof
of the shared secret; once admitted, every rank beats a heartbeat and runs the fleet's
tasks on a thread of its own (receive a version, relay it on, seed a newcomer), while
the engine serves. ``Replica.wait_ready()`` returns once the replica holds the fleet's
current version whole; ``replica.lock`` is held while a staged version is committed into
the live weights: an engine that holds it around each forward pass never runs on half a
commit.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from .board import Board, open_store
from .links import Links, Sides
from .secret import check, prove, read_secret
from .worker import Whole, Worker

__all__ = ["join", "Replica", "JoinRefused"]

_log = logging.getLogger("torchrefit.fleet")
_BEAT = 0.25  # seconds between two heartbeats


class JoinRefused(RuntimeError):
    """The fleet refused this replica (its reason is the message), or never answered."""


class Replica:
    """One rank of a replica in the fleet (``join`` returns it)."""

    def __init__(self, name: str, rank: int, world: int, model, board: Board, key: bytes,
                 salt: str, address: str, port: int, timeout: float, staged: bool,
                 on_version: Callable[[int], None] | None, sides: Sides) -> None:
        self.name, self.rank, self.world, self.staged = name, rank, world, staged
        self.model, self.board, self.timeout = model, board, timeout
        self.whole = Whole()
        self.ready = threading.Event()
        self.dropped = ""  # why the fleet dropped this replica, once it did
        self._stop = threading.Event()
        self._hb_board = Board(open_store(address, port, False, timeout))
        links = Links(board.store, key, salt, name, rank, world, sides, timeout)
        self._worker = Worker(board, links, name, rank, world, timeout, self.whole, on_version,
                              self._stop.is_set)
        self._beat = threading.Thread(target=self._beating, name=f"fleet-beat-{name}", daemon=True)
        self._serve = threading.Thread(target=self._serving, name=f"fleet-{name}", daemon=True)
        self._beat.start()
        board.put(f"armed/{name}/{rank}", True)
        self._serve.start()

    @property
    def lock(self) -> threading.Lock:
        return self.whole.lock

    @property
    def version(self) -> int:
        """The version of this replica's live weights (see ``mixed``)."""
        return self.whole.version

    @property
    def mixed(self) -> bool:
        """The live weights are a mix of two versions (unstaged, cut mid-update)."""
        return self.whole.mixed

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until this replica holds the fleet's current version whole; False at
        ``timeout`` or once dropped."""
        until = None if timeout is None else time.monotonic() + timeout
        while not self.ready.wait(0.05):
            if self.dropped or self._stop.is_set() or (until is not None and time.monotonic() >= until):
                return False
        return True

    def _beating(self) -> None:
        while not self._stop.wait(_BEAT):
            try:
                self._hb_board.add(f"hb/{self.name}/{self.rank}", 1)
            except Exception:  # the fleet's store is gone: the trainer ended
                self._stop.set()

    def _serving(self) -> None:
        n = 0
        try:
            while not self._stop.is_set():
                # blocks in the store until the task is posted: a close() is answered by the
                # fleet's stop task (it sees "left"); a lost store raises
                task = self.board.wait_for(f"task/{self.name}/{n}", stop=self._stop.is_set)
                if task is None or (self._stop.is_set() and task["kind"] != "stop"):
                    break
                n += 1
                if task["kind"] == "stop":
                    self.dropped = task["why"]
                    _log.warning("fleet: %s rank %d told to stop: %s", self.name, self.rank, task["why"])
                    self.board.put(f"bye/{self.name}/{self.rank}", True)
                    break
                if task["kind"] == "ready":
                    self.ready.set()
                    continue
                self._worker.run(task)
        except Exception as e:  # the store went away (the trainer ended) or a bug: stop serving
            if not self._stop.is_set():
                _log.warning("fleet: %s rank %d stopped: %s: %s", self.name, self.rank, type(e).__name__, e)
                self.dropped = self.dropped or f"{type(e).__name__}: {e}"
        finally:
            self._stop.set()
            self._worker.links.close()

    def close(self) -> None:
        """Leave the fleet: stop beating and serving (the fleet drops this replica)."""
        if not self._stop.is_set():
            try:  # not over self.board: the fleet thread may be blocked on it
                self._hb_board.put(f"left/{self.name}", True)
            except Exception:
                pass
        self._stop.set()
        self._serve.join(timeout=self.timeout)
        self._beat.join(timeout=5)


def join(model, rank: int, world_size: int, address: str, port: int, *, name: str | None = None,
         secret: bytes | str | None = None, secret_file: str | None = None, staged: bool = True,
         timeout: float = 60.0, on_version: Callable[[int], None] | None = None,
         refitter_args: dict | None = None) -> Replica:
    """Join the fleet at ``address:port`` with this rank's ``model`` (every rank of the
    replica job calls it, after initializing the job's own default process group, as a
    ``torchrun`` job does; a one-process job initializes a group of one). ``name`` (default ``replica``) gets a random suffix, so a restart is
    a new member. ``staged=True`` receives each version into staging and commits it under
    ``replica.lock`` once every rank has it (never a mix); ``False`` writes live weights
    directly (a cut update leaves the replica marked mixed until its next complete one).
    ``on_version(v)`` is called on the fleet's thread after each version is installed.
    Returns once admitted; ``wait_ready()`` waits for the current version. Raises
    :class:`JoinRefused` where the fleet refuses (e.g. a wrong secret) or never answers."""
    key = read_secret(secret, secret_file, "join")
    full = _agreed_name(name or "replica", rank, world_size)
    board = Board(open_store(address, port, False, timeout))
    until = time.monotonic() + timeout
    salt = board.wait("salt", until)
    if salt is None:
        raise JoinRefused(f"join {full}: no fleet at {address}:{port} within {timeout:g} s")
    sides = Sides.replica(model, staged, int(board.wait("chunks", until) or 1), refitter_args)
    if rank == 0:
        board.put(f"join/{full}", {"ranks": world_size, "staged": staged, "host": socket.gethostname(),
                                   "parts": len(sides.parts),
                                   "pid": os.getpid(), "proof": prove(key, "join", salt, full, str(world_size))})
        board.put(f"joins/{board.add('joins', 1)}", full)
    answer = board.wait(f"admit/{full}", until)
    if answer is None:
        raise JoinRefused(f"join {full}: the fleet at {address}:{port} did not answer within {timeout:g} s")
    if not answer["ok"]:
        raise JoinRefused(f"join {full}: refused by the fleet: {answer['why']}")
    if not check(key, answer.get("proof", ""), "admit", salt, full):
        raise JoinRefused(f"join {full}: the fleet at {address}:{port} did not prove it holds the secret")
    return Replica(full, rank, world_size, model, board, key, salt, address, port, timeout, staged,
                   on_version, sides)


def _agreed_name(name: str, rank: int, world: int) -> str:
    """``name`` plus a random suffix rank 0 draws, the same on every rank of the job."""
    suffix = [secrets.token_hex(4)]
    if world > 1:
        if not dist.is_initialized():
            raise RuntimeError("join: a replica of several ranks needs its job's default process group")
        dist.broadcast_object_list(suffix, src=0)
    return f"{name}-{suffix[0]}"
