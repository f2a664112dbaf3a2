"""``Fleet``: the trainer's side of a fleet of engine replicas that come and go.

Every trainer rank builds one ``Fleet`` and calls ``update()`` at the same points of
training (after an optimizer step), like ``Refitter.refit``. The trainer's rank 0 hosts the
fleet's store and coordinates (``coordinator``); the other ranks follow its tasks through
the store, so neither the trainer's process group nor its training is touched, and no
barrier spans the replicas: each update feeds the replicas joined by then, each over a
group of its own edge.
"""

from __future__ import annotations

import logging
import time

from ..plan.cache import PlanCache
from .board import Board, open_store
from .coordinator import Coordinator, decode
from .links import Links, Sides
from .relay import TRAINER
from .report import FleetReport, MemberState
from .secret import read_secret
from .worker import Worker

__all__ = ["Fleet"]

_log = logging.getLogger("torchrefit.fleet")


class Fleet:
    """The trainer's fleet, on one trainer rank.

    Args:
        model: this rank's trainer model (what a ``Refitter`` takes as ``src_model``).
        rank / world_size: this rank's place in the trainer job.
        address / port: where the trainer's rank 0 hosts the fleet's store; replicas join there.
        secret / secret_file: the fleet's shared secret (else ``settings.fleet_secret``,
            environment ``TORCHREFIT_FLEET_SECRET``); required, never a default.
        timeout: seconds any one transfer, group rendezvous or agreement may wait for a peer.
        drop_after: seconds without a heartbeat after which a replica is dropped.
        join_timeout: seconds an admitted replica has to start all its ranks.
        fanout: each replica feeds up to this many others (1: a chain).
        chunks: each update moves in this many parts, pipelined along the relay: a replica
            forwards one part while it receives the next (1: store-and-forward).
        refitter_args: more ``Refitter`` keyword arguments for every edge (``name_map``,
            ``src_layout``, ``cast``...), alike on every rank of the fleet.
    """

    def __init__(self, model, rank: int, world_size: int, address: str, port: int, *,
                 secret: bytes | str | None = None, secret_file: str | None = None,
                 timeout: float = 60.0, drop_after: float = 3.0, join_timeout: float = 60.0,
                 fanout: int = 1, chunks: int = 4, refitter_args: dict | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"Fleet: rank {rank} is outside a trainer job of {world_size} ranks")
        self.key = read_secret(secret, secret_file, "Fleet")
        self.rank, self.world = rank, world_size
        self.version = 0
        self.coordinator = None
        if rank == 0:
            self.coordinator = Coordinator(address, port, self.key, world_size, timeout, drop_after,
                                           join_timeout, fanout, chunks=chunks)
            store = self.coordinator.store
        else:
            store = open_store(address, port, False, timeout)
        self.board = Board(store)
        salt = self.board.wait("salt", time.monotonic() + timeout)
        if salt is None:
            raise TimeoutError(f"Fleet rank {rank}: no fleet store at {address}:{port} within {timeout:g} s")
        self._tasks = 0
        links = Links(store, self.key, salt, TRAINER, rank, world_size, Sides(model, dict(refitter_args or {})),
                      timeout)
        self._worker = Worker(self.board, links, TRAINER, rank, world_size, timeout)
        self.last: FleetReport | None = None

    def update(self, version: int | None = None) -> FleetReport:
        """Feed every replica joined by now the trainer's current weights as ``version``
        (default: one more than the last). Called on every trainer rank. Never raises for a
        replica: one that dies, is lost or times out is dropped and named in the report."""
        version = self.version + 1 if version is None else int(version)
        if version <= self.version:
            raise ValueError(f"Fleet.update: version {version} is not newer than {self.version}")
        if self.coordinator is not None:
            report = self.coordinator.update(version, self._run_own)
        else:
            report = self._follow()
        self.version, self.last = version, report
        return report

    def _run_own(self, task: dict) -> dict:
        self._tasks = task["n"] + 1
        return self._worker.run(task)

    def _follow(self) -> FleetReport:
        """Ranks other than 0: run the trainer's tasks of this update until its end."""
        while True:
            key = f"task/{TRAINER}/{self._tasks}"
            task = self.board.wait_for(key)  # blocks in the store until rank 0 posts it
            self._tasks += 1
            if task["kind"] == "end":
                if self.board.add(f"read/{key}", 1) == self.world - 1:  # the last reader
                    self.board.delete(key)
                    self.board.delete(f"read/{key}")
                return decode(task["report"])
            self._worker.run(task)

    @property
    def plans(self) -> PlanCache:
        """This rank's plans: ``built`` (how many it made), ``reused`` (parts of new edges
        that took a plan made for the same layouts before)."""
        return self._worker.links.plans

    def replicas(self) -> list[MemberState]:
        """Every replica the fleet knows now, with its version (rank 0; elsewhere, those of
        the last update's report)."""
        if self.coordinator is not None:
            return self.coordinator.table()
        return [MemberState(r.name, 0, "dropped" if r.dropped else "ready", r.version, r.mixed, r.dropped)
                for r in (self.last.replicas if self.last else ())]

    def close(self) -> None:
        self._worker.links.close()
        if self.coordinator is not None:
            self.coordinator.close()
