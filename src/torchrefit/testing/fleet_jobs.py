"""Jobs that come and go, for fleet tests and benchmarks.

``Job(fn, nprocs, *args)`` starts one job: ``nprocs`` spawned processes with their own
default process group on their own master port (as a ``torchrun`` launch has), each calling
``fn(rank, nprocs, *args)``. ``kill()`` SIGKILLs every process of it (a lost host);
``results(timeout)`` collects what each rank returned (a traceback string for a rank that
raised; None for one that never answered), killing whatever is still running at the end,
so a test can fail but never hang.
"""

from __future__ import annotations

import datetime
import os
import queue
import signal
import time
from collections.abc import Callable
from typing import Any

from .jobs import free_ports
from .processes import _child, context

__all__ = ["Job"]


def _job_child(rank, fn, world, init, pg_timeout, args, out, env) -> None:
    _child(fn, rank, world, init, "gloo", pg_timeout, args, out, env)


class Job:
    """One job of ``nprocs`` processes running ``fn`` (see the module docstring)."""

    def __init__(self, fn: Callable[..., Any], nprocs: int, *args: Any, pg_timeout: float = 60.0) -> None:
        ctx = context()
        self.out = ctx.Queue()
        init = f"tcp://127.0.0.1:{free_ports(1)[0]}"
        self.nprocs = nprocs
        self.procs = [ctx.Process(target=_job_child, args=(r, fn, nprocs, init, pg_timeout, args, self.out,
                                                               dict(os.environ)),
                                  daemon=True) for r in range(nprocs)]
        for p in self.procs:
            p.start()
        self.started = time.monotonic()
        self._got: dict[int, tuple[bool, Any]] = {}

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self) -> bool:
        return any(p.is_alive() for p in self.procs)

    def finished(self) -> bool:
        """Every rank has answered (or none is left running); does not block."""
        try:
            while True:
                rank, ok, value = self.out.get_nowait()
                self._got[rank] = (ok, value)
        except queue.Empty:
            pass
        return len(self._got) == self.nprocs or not self.alive()

    def kill(self) -> None:
        """SIGKILL every process of the job, now."""
        for p in self.procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.join(timeout=5)

    def results(self, timeout: float) -> list[tuple[bool, Any] | None]:
        """Each rank's ``(ok, value)`` (None where it gave none within ``timeout``)."""
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        try:
            while len(self._got) < self.nprocs and datetime.datetime.now() < deadline:
                try:
                    rank, ok, value = self.out.get(timeout=0.2)
                    self._got[rank] = (ok, value)
                except queue.Empty:
                    if not self.alive():
                        try:
                            while True:
                                rank, ok, value = self.out.get(timeout=0.5)
                                self._got[rank] = (ok, value)
                        except queue.Empty:
                            break
        finally:
            for p in self.procs:
                p.join(timeout=5 if len(self._got) == self.nprocs else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        return [self._got.get(r) for r in range(self.nprocs)]
