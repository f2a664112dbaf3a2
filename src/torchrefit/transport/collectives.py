"""Gathering small Python objects, and rosters deduplicated, over a process group.

``torch.distributed.all_gather_object`` needs NumPy in recent PyTorch releases;
torchrefit depends on ``torch`` alone, so it pickles into a uint8 tensor itself.
"""

from __future__ import annotations

import ctypes
import datetime
import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import TransportError
from ..plan.metadata import (
    Gathered,
    RosterRef,
    assemble,
    owners,
    read_record,
    record,
    ref_of,
    split,
)

__all__ = ["all_gather_pickled", "all_gather_rosters", "collective_device", "collective"]


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where tensors for a collective over ``group`` live (CPU for gloo, else CUDA)."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _to_bytes(t: torch.Tensor) -> bytes:
    t = t.cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel())


def collective(what: str, fn, *args, group: dist.ProcessGroup, timeout: float | None = None, **kwargs):
    """Run ``fn(*args, group=group, async_op=True, **kwargs)`` and wait for it, at most
    ``timeout`` seconds (None: the group's own timeout); a backend error or a timeout (a
    rank that died, stopped, or skipped the call) raises :class:`TransportError`."""
    try:
        work = fn(*args, group=group, async_op=True, **kwargs)
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TransportError(
            f"{what} over the refit group failed or timed out after {timeout} s: a rank died, "
            f"stopped, or did not make the same call ({type(e).__name__}: {detail[:300]})",
            rule="timeout") from e


def all_gather_pickled(obj: Any, group: dist.ProcessGroup, timeout: float | None = None) -> list[Any]:
    """Every rank's ``obj``, by group rank (two collectives: sizes, then bytes)."""
    world = dist.get_world_size(group)
    device = collective_device(group)
    data = pickle.dumps(obj, protocol=5)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    collective("gathering metadata", dist.all_gather, sizes, size, group=group, timeout=timeout)
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(world)]
    collective("gathering metadata", dist.all_gather, out, buf, group=group, timeout=timeout)
    return [pickle.loads(_to_bytes(t[:n])) for t, n in zip(out, lengths)]


def all_gather_rosters(
    extra: Any, rosters: Sequence[bytes | None], group: dist.ProcessGroup,
    timeout: float | None = None,
) -> tuple[list[Any], list[list[bytes | None]], Gathered]:
    """Every rank's ``extra`` and its rosters (one per role), by group rank, gathering
    each distinct roster once (see :mod:`torchrefit.plan.metadata`).

    Collective: every rank of ``group`` calls it with the same number of roles. First
    an object gather of ``(extra, refs)``, then one broadcast per owner (the lowest
    rank holding a roster nobody below it holds) of its distinct rosters, whose
    sizes everyone knows from the refs. Each collective waits at most ``timeout``
    seconds (None: the group's own), else raises :class:`TransportError`. Returns the extras, one table per role
    (``tables[role][rank]``; replicas share one ``bytes`` object) and the bytes this
    rank received.
    """
    refs = tuple(ref_of(b) for b in rosters)
    records = all_gather_pickled(record(extra, refs), group, timeout)
    sizes = [len(pickle.dumps(r, protocol=5)) for r in records]
    records = [read_record(r) for r in records]
    all_refs = [r for _, r in records]
    me = dist.get_rank(group)
    device = collective_device(group)
    distinct: dict[bytes, bytes] = {}
    sent = owners(all_refs)
    for owner, theirs in sent.items():
        distinct.update(split(_broadcast(owner, me, theirs, rosters, refs, device, group, timeout), theirs))
    tables = [assemble(all_refs, distinct, role) for role in range(len(rosters))]
    return [e for e, _ in records], tables, Gathered.of(sizes, all_refs)


def _broadcast(owner: int, me: int, theirs: list[RosterRef], rosters: Sequence[bytes | None],
               refs: Sequence[RosterRef | None], device: torch.device,
               group: dist.ProcessGroup, timeout: float | None) -> bytes:
    """The owner's distinct rosters, concatenated, on every rank."""
    buf = torch.empty(sum(r.size for r in theirs), dtype=torch.uint8, device=device)
    if owner == me:
        mine = {ref.digest: blob for ref, blob in zip(refs, rosters) if ref is not None}
        data = b"".join(mine[r.digest] for r in theirs)
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    collective(f"broadcasting rank {owner}'s rosters", dist.broadcast, buf, group=group,
               timeout=timeout, group_src=owner)
    return _to_bytes(buf)
