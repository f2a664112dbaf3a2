"""CUDA IPC transport: receivers copy straight out of the senders' GPU memory.

For processes on one machine (collocated trainer and engine processes sharing
GPUs, the common RL layout): each sender exports CUDA IPC handles of the source
tensors it sends from, once per compiled program; each receiver maps them once
and then copies its regions device to device, like local copies, with no
staging and no message packing. Per refit there is one small handshake per peer
pair over the group's Gloo backend:

1. the sender records an interprocess event on its current stream (after the
   producer: the optimizer step), and sends a header (and, when its storage
   moved, a new handle table);
2. the receiver's current stream waits for that event (no stale reads), copies,
   records its own interprocess event and acknowledges;
3. the sender's current stream waits for the receiver's event, so work it
   queues later (the next optimizer step) cannot overwrite sources still being
   read (no torn reads).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from ..errors import TransportError
from ..layout._types import Box
from .base import Exchange, Transport, register_transport, require_backend, require_cuda

__all__ = ["IpcTransport", "Outgoing"]

_HEADER, _TABLE, _ACK = 31, 32, 33  # gloo tags of the three handshake messages
_EVENT_BYTES = 64  # cudaIpcEventHandle_t


@dataclass
class Outgoing:
    """What this rank sends one peer: source tensors and, per transfer in plan order,
    (index of its tensor, region of that local tensor)."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    regions: list[tuple[int, Box]] = field(default_factory=list)


@dataclass
class _Mapped:
    """A sender's table as opened by a receiver."""

    generation: int
    views: list[torch.Tensor]
    event: torch.cuda.Event


@register_transport
class IpcTransport(Transport):
    name = "ipc"
    peer_mapped = True

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__(group, device)
        require_cuda(device, "ipc")
        require_backend(group, "gloo", "ipc", "exchanges its small handshakes")
        # two events, one per role, so a rank that both sends and receives never makes
        # its readers wait for its own reads
        self._ready = torch.cuda.Event(interprocess=True)  # sender: sources are final
        self._read = torch.cuda.Event(interprocess=True)  # receiver: regions were read
        self._ready_handle = _fixed(self._ready.ipc_handle(), _EVENT_BYTES)
        self._read_handle = _fixed(self._read.ipc_handle(), _EVENT_BYTES)
        self._sent: dict[int, int] = {}  # peer -> generation of the table it holds
        self._mapped: dict[int, _Mapped] = {}
        self._peer_events: dict[bytes, torch.cuda.Event] = {}
        self._pending: list = []

    @classmethod
    def available(cls) -> bool:
        return dist.is_available() and dist.is_gloo_available() and torch.cuda.is_available()

    def wire_device(self) -> torch.device:
        return self.device

    def start(self, sends: Exchange, recvs: Exchange) -> object:
        raise TransportError("the ipc transport maps peers' tensors; it has no message rounds")

    def finish(self, handle: object) -> None:
        raise TransportError("the ipc transport maps peers' tensors; it has no message rounds")

    # ------------------------------------------------------------------ one refit
    def post(self, outgoing: dict[int, Outgoing], generation: int, from_peers: list[int]) -> None:
        """Sender side of step 1 for every peer, and the receives of headers and
        acknowledgements. Call on every rank before :meth:`incoming`."""
        cpu_works = []
        if outgoing:
            self._ready.record(torch.cuda.current_stream(self.device))
        for peer, out in outgoing.items():
            table = b"" if self._sent.get(peer) == generation else self._table(out, generation)
            header = torch.tensor([generation, len(table)], dtype=torch.int64)
            cpu_works.append((dist.isend(header, self.global_rank(peer), self.group, tag=_HEADER), header))
            if table:
                blob = torch.frombuffer(bytearray(table), dtype=torch.uint8)
                cpu_works.append((dist.isend(blob, self.global_rank(peer), self.group, tag=_TABLE), blob))
                self._sent[peer] = generation
        acks = {p: torch.empty(_EVENT_BYTES, dtype=torch.uint8) for p in outgoing}
        ack_works = {p: dist.irecv(t, self.global_rank(p), self.group, tag=_ACK) for p, t in acks.items()}
        headers = {p: torch.empty(2, dtype=torch.int64) for p in from_peers}
        header_works = {p: dist.irecv(t, self.global_rank(p), self.group, tag=_HEADER) for p, t in headers.items()}
        self._pending = [cpu_works, acks, ack_works, headers, header_works]

    def incoming(self, peer: int) -> list[torch.Tensor]:
        """Receiver side of step 2 for ``peer``: its mapped regions (plan order), with the
        current stream already waiting for the sender's event."""
        _, _, _, headers, header_works = self._pending
        header_works[peer].wait()
        generation, size = (int(v) for v in headers[peer])
        if size:
            blob = torch.empty(size, dtype=torch.uint8)
            dist.recv(blob, self.global_rank(peer), self.group, tag=_TABLE)
            self._mapped[peer] = self._open(pickle.loads(bytes(blob.tolist())))
        mapped = self._mapped.get(peer)
        if mapped is None or mapped.generation != generation:
            raise TransportError(f"ipc: rank {peer} sent generation {generation} without its table")
        self._wait_ready(mapped.event)
        return mapped.views

    def _wait_ready(self, event: torch.cuda.Event) -> None:
        # the only thing that keeps a receiver from reading sources the producer has
        # not finished writing (tests/test_gpu_stale_read.py removes it to prove that)
        torch.cuda.current_stream(self.device).wait_event(event)

    def read(self, peer: int) -> None:
        """Receiver side, after the copies from ``peer`` were queued: record and acknowledge."""
        self._read.record(torch.cuda.current_stream(self.device))
        ack = torch.frombuffer(bytearray(self._read_handle), dtype=torch.uint8)
        self._pending[0].append((dist.isend(ack, self.global_rank(peer), self.group, tag=_ACK), ack))

    def complete(self) -> None:
        """Sender side of step 3: wait for every acknowledgement and order this rank's
        current stream after the receivers' reads."""
        cpu_works, acks, ack_works, _, _ = self._pending
        stream = torch.cuda.current_stream(self.device)
        for peer, work in ack_works.items():
            work.wait()
            stream.wait_event(self._peer_event(bytes(acks[peer].tolist())))
        for work, _ in cpu_works:
            work.wait()
        self._pending = []

    # ----------------------------------------------------------------- handles
    def _table(self, out: Outgoing, generation: int) -> bytes:
        # reduce_tensor shares the storage once (the allocator keeps the block alive
        # while any receiver maps it) and records where the tensor sits inside it
        handles = [reduce_tensor(t.detach())[1] for t in out.tensors]
        regions = [(i, box.offset, box.size) for i, box in out.regions]
        return pickle.dumps((generation, handles, regions, self._ready_handle))

    def _open(self, table) -> _Mapped:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        generation, handles, regions, event_handle = table
        tensors = [rebuild_cuda_tensor(*args) for args in handles]
        views = [tensors[i][Box(tuple(off), tuple(size)).slices()] for i, off, size in regions]
        return _Mapped(generation, views, self._peer_event(event_handle))

    def _peer_event(self, handle: bytes) -> torch.cuda.Event:
        event = self._peer_events.get(handle)
        if event is None:
            event = self._peer_events[handle] = torch.cuda.Event.from_ipc_handle(self.device, handle)
        return event

    def close(self) -> None:
        self._mapped.clear()
        self._peer_events.clear()


def _fixed(handle: bytes, size: int) -> bytes:
    if len(handle) != size:
        raise TransportError(f"ipc: unexpected CUDA event handle of {len(handle)} bytes")
    return handle
