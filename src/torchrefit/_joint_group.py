"""Building a process group from a store, beside the default group (``connect``'s).

``init_process_group`` cannot be called twice and ``new_group`` needs every rank
of one default group; two separately launched jobs have two. So the joint group
is built the way ``new_group`` builds one internally (and vLLM's stateless groups
and SGLang's weight-update groups do): a ``ProcessGroup`` over a ``PrefixStore``,
its Gloo (and NCCL) backends constructed directly and registered on it.

It is then registered in c10d's bookkeeping so that the functional API
(``dist.all_gather(..., group=g)``, ``dist.isend``, ``dist.get_global_rank``) works
on it like on any group. c10d translates "global" ranks through that table; the
joint group's members live in two default groups, so their global ranks are
stand-ins (``_STAND_IN + joint rank``) except this process's own entry, which is
its default group's rank where there is one (``dist.get_rank(g)`` then answers the
joint rank). Every translation torchrefit does is group rank -> stand-in -> group
rank within this process, so the stand-ins never leave it.
"""

from __future__ import annotations

import datetime
import itertools

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["build_joint_group"]

_STAND_IN = 1 << 24
_NAMES = itertools.count()


def build_joint_group(store: dist.Store, rank: int, world: int, backend: str,
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
    _register(pg, backend if backend == "gloo" else config, prefix, name, config,
              _rank_mapping(rank, world))
    return pg


def _register(pg, backend: str, store, name: str, config: str, ranks: dict[int, int]) -> None:
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
