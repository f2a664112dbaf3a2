"""Run a function on N real processes joined by a gloo (or NCCL) process group.

``run_world(fn, n, *args)`` starts ``n`` processes, initializes
``torch.distributed`` in each, calls ``fn(rank, world, *args)`` and returns the
results by rank. A rank that raises or a world that does not finish within
``timeout`` seconds raises :class:`WorldError` with every rank's traceback, and
all processes are killed: a test can fail, but never hang.

Processes come from :func:`context`: without a GPU, a fork server that imported torch and
torchrefit once, so a new rank starts in milliseconds instead of importing them again (about 3 s
of CPU each on a small machine, which a suite of many small worlds mostly spent on
imports). Each rank is still a fresh process that runs nothing of its parent's state
but its arguments, like a spawned one, and takes its parent's environment as it was
when the rank started (:func:`_child` applies it: the fork server's own environment
is the one it started with).
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_world", "WorldError", "context"]

#: what the fork server imports once, so that no rank imports it again
_PRELOAD = ["torch", "torch.distributed", "torchrefit"]


def context():
    """The multiprocessing context ranks start from: a fork server with torch and
    torchrefit imported; ``spawn`` where the platform has no fork server, and where a GPU
    is present (a rank forked from a process that asked the CUDA driver anything may find
    CUDA unusable: spawned ranks are what the GPU tests run on)."""
    if "forkserver" not in mp.get_all_start_methods() or torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class WorldError(RuntimeError):
    """A rank of a spawned world failed or the world timed out."""


def _child(fn, rank, world, init, backend, pg_timeout, args, out, env=None) -> None:
    if env is not None:  # the parent's environment now, not the fork server's at its start
        os.environ.clear()
        os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        if backend == "gloo":
            # gloo's full mesh can complete on one rank before another: a rank that
            # returns at once (a test's absent peer) and closes its group would break
            # a slower rank's connecting ("Connection closed by peer")
            dist.barrier()
        result = fn(rank, world, *args)
        out.put((rank, True, result))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_world(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    pg_timeout: float = 60.0,
    may_die: Sequence[int] = (),
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``nprocs`` processes; return results by rank.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function).
    ``pg_timeout`` bounds every collective, so a rank left waiting fails instead
    of hanging. Ranks in ``may_die`` may exit without a result (fault tests kill
    them on purpose): their result is None.
    """
    ctx = context()
    out = ctx.Queue()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        procs = [ctx.Process(target=_child, args=(fn, r, nprocs, init, backend, pg_timeout, args, out, env),
                             daemon=True) for r in range(nprocs)]
        for p in procs:
            p.start()
        results: dict[int, tuple[bool, Any]] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        try:
            while len(results) < nprocs:
                left = (deadline - datetime.datetime.now()).total_seconds()
                if left <= 0:
                    break
                try:
                    rank, ok, value = out.get(timeout=min(left, 1.0))
                    results[rank] = (ok, value)
                except queue.Empty:
                    if all(not p.is_alive() for p in procs) and out.empty():
                        break
        finally:
            for p in procs:
                p.join(timeout=5 if len(results) == nprocs else 0.1)
                if p.is_alive():
                    p.kill()
    failed = {r: v for r, (ok, v) in results.items() if not ok}
    missing = [r for r in range(nprocs) if r not in results and r not in may_die]
    if failed or missing:
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items())]
        if missing:
            parts.append(f"ranks {missing} did not finish within {timeout:.0f} s")
        raise WorldError("\n".join(parts))
    return [results[r][1] if r in results else None for r in range(nprocs)]
