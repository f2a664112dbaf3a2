"""The trainer-engine link an engine backend builds on: rendezvous, agreement, round status.

Engine-agnostic; :mod:`torchrefit.engines.vllm` uses it on both sides.

* :func:`join`: the trainer's rank 0 hosts a small store on ``port`` where the engine
  publishes its number of ranks (the trainer need not be told), then every rank of
  both jobs calls :func:`torchrefit.connect` on ``port + 1``.
* :func:`agree`: every rank of both jobs gathers every rank's :class:`Terms` (and
  whatever else the backend shares once) and raises the same :class:`PlanError` on
  every rank where any two differ, naming the setting and who holds which value.
* :func:`agree_status`: after each update, every rank learns whether any rank failed
  (an exception in the engine's ``load_weights``, say) and raises it, wrapped, at once
  rather than by a timeout.
"""

from __future__ import annotations

import datetime
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..connect import Connection, connect
from ..errors import ConnectError, PlanError, RefitError, TransportError
from ..transport.collectives import all_gather_pickled

__all__ = ["Terms", "join", "agree", "agree_status", "failure"]

_ENGINES = "torchrefit/engine_world_size"


@dataclass(frozen=True)
class Terms:
    """What the two jobs' refits must agree on: the name map (its ``cache_key``, as
    text), the ``skip`` globs, the ``cast`` policy and whether updates are staged
    while the engine serves (``staged``: then both sides stage and commit)."""

    name_map: str
    skip: tuple[str, ...]
    cast: str | bool
    staged: bool = False


def join(role: str, rank: int, world_size: int, address: str, port: int, *,
         peer_world_size: int | None, backend: str,
         timeout: float) -> tuple[Connection, dist.TCPStore]:
    """Every rank of both jobs: learn the engine's size where not given, then connect.
    Returns the connection and the small store (keep it: trainer rank 0 hosts it)."""
    store = _discovery_store(role, rank, address, port, timeout)
    if role == "engine" and rank == 0:
        store.set(_ENGINES, str(world_size))
    if peer_world_size is None:
        try:
            peer_world_size = int(store.get(_ENGINES).decode())
        except Exception as e:
            raise ConnectError(
                f"{role} rank {rank}: the engine did not publish its size at {address}:{port} "
                f"within {timeout:g} s (did init_weight_transfer_engine reach the engine?): "
                f"{type(e).__name__}: {e}") from e
    return connect(role, rank, world_size, peer_world_size, address, port + 1, backend,
                   timeout), store


def _discovery_store(role: str, rank: int, address: str, port: int,
                     timeout: float) -> dist.TCPStore:
    host = role == "trainer" and rank == 0
    try:
        return dist.TCPStore(address, port, None, is_master=host,
                             timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as e:
        raise ConnectError(f"{role} rank {rank}: no rendezvous store at {address}:{port} "
                           f"({'could not host it' if host else 'trainer rank 0 did not answer'} "
                           f"within {timeout:g} s): {type(e).__name__}: {e}") from e


def agree(conn: Connection, terms: Terms, extra: Any = None) -> list[tuple]:
    """Every rank's ``(role, rank, terms, extra)``; raises on every rank where the
    terms differ anywhere."""
    seen = all_gather_pickled((conn.role, conn.rank, terms, extra), conn.group, conn.timeout)
    for field in ("name_map", "skip", "cast", "staged"):
        values: dict[Any, list[str]] = {}
        for role, rank, theirs, _ in seen:
            values.setdefault(getattr(theirs, field), []).append(f"{role} rank {rank}")
        if len(values) > 1:
            told = "; ".join(f"{', '.join(who[:4])}: {value!r}" for value, who in values.items())
            raise PlanError(
                f"the trainer and the engine must refit with the same {field}, but they differ "
                f"({told}; seen by {conn.role} rank {conn.rank}): pass the same {field} on every "
                "trainer rank (the engine uses what trainer rank 0 sends at init)",
                rule=f"same {field}", ranks=_joint_ranks(seen, values))
    return seen


def _joint_ranks(seen: list[tuple], values: dict[Any, list[str]]) -> list[int]:
    minority = min(values.values(), key=len)
    return [i for i, (role, rank, _, _) in enumerate(seen) if f"{role} rank {rank}" in minority]


def failure(e: BaseException, where: str) -> tuple[str, str]:
    """What a rank reports of its own failure: (class name, one line + traceback)."""
    return (type(e).__name__,
            f"{where} raised {type(e).__name__}: {e}\n{''.join(traceback.format_exception(e))}")


def agree_status(conn: Connection, error: tuple[str, str] | None, what: str, *,
                 applied: bool = True) -> None:
    """Every rank learns every rank's status of ``what``; the same error everywhere.
    ``applied``: whether ``what`` writes the engine's weights (an update, not planning)."""
    try:
        seen = all_gather_pickled((conn.role, conn.rank, error), conn.group, conn.timeout)
    except TransportError as e:
        raise TransportError(f"{what}: {_missing(conn, what)}; {e}", rule="dead peer",
                             detail=error[1] if error else None) from e
    bad = [(role, rank, err) for role, rank, err in seen if err is not None]
    if not bad:
        return
    engines = any(role == "engine" for role, _, _ in bad)
    where = "; ".join(f"{role} rank {rank}: {err[1].splitlines()[0]}" for role, rank, err in bad[:3])
    whose = ("the engine's weights may be partly updated: send the next update in full"
             if engines and applied else "no weights were written")
    if conn.role == "trainer":
        whose += "; this trainer's model is unchanged"
    raise RefitError(f"{what} failed on {len(bad)} rank(s): {where} ({whose})",
                     ranks=[i for i, (_, _, err) in enumerate(seen) if err is not None],
                     rule="update failed",
                     detail="\n".join(f"{role} rank {rank}: {err[1]}" for role, rank, err in bad))


def _missing(conn: Connection, what: str) -> str:
    """After a status gather failed: which ranks of both jobs are gone. Every rank that
    is still alive reaches here within one timeout of the others and marks itself in
    the link's store; the ranks still unmarked after that are named. The store lives
    on trainer rank 0: if it is gone, that rank is the one named."""
    me = f"{conn.role} rank {conn.rank}"
    everyone = ([f"trainer rank {r}" for r in range(_size(conn, "trainer"))]
                + [f"engine rank {r}" for r in range(_size(conn, "engine"))])
    keys = {who: f"torchrefit/alive/{what}/{who}" for who in everyone}
    try:
        conn.store.set(keys[me], "1")
        deadline = time.monotonic() + conn.timeout
        while True:
            gone = [who for who, key in keys.items() if not conn.store.check([key])]
            if not gone or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    except Exception:  # the store's host is gone
        return "trainer rank 0 (it hosts the link's store) died or stopped, seen by " + me
    if not gone:
        return f"every rank reached it, yet the gather failed (seen by {me})"
    return f"{', '.join(gone)} died or stopped (not seen within {conn.timeout:g} s by {me})"


def _size(conn: Connection, role: str) -> int:
    return conn.world_size if conn.role == role else conn.peer_world_size
