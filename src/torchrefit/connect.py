"""Joining a separately launched trainer job and engine job: ``tr.connect``.

Each job keeps its own default process group (its own ``torchrun``); every rank
of both calls :func:`connect`, which builds a *joint* group over all of them
without touching either default group: trainer ranks first (joint ranks
``0 .. n-1``), engine ranks after them (``n .. n+m-1``). The rendezvous goes
through a ``TCPStore`` on ``address:port`` that the trainer's rank 0 hosts, in the
manner of SGLang's ``init_weights_update_group``:

1. every rank registers ``<role>/<rank>`` with what it was told (sizes, backend);
2. every rank waits until all ``n + m`` have registered, or until ``timeout``, then
   raises :class:`ConnectError` naming the ranks that never came (a rank that gives
   up marks the store, so late ranks fail at once instead of hanging);
3. every rank checks that both jobs agree on the sizes and the backend;
4. the joint group is built from the store (:func:`_build_joint_group`, at the end of
   this module).

The returned :class:`Connection` goes to ``Refitter(group=conn)`` or
``swap_model_weights(group=conn)``; it carries the joint group and the rank
offsets of the two sides (source ranks from 0, destination ranks from ``n``).
"""

from __future__ import annotations

import datetime
import itertools
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .errors import ConnectError

__all__ = ["connect", "Connection", "ROLES"]

ROLES = ("trainer", "engine")
_POLL = 0.05  # seconds between checks of who has registered
_ABORT = "torchrefit/aborted"  # why the first rank gave up; everyone raises it
_GAVE_UP = "torchrefit/gave_up"  # how many ranks have raised
_GRACE = 10.0  # at most, seconds the host keeps its store up for the others to read why


def connect(
    role: str,
    rank: int,
    world_size: int,
    peer_world_size: int,
    address: str,
    port: int = 29600,
    backend: str = "gloo",
    timeout: float = 60.0,
) -> Connection:
    """Join the trainer job and the engine job into one group. Called by every rank
    of both jobs, each with its own job's ``rank`` and ``world_size`` and the other
    job's ``peer_world_size``; blocks until all ``world_size + peer_world_size``
    ranks have joined.

    ``backend``: ``"gloo"`` (CPU tensors, or CUDA staged through the host) or
    ``"nccl"`` (CUDA; the joint group also gets a Gloo backend for the small
    metadata gathers and the IPC handshake). ``timeout`` (seconds) bounds the
    rendezvous and every later collective of the joint group: a missing peer raises
    :class:`ConnectError` (a ``TransportError``) naming it, within ``timeout`` plus
    a few seconds, instead of hanging.
    """
    _check_args(role, rank, world_size, peer_world_size, backend, timeout)
    me = _Who(role, rank, world_size, peer_world_size)
    store = _open_store(me, address, port, timeout)
    deadline = time.monotonic() + timeout
    _register(store, me, backend)
    _wait_for_all(store, me, deadline, timeout, address, port)
    _check_agreement(store, me, backend)
    try:
        group = _build_joint_group(store, me.joint_rank, me.joint_world, backend, timeout)
    except Exception as e:  # a peer died between registering and connecting
        raise ConnectError(f"{me}: building the joint {backend} group of {me.joint_world} "
                           f"ranks failed: {type(e).__name__}: {e}") from e
    return Connection(role, rank, world_size, peer_world_size, backend, float(timeout), group, store)


@dataclass(frozen=True)
class _Who:
    """One rank of the two jobs: its role, its rank in its job and both jobs' sizes."""

    role: str
    rank: int
    world_size: int
    peer_world_size: int

    @property
    def trainers(self) -> int:
        return self.world_size if self.role == "trainer" else self.peer_world_size

    @property
    def engines(self) -> int:
        return self.peer_world_size if self.role == "trainer" else self.world_size

    @property
    def joint_rank(self) -> int:
        return self.rank if self.role == "trainer" else self.trainers + self.rank

    @property
    def joint_world(self) -> int:
        return self.trainers + self.engines

    @property
    def is_host(self) -> bool:
        return self.role == "trainer" and self.rank == 0

    def everyone(self) -> list[str]:
        return [_key("trainer", r) for r in range(self.trainers)] + \
               [_key("engine", r) for r in range(self.engines)]

    def __str__(self) -> str:
        return f"{self.role} rank {self.rank}"


@dataclass(frozen=True)
class Connection(_Who):
    """The joint group of a trainer job and an engine job, as one rank sees it.

    ``rank`` / ``world_size`` are this rank's place in its own job; ``joint_rank``
    / ``joint_world`` its place in the joint group; ``src_rank_offset`` (0) and
    ``dst_rank_offset`` (the trainer job's size) the first joint rank of each side.
    """

    backend: str = "gloo"
    timeout: float = 60.0
    group: dist.ProcessGroup | None = field(default=None, repr=False, compare=False)
    # the trainer's rank 0 hosts the store: keep it alive as long as the group
    store: dist.Store | None = field(default=None, repr=False, compare=False)

    @property
    def src_rank_offset(self) -> int:
        return 0

    @property
    def dst_rank_offset(self) -> int:
        return self.trainers

    def absent(self, what: str, window: float) -> list[tuple[str, int]] | None:
        """After a collective of the joint group failed in ``what``, on every rank still
        alive: the ranks of both jobs that never reached it, as ``(role, rank)``. Each live
        rank marks itself in the store; the first to mark sets one deadline for all,
        ``window`` seconds later (the last live rank may reach it that much after the
        first: a wait on a stopped peer, then a collective, each within the refit's
        timeout), and every rank returns once all have marked or at that deadline. None
        where the store is gone: its host, trainer rank 0, died."""
        prefix = f"torchrefit/alive/{what}"
        keys = {(role, r): f"{prefix}/{role}/{r}" for role, n in
                (("trainer", self.trainers), ("engine", self.engines)) for r in range(n)}
        gone: list[tuple[str, int]] | None = None
        try:
            self.store.set(keys[(self.role, self.rank)], "1")
            deadline = float(self.store.compare_set(f"{prefix}/deadline", "",
                                                    repr(time.time() + window)).decode())
            while True:
                gone = [who for who, key in keys.items() if not self.store.check([key])]
                if not gone or time.time() >= deadline:
                    break
                time.sleep(_POLL)
            if self.is_host:  # the others' last look at the store comes just after ours
                time.sleep(4 * _POLL)
        except Exception:  # the host is gone: what was seen before it went, if anything
            pass
        return gone

    def close(self) -> None:
        """Tear down the joint group on this rank (each job's default group stays)."""
        if self.group is not None and self.group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(self.group)


def _key(role: str, rank: int) -> str:
    return f"torchrefit/{role}/{rank}"


def _check_args(role, rank, world_size, peer_world_size, backend, timeout) -> None:
    if role not in ROLES:
        raise ValueError(f"connect: role must be one of {ROLES}, not {role!r}")
    for name, v in (("world_size", world_size), ("peer_world_size", peer_world_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"connect: {name} must be a positive int, not {v!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"connect: {role} rank {rank!r} is outside its job of {world_size} ranks")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"connect: backend must be 'gloo' or 'nccl', not {backend!r}")
    if not timeout > 0:
        raise ValueError(f"connect: timeout must be a positive number of seconds, not {timeout!r}")


def _open_store(me: _Who, address: str, port: int, timeout: float) -> dist.TCPStore:
    """The trainer's rank 0 hosts the store; everyone else connects to it (retrying
    until ``timeout``: the host may start later)."""
    try:
        return dist.TCPStore(address, port, me.joint_world, is_master=me.is_host,
                             timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as e:
        if me.is_host:
            raise ConnectError(f"{me}: could not host the rendezvous store on {address}:{port}: "
                               f"{type(e).__name__}: {e}") from e
        raise ConnectError(
            f"{me}: missing trainer rank 0: its rendezvous store at {address}:{port} did not "
            f"answer within {timeout:g} s (is the trainer job running, with the same address "
            f"and port?)") from e


def _register(store: dist.Store, me: _Who, backend: str) -> None:
    store.set(_key(me.role, me.rank), f"{me.world_size},{me.peer_world_size},{backend}")


def _wait_for_all(store: dist.Store, me: _Who, deadline: float, timeout: float,
                  address: str, port: int) -> None:
    keys = me.everyone()
    while True:
        try:
            if store.check([_ABORT]):
                _give_up(store, me, store.get(_ABORT).decode())
            if store.check(keys):
                return
        except ConnectError:
            raise
        except Exception as e:  # the host went away
            raise ConnectError(f"{me}: lost the rendezvous store at {address}:{port} "
                               f"(trainer rank 0 is gone): {type(e).__name__}: {e}") from e
        if time.monotonic() >= deadline:
            break
        time.sleep(_POLL)
    missing = [k for k in keys if not store.check([k])]
    msg = (f"missing {_describe(missing)}: they did not join at {address}:{port} within "
           f"{timeout:g} s (seen by {me})")
    _fail(store, me, msg)


def _fail(store: dist.Store, me: _Who, msg: str) -> None:
    """Publish why this rank gives up (unless a rank already did: its reason wins), raise."""
    first = store.compare_set(_ABORT, "", msg).decode()
    _give_up(store, me, first)


def _give_up(store: dist.Store, me: _Who, msg: str) -> None:
    """Raise ``msg`` on this rank. The host waits (briefly) until every rank that
    came has read it: its store must outlive their last look, or they would see a
    vanished store instead of who was missing."""
    came = store.add(_GAVE_UP, 1)
    if me.is_host:
        present = sum(store.check([k]) for k in me.everyone())
        until = time.monotonic() + _GRACE
        while came < present and time.monotonic() < until:
            time.sleep(_POLL)
            came = store.add(_GAVE_UP, 0)
    raise ConnectError(f"{me}: {msg}")


def _describe(keys: list[str]) -> str:
    """``trainer ranks [1]; engine ranks [0, 1, 2]`` from store keys."""
    parts = []
    for role in ROLES:
        ranks = [int(k.rsplit("/", 1)[1]) for k in keys if k.split("/")[1] == role]
        if ranks:
            shown = str(ranks) if len(ranks) <= 8 else f"{ranks[:8]}... ({len(ranks)} ranks)"
            parts.append(f"{role} ranks {shown}")
    return "; ".join(parts)


def _check_agreement(store: dist.Store, me: _Who, backend: str) -> None:
    """Every rank reads every rank's registration: the same check, the same error
    everywhere (before any rank builds the group and blocks in it)."""
    seen = {}
    for key in me.everyone():
        world, peer, their_backend = store.get(key).decode().split(",")
        role = key.split("/")[1]
        trainers, engines = (int(world), int(peer)) if role == "trainer" else (int(peer), int(world))
        seen[key] = (trainers, engines, their_backend)
    distinct = sorted(set(seen.values()))
    if len(distinct) > 1:
        by = {v: [k.removeprefix("torchrefit/") for k in seen if seen[k] == v] for v in distinct}
        told = "; ".join(f"{', '.join(ks[:4])}: {t} trainer + {e} engine ranks over {b}"
                         for (t, e, b), ks in by.items())
        _fail(store, me, f"the two jobs disagree about the joint group: {told} (seen by {me})")


# ---------------------------------------------------------------- the joint group
# Building a process group from a store, beside the default group (``connect``'s).
#
# ``init_process_group`` cannot be called twice and ``new_group`` needs every rank
# of one default group; two separately launched jobs have two. So the joint group
# is built the way ``new_group`` builds one internally (and vLLM's stateless groups
# and SGLang's weight-update groups do): a ``ProcessGroup`` over a ``PrefixStore``,
# its Gloo (and NCCL) backends constructed directly and registered on it.
#
# It is then registered in c10d's bookkeeping so that the functional API
# (``dist.all_gather(..., group=g)``, ``dist.isend``, ``dist.get_global_rank``) works
# on it like on any group. c10d translates "global" ranks through that table; the
# joint group's members live in two default groups, so their global ranks are
# stand-ins (``_STAND_IN + joint rank``) except this process's own entry, which is
# its default group's rank where there is one (``dist.get_rank(g)`` then answers the
# joint rank). Every translation torchrefit does is group rank -> stand-in -> group
# rank within this process, so the stand-ins never leave it.

_STAND_IN = 1 << 24
_NAMES = itertools.count()


def _build_joint_group(store: dist.Store, rank: int, world: int, backend: str,
                       timeout: float) -> dist.ProcessGroup:
    """This process's member of a ``world``-rank group over ``store``. Collective over
    all ``world`` ranks (each builds its backends; Gloo connects them pairwise)."""
    # the store is this group's own (one per ``connect``), so its keys need no number;
    # the name is unique in this process, where c10d registers it: two processes that
    # have each built a different count of groups (an engine serving a restarted
    # trainer) must still meet under the same keys
    name = f"torchrefit_joint_{next(_NAMES)}"
    prefix = dist.PrefixStore("torchrefit_joint/", store)
    td = datetime.timedelta(seconds=timeout)
    pg = dist.ProcessGroup(prefix, rank, world)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", prefix), rank, world, td)
    gloo._set_sequence_number_for_group()
    if backend == "nccl":
        pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        nccl = _nccl(prefix, rank, world, td)
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
        config = "cpu:gloo,cuda:nccl"
    else:
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        for device in ("cpu", "cuda"):  # CUDA tensors through Gloo, as a plain gloo group does
            pg._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO, gloo)
        config = "cpu:gloo,cuda:gloo"
    pg._set_group_name(name)
    _register_group(pg, backend if backend == "gloo" else config, prefix, name, config,
              _rank_mapping(rank, world))
    return pg


def _register_group(pg, backend: str, store, name: str, config: str, ranks: dict[int, int]) -> None:
    """c10d's bookkeeping for a new group (one helper in recent torch; by hand before it,
    e.g. torch 2.11, as ``new_group`` fills the same tables)."""
    register = getattr(c10d, "_register_pg_in_world", None)
    if register is not None:
        register(pg, backend_name=backend, store=store, group_name=name, backend_config=config,
                 rank_mapping=ranks)
        return
    world = c10d._world
    world.pg_map[pg] = (backend, store)
    world.pg_names[pg] = name
    world.pg_backend_config[pg] = config
    world.pg_group_ranks[pg] = ranks
    if hasattr(c10d, "_register_process_group"):
        c10d._register_process_group(name, pg)
    tag = f"ptd:{name}"
    world.tags_to_pg.setdefault(tag, []).append(pg)
    world.tags_to_pg.setdefault("", []).append(pg)
    world.pg_to_tag[pg] = tag


def _nccl(prefix: dist.Store, rank: int, world: int, td: datetime.timedelta):
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = td
    options.is_high_priority_stream = False
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", prefix), rank, world, options)
    nccl._set_sequence_number_for_group()
    return nccl


def _rank_mapping(rank: int, world: int) -> dict[int, int]:
    """Stand-in global rank -> joint rank; this process's own default rank where it has one."""
    mine = dist.get_rank() if dist.is_initialized() else _STAND_IN + rank
    return {(mine if r == rank else _STAND_IN + r): r for r in range(world)}
