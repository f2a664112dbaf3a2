"""Run a trainer job and an engine job as two independently launched worlds.

``run_jobs(trainer_fn, n, engine_fn, m, *args)`` starts two worlds with two separate
``torch.multiprocessing.start_processes`` calls, each with its own default process
group on its own master port (as two ``torchrun`` launches would have), and calls
``trainer_fn(rank, n, port, *args)`` / ``engine_fn(rank, m, port, *args)`` in them,
``port`` being a free port for ``tr.connect``. Returns ``(trainer results, engine
results)`` by rank; a rank that raises, or jobs that do not finish within ``timeout``,
raise :class:`~torchrefit.testing.WorldError` with the tracebacks, and every process
is killed: a test can fail, but never hang.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from .processes import WorldError, _child, context

__all__ = ["run_jobs", "free_port", "free_ports"]


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports nothing listens on now: all bound at once, so the OS
    cannot hand the same one out twice (one picked and closed, then picked again for
    another store, failed CI's jobs test with EADDRINUSE)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _job_child(rank, fn, world, init, pg_timeout, args, out, env) -> None:
    _child(fn, rank, world, init, "gloo", pg_timeout, args, out, env)


def _start(fn, nprocs: int, port: int, init_port: int, args: tuple, pg_timeout: float):
    ctx = context()
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{init_port}"  # this job's own master port
    procs = mp.start_processes(_job_child, args=(fn, nprocs, init, pg_timeout, (port, *args), out,
                                                 dict(os.environ)),
                               nprocs=nprocs, join=False, daemon=True, start_method=ctx.get_start_method())
    return procs, out


def run_jobs(
    trainer_fn: Callable[..., Any],
    trainers: int,
    engine_fn: Callable[..., Any],
    engines: int,
    *args: Any,
    timeout: float = 300.0,
    pg_timeout: float = 60.0,
) -> tuple[list[Any], list[Any]]:
    """Run both jobs to completion; their results by rank (see the module docstring)."""
    port, trainer_init, engine_init = free_ports(3)
    jobs = {"trainer": _start(trainer_fn, trainers, port, trainer_init, args, pg_timeout),
            "engine": _start(engine_fn, engines, port, engine_init, args, pg_timeout)}
    sizes = {"trainer": trainers, "engine": engines}
    results: dict[str, dict[int, tuple[bool, Any]]] = {"trainer": {}, "engine": {}}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while any(len(results[j]) < sizes[j] for j in jobs):
            if (deadline - datetime.datetime.now()).total_seconds() <= 0:
                break
            got = False
            for job, (_, out) in jobs.items():
                try:
                    rank, ok, value = out.get(timeout=0.2)
                    results[job][rank] = (ok, value)
                    got = True
                except queue.Empty:
                    pass
            if not got and all(not p.is_alive() for ctx, _ in jobs.values() for p in ctx.processes):
                break
    finally:
        done = all(len(results[j]) == sizes[j] for j in jobs)
        for ctx, _ in jobs.values():
            for p in ctx.processes:
                p.join(timeout=5 if done else 0.1)
                if p.is_alive():
                    p.kill()
    return _collect(results, sizes, timeout)


def _collect(results, sizes, timeout) -> tuple[list[Any], list[Any]]:
    parts = []
    for job in ("trainer", "engine"):
        for r in range(sizes[job]):
            if r not in results[job]:
                parts.append(f"{job} rank {r} did not finish within {timeout:.0f} s")
            elif not results[job][r][0]:
                parts.append(f"--- {job} rank {r} ---\n{results[job][r][1]}")
    if parts:
        raise WorldError("\n".join(parts))
    return ([results["trainer"][r][1] for r in range(sizes["trainer"])],
            [results["engine"][r][1] for r in range(sizes["engine"])])
