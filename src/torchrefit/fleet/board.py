"""The fleet's store: one ``TCPStore`` the trainer's rank 0 hosts, read and written as
JSON values under ``fleet/`` keys. It carries membership, tasks, results and heartbeats,
never weights (those go through per-edge groups, see ``links``).

Keys (``<job>`` is a replica's name or ``trainer``; ``<n>`` a task number):

===========================  ======================================================
``fleet/salt``               the fleet's random salt (proofs are made over it)
``fleet/joins``              how many join requests came; ``fleet/joins/<k>``: the k-th's name
``fleet/join/<name>``        a join request: ranks, host, staging, proof
``fleet/admit/<name>``       the answer: admitted (with the trainer's proof) or refused
``fleet/armed/<name>/<r>``   rank r of an admitted replica is beating and takes tasks
``fleet/hb/<name>/<r>``      rank r's heartbeat counter
``fleet/left/<name>``        the replica closed itself
``fleet/task/<job>/<n>``     the job's n-th task (its ranks run tasks in order)
``fleet/done/<job>/<n>/<r>`` rank r's result of that task
``fleet/sib/<job>/<n>/<r>``  rank r received its part of the task's incoming edge
``fleet/edge/<tag>``         the sender's word on an edge: go (with the version) or skip
===========================  ======================================================
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

import torch.distributed as dist

__all__ = ["Board", "open_store", "SHORT"]

_MAX_PAUSE = 0.02  # seconds between two looks at a key being waited for, while idle
SHORT = 0.002  # the same inside an update, where each look's delay adds to its time


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
        """Block until ``key`` is set, ``until`` (monotonic time) passes or ``stop()`` says
        so; the value, or None. Polls (1 ms at first, backing off to ``most`` seconds): the
        store's own blocking wait logs a warning at every timeout, and this one must check
        ``stop``. Waits inside an update pass ``most=SHORT``: each is on the update's path."""
        full, pause = f"fleet/{key}", 0.001
        while True:
            if self.store.check([full]):
                return json.loads(self.store.get(full))
            if stop() or (until is not None and time.monotonic() >= until):
                return None
            time.sleep(pause)
            pause = min(2 * pause, most)
