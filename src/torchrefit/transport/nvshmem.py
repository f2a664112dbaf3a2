"""NVSHMEM transport: message rounds as stream-ordered puts into symmetric inboxes.

Optional extra ``nvshmem4py-cu13`` (imports as ``nvshmem``). One PE per rank of the
refit group (PE = group rank), bootstrapped once per process from a unique id that
group rank 0 broadcasts over the group's Gloo backend.

A receiver's destination tensors are ordinary PyTorch memory, which NVSHMEM cannot
reach remotely, so the bytes land in a symmetric *inbox* and are unpacked from
there: the transport speaks the message-rounds protocol and the rounds program
(``execute.rounds``) packs, bounds and unpacks as for nccl. The inbox schedule is
planned once per Refitter in :meth:`NvshmemTransport.prepare` (collective, every
rank, after planning): each receiver's inbox holds one slot per sender it hears
from, twice (message parity), each slot the largest message any rank sends, so its
size is bounded by the Refitter's ``pool_bytes`` (the rounds' message limit is
``pool_bytes / (2 * peers)``), or by one row of the widest tensor where a row is
larger.

Every step is queued on the caller's stream; nothing waits on the host:

* send (``start``): wait until the receiver acknowledged message ``s - 2`` of the
  pair (it used the same parity slot), then ``putmem_signal``: the bytes, then the
  pair's data signal set to ``s``. The put is stream-ordered after the packing,
  itself after the producer (the optimizer step), so no stale bytes leave;
* receive (``finish``): wait until the pair's data signal reaches ``s`` (NVSHMEM
  sets it after the bytes landed), copy the slot out, then set the sender's
  acknowledgement signal to ``s``, ordered after the copy.

The pair counters ``s`` live on both ends and advance with every message, so a
refit that raised half way leaves them disagreeing: build a new Refitter then.
Across hosts NVSHMEM needs local sources registered (``nvshmemx_buffer_register``),
which this module does not do: it is marked ``one_host``.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import socket
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import settings
from ..errors import TransportError
from ..plan.messages import ALIGN, cut_messages
from ..plan.types import RankPlan
from .base import (
    Availability,
    Exchange,
    RoundsTransport,
    host_wait_current,
    register_transport,
    require_backend,
    require_cuda,
)
from .collectives import all_gather_pickled, collective

__all__ = ["NvshmemTransport", "Inbox", "plan_inbox", "largest_message"]

_SIGNAL_BYTES = 8  # an NVSHMEM signal is a uint64
_HEADROOM = 64 << 20  # symmetric heap beyond the inbox (NVSHMEM's own allocations)


@dataclass(frozen=True)
class Inbox:
    """Where messages land in each receiver's symmetric inbox (the same on every rank).

    ``senders[r]``: the ranks rank ``r`` receives from, ascending; slot ``i`` of a
    parity holds messages from ``senders[r][i]``. Every rank's inbox has the same size
    (symmetric memory), that of the rank hearing from the most senders.
    """

    slot_bytes: int
    senders: tuple[tuple[int, ...], ...]
    _index: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.slot_bytes < 0 or self.slot_bytes % ALIGN:
            raise ValueError(f"inbox slot of {self.slot_bytes} bytes is not a multiple of {ALIGN}")
        object.__setattr__(self, "_index", {(r, s): i for r, ss in enumerate(self.senders)
                                            for i, s in enumerate(ss)})

    @property
    def slots(self) -> int:
        return max((len(s) for s in self.senders), default=0)

    @property
    def nbytes(self) -> int:
        return 2 * self.slots * self.slot_bytes

    def offset(self, receiver: int, sender: int, parity: int) -> int:
        """Byte offset, in ``receiver``'s inbox, of ``sender``'s messages of ``parity``."""
        try:
            i = self._index[receiver, sender]
        except KeyError:
            raise TransportError(f"nvshmem: rank {receiver} expects no message from rank {sender}; "
                                 "the plans disagree") from None
        return (parity * self.slots + i) * self.slot_bytes


def largest_message(plan: RankPlan, limit: int) -> int:
    """The largest message this rank's plan sends when cut at ``limit`` bytes (what the
    rounds program will send; a single row larger than ``limit`` is one message)."""
    by_peer = defaultdict(list)
    for t in plan.sends:
        by_peer[t.peer].append(t)
    return max((m.nbytes for p, ts in by_peer.items() for m in cut_messages(p, ts, limit)), default=0)


def plan_inbox(recv_peers: Sequence[Sequence[int]], largest: Sequence[int]) -> Inbox:
    """The inbox from every rank's receive peers and largest sent message (pure)."""
    slot = -(-max(largest, default=0) // ALIGN) * ALIGN
    return Inbox(slot, tuple(tuple(sorted(p)) for p in recv_peers))


class _Pes:
    """The process's NVSHMEM state: initialised once, by the first transport's prepare,
    for one group; finalised at exit."""

    group_ranks: tuple[int, ...] | None = None

    @classmethod
    def init(cls, group: dist.ProcessGroup, ranks: tuple[int, ...], device: torch.device, heap: int) -> None:
        if cls.group_ranks is not None:
            if cls.group_ranks != ranks:
                raise TransportError(f"nvshmem: this process's PEs are the ranks {list(cls.group_ranks)[:8]}; "
                                     f"a refit over ranks {list(ranks)[:8]} needs a new process")
            return
        import nvshmem.core as nvc
        from cuda.core import Device
        from nvshmem import bindings

        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(heap + _HEADROOM))
        rank = dist.get_rank(group)
        uid = nvc.get_unique_id(empty=rank != 0)
        size = uid._data.itemsize
        blob = [ctypes.string_at(uid.ptr, size) if rank == 0 else None]
        dist.broadcast_object_list(blob, src=ranks[0], group=group)
        ctypes.memmove(uid.ptr, blob[0], size)
        dev = Device(device.index if device.index is not None else torch.cuda.current_device())
        dev.set_current()
        nvc.init(device=dev, uid=uid, rank=rank, nranks=len(ranks), initializer_method="uid")
        if bindings.my_pe() != rank:
            raise TransportError(f"nvshmem: rank {rank} became PE {bindings.my_pe()}")
        cls.group_ranks = ranks
        atexit.register(nvc.finalize)


@register_transport
class NvshmemTransport(RoundsTransport):
    name = "nvshmem"
    preference = 15  # after nccl: it stages through a symmetric inbox and unpacks from it
    needs_cuda = True
    one_host = True

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        if self.needs_cuda:  # tests/shm_transport.py runs the protocol on CPU
            require_cuda(device, self.name)
        super().__init__(group, device)
        require_backend(group, "gloo", "nvshmem", "bootstraps its PEs and plans its inbox")
        self.rank = dist.get_rank(group)
        self.inbox: Inbox | None = None
        self._heap: torch.Tensor | None = None  # symmetric: signals, then the inbox
        self._sent: dict[int, int] = defaultdict(int)  # peer -> messages put to it
        self._received: dict[int, int] = defaultdict(int)  # peer -> messages taken from it

    @classmethod
    def available(cls) -> Availability:
        return Availability.first_missing([
            (dist.is_available() and dist.is_gloo_available(), "this torch build has no Gloo (bootstrap)"),
            (torch.cuda.is_available(), "no CUDA GPU is visible"),
            (importlib.util.find_spec("nvshmem") is not None,
             "the nvshmem4py-cu13 package is not installed (pip install 'torchrefit[nvshmem]')"),
        ])

    def wire_device(self) -> torch.device:
        return self.device

    def largest_message(self) -> int | None:
        """An inbox slot: the largest message the plan sends (``prepare``)."""
        return self.inbox.slot_bytes if self.inbox is not None else None

    # ------------------------------------------------------------- the schedule
    def prepare(self, plan: RankPlan, message_limit: int) -> None:
        """Collective, once per Refitter on every rank: plan the inbox from every rank's
        receive peers and largest message, check one GPU per rank, start the PEs and
        allocate the symmetric signals and inbox."""
        gathered = all_gather_pickled((tuple(plan.recv_peers), largest_message(plan, message_limit),
                                       self._where()), self.group, self.timeout)
        _one_gpu_per_rank([g[2] for g in gathered])
        self.set_inbox(plan_inbox([g[0] for g in gathered], [g[1] for g in gathered]))

    def set_inbox(self, inbox: Inbox) -> None:
        """Start the PEs (once per process) and allocate ``inbox`` with its signals.
        Collective over the group; ``prepare`` calls it (tests call it directly)."""
        world = dist.get_world_size(self.group)
        if len(inbox.senders) != world:
            raise TransportError(f"nvshmem: an inbox for {len(inbox.senders)} ranks in a group of {world}")
        signals = 2 * world * _SIGNAL_BYTES
        self._heap = self._allocate(signals + inbox.nbytes)
        self._heap[:signals].zero_()
        self._signals = signals
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # zeroed on every PE before any peer signals
        collective("nvshmem's inbox barrier", dist.barrier, group=self.group, timeout=self.timeout)
        self.inbox = inbox

    # the five places NVSHMEM itself is touched (tests/shm_transport.py replaces them)
    def _where(self) -> tuple[str, str]:
        props = torch.cuda.get_device_properties(self.device)
        return socket.gethostname(), str(getattr(props, "uuid", self.device))

    def _allocate(self, nbytes: int) -> torch.Tensor:
        """Start the PEs (once per process) and allocate ``nbytes`` of symmetric memory
        (collective)."""
        import nvshmem.core as nvc

        _Pes.init(self.group, tuple(self._global), self.device, nbytes)
        return nvc.tensor((nbytes,), dtype=torch.uint8)

    def _free(self, heap: torch.Tensor) -> None:
        """Free what ``_allocate`` returned (collective)."""
        import nvshmem.core as nvc

        nvc.free_tensor(heap)

    def _bindings(self):
        from nvshmem import bindings

        return bindings

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _data_signal(self, sender: int) -> int:
        """Address of the signal that ``sender``'s puts set (in the receiver's heap)."""
        return self._heap.data_ptr() + sender * _SIGNAL_BYTES

    def _ack_signal(self, receiver: int) -> int:
        """Address of the signal ``receiver`` sets once it copied a message out."""
        world = dist.get_world_size(self.group)
        return self._heap.data_ptr() + (world + receiver) * _SIGNAL_BYTES

    def _slot(self, receiver: int, sender: int, seq: int) -> int:
        return self._heap.data_ptr() + self._signals + self.inbox.offset(receiver, sender, seq % 2)

    # ------------------------------------------------------------------- rounds
    def start(self, sends: Exchange, recvs: Exchange) -> object:
        if self.inbox is None:
            raise TransportError("nvshmem: no inbox: start() before prepare() (build the transport through a "
                                 "Refitter) or after close() (build a new Refitter)")
        nvb, stream = self._bindings(), self._stream()
        for peer, buf in sends:
            if buf.nbytes > self.inbox.slot_bytes:
                raise TransportError(f"nvshmem: a {buf.nbytes}-byte message to rank {peer} exceeds the "
                                     f"{self.inbox.slot_bytes}-byte inbox slot planned by prepare()")
            seq = self._sent[peer] = self._sent[peer] + 1
            if seq > 2:  # the slot of this parity held message seq - 2: wait until it was copied out
                nvb.signal_wait_until_on_stream(self._ack_signal(peer), nvb.Cmp_type.CMP_GE, seq - 2, stream)
            nvb.putmem_signal_on_stream(self._slot(peer, self.rank, seq), buf.data_ptr(), buf.nbytes,
                                        self._data_signal(self.rank), seq, nvb.Signal_op.SIGNAL_SET,
                                        peer, stream)
        return recvs

    def finish(self, handle: object) -> None:
        nvb, stream = self._bindings(), self._stream()
        for peer, buf in handle:  # type: ignore[union-attr]
            seq = self._received[peer] = self._received[peer] + 1
            # the one wait that keeps a receiver from unpacking bytes not yet landed
            nvb.signal_wait_until_on_stream(self._data_signal(peer), nvb.Cmp_type.CMP_GE, seq, stream)
            start = self._signals + self.inbox.offset(self.rank, peer, seq % 2)
            buf.copy_(self._heap[start: start + buf.nbytes], non_blocking=True)
            nvb.signal_op_on_stream(self._ack_signal(self.rank), seq, nvb.Signal_op.SIGNAL_SET, peer, stream)

    def close(self) -> None:
        """Collective once the inbox exists: every rank of the group calls it (through
        ``Refitter.close``), since NVSHMEM frees symmetric memory collectively. Waits on
        the host for this rank's current stream (puts, signal waits and copies out of
        the inbox queued there still use the heap), then frees signals and inbox.
        Calling it again does nothing."""
        heap, self._heap, self.inbox = self._heap, None, None
        if heap is not None:
            host_wait_current(self.device)
            self._free(heap)


def _one_gpu_per_rank(places: Sequence[tuple[str, str]]) -> None:
    """NVSHMEM runs one PE per GPU (several per GPU only under CUDA MPS): refuse, on
    every rank, ranks that share one."""
    seen: dict[tuple[str, str], list[int]] = defaultdict(list)
    for rank, place in enumerate(places):
        seen[place].append(rank)
    shared = [ranks for ranks in seen.values() if len(ranks) > 1]
    if shared and not settings.current().nvshmem_shared_gpu:
        raise TransportError(f"nvshmem: ranks {shared[0]} share one GPU of host {places[shared[0][0]][0]}; "
                             "NVSHMEM needs one GPU per rank (set TORCHREFIT_NVSHMEM_SHARED_GPU=1, settings.nvshmem_shared_gpu, "
                             "where CUDA MPS lets PEs share one)")
