"""The fleet's store: one ``TCPStore`` the trainer's rank 0 hosts, read and written as
JSON values under ``fleet/`` keys. It carries membership, tasks, results and heartbeats,
never weights (those go through per-edge groups, see ``links``).

Keys (``<job>`` is a replica's name or ``trainer``; ``<n>`` a task number; ``<p>`` a part):

===============================  ======================================================
``fleet/salt``                   the fleet's random salt (proofs are made over it)
``fleet/joins``                  how many join requests came; ``fleet/joins/<k>``: the k-th's name
``fleet/join/<name>``            a join request: ranks, host, staging, proof
``fleet/admit/<name>``           the answer: admitted (with the trainer's proof) or refused
``fleet/armed/<name>/<r>``       rank r of an admitted replica is beating and takes tasks
``fleet/hb/<name>/<r>``          rank r's heartbeat counter
``fleet/left/<name>``            the replica closed itself
``fleet/task/<job>/<n>``         the job's n-th task (its ranks run tasks in order)
``fleet/done/<job>/<n>/<r>``     rank r's result of that task (``null``: the job was dropped)
``fleet/held/<job>/<n>/<p>``     how many ranks of a relay received part p (a counter)
``fleet/got/<job>/<n>``          how many ranks received every part of the task's edge
``fleet/agreed/<job>/<n>``       whether every rank did: the first word written holds
``fleet/edge/<word>/<p>``        the sender's word on part p of an edge: go (with the
                                 version) or skip (with why); the first word holds, but a
                                 skip of the whole edge (its sender dropped or failed)
                                 overwrites every part's
===============================  ======================================================

Waits on the path of an update block in the store (``wait_for``: woken the moment the key
is set, no polling); each thread that blocks has a client of its own (``for_thread``),
since a client serves one call at a time.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

import torch.distributed as dist

__all__ = ["Board", "open_store", "SHORT", "LONG"]

_MAX_PAUSE = 0.02  # seconds between two looks at a key being waited for (off an update's path)
SHORT = 0.002  # the same where a poll remains inside an update
LONG = 3600.0  # seconds one blocking wait lasts at most before it looks at its stop() again


def open_store(address: str, port: int, host: bool, timeout: float) -> dist.TCPStore:
    """The fleet's store: hosted here (trainer rank 0) or a client of it."""
    return dist.TCPStore(address, port, None, is_master=host,
                         timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False,
                         use_libuv=True)


class Board:
    """JSON values over one store client (one per thread that uses it)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def put(self, key: str, value: Any) -> None:
        self.store.set(f"fleet/{key}", json.dumps(value))

    def put_many(self, items: dict[str, Any]) -> dict[str, Any]:
        """Set every key of ``items`` (in one store call where the store has ``multi_set``).
        Returns the values as :meth:`get` reads them back (JSON's types: lists, string keys)."""
        keys, values = [f"fleet/{k}" for k in items], [json.dumps(v) for v in items.values()]
        if hasattr(self.store, "multi_set"):
            self.store.multi_set(keys, values)
        else:
            for k, v in zip(keys, values):
                self.store.set(k, v)
        return {k: json.loads(v) for k, v in zip(items, values)}

    def put_once(self, key: str, value: Any) -> Any:
        """Set ``key`` unless it is set; returns the value it holds after (the first wins)."""
        got = self.store.compare_set(f"fleet/{key}", "", json.dumps(value))
        return json.loads(got)

    def has(self, key: str) -> bool:
        return self.store.check([f"fleet/{key}"])

    def get(self, key: str) -> Any:
        """The value, or None where the key is not set."""
        if not self.has(key):
            return None
        return json.loads(self.store.get(f"fleet/{key}"))

    def delete(self, key: str) -> None:
        self.store.delete_key(f"fleet/{key}")

    def add(self, key: str, n: int) -> int:
        return self.store.add(f"fleet/{key}", n)

    def wait(self, key: str, until: float | None = None, stop=lambda: False,
             most: float = _MAX_PAUSE) -> Any:
        """Poll until ``key`` is set, ``until`` (monotonic time) passes or ``stop()`` says
        so; the value, or None (1 ms at first, backing off to ``most`` seconds). For waits
        off an update's path (admission, closing), on a client other threads may share."""
        full, pause = f"fleet/{key}", 0.001
        while True:
            if self.store.check([full]):
                return json.loads(self.store.get(full))
            if stop() or (until is not None and time.monotonic() >= until):
                return None
            time.sleep(pause)
            pause = min(2 * pause, most)

    def wait_for(self, keys: str | list[str], until: float | None = None, stop=lambda: False,
                 slice_s: float = LONG) -> Any:
        """Block in the store until every one of ``keys`` is set: their values (one key: its
        value), or None once ``until`` passed or ``stop()`` says so. Woken the moment the
        last is set; ``stop`` is looked at every ``slice_s`` seconds (a store wait that times
        out logs a warning, so the slices are long: what ends a wait early is a key someone
        sets, such as a skip word or a stop task). Blocks this client: one per thread."""
        one = isinstance(keys, str)
        full = [f"fleet/{k}" for k in ([keys] if one else keys)]
        while True:
            left = slice_s if until is None else min(slice_s, until - time.monotonic())
            if left <= 0 or stop():
                return None
            t0 = time.monotonic()
            try:
                self.store.wait(full, datetime.timedelta(seconds=left))
            except dist.DistStoreError:  # the slice ran out (a lost store raises DistNetworkError)
                if time.monotonic() - t0 < 0.5 * left:
                    raise
                continue
            got = self.store.multi_get(full) if hasattr(self.store, "multi_get") else [self.store.get(k) for k in full]
            values = [json.loads(v) for v in got]
            return values[0] if one else values

    def for_thread(self) -> Board:
        """A Board over a new client of the same store, for another thread that blocks."""
        s = self.store
        if hasattr(s, "clone"):
            return Board(s.clone())
        return Board(dist.TCPStore(s.host, s.port, None, is_master=False, timeout=s.timeout, use_libuv=True))
