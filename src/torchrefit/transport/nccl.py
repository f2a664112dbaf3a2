"""NCCL transport: one ``batch_isend_irecv`` per round, on GPU message buffers.

PyTorch's NCCL process group orders its internal stream after the caller's
current stream when ops are posted, and ``Work.wait()`` makes the caller's
stream wait for it, so no host synchronisation is needed.

Dead peers: the host never waits for NCCL, so a peer that died or stopped would
leave this rank's stream (and whoever synchronizes with it) blocked until NCCL's
own watchdog. Instead, after each refit :meth:`NcclTransport.watch` hands an event
recorded behind the refit to a watchdog thread; if the event has not completed
within ``timeout`` seconds the thread aborts the group's NCCL communicator (which
ends the blocked kernels, so no stream or host stays blocked) and the next call
into the Refitter raises :class:`TransportError` naming the peers.
"""

from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist

from ..errors import TransportError
from .base import (
    Availability,
    Exchange,
    RoundsTransport,
    register_transport,
    require_backend,
    require_cuda,
)

__all__ = ["NcclTransport"]

_POLL_SECONDS = 0.005


@register_transport
class NcclTransport(RoundsTransport):
    name = "nccl"
    preference = 20
    needs_cuda = True
    backend = "nccl"

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__(group, device)
        require_cuda(device, "nccl")
        require_backend(group, "nccl", "nccl", "sends its messages")
        # Batched P2P needs the group's communicator to exist on every rank before the
        # first batch, which idle ranks never post: create it now, collectively.
        dist.all_reduce(torch.zeros(1, device=device), group=group)
        self._peers: set[int] = set()  # peers of the refit being queued
        self._watchdog: _Watchdog | None = None

    @classmethod
    def available(cls) -> Availability:
        return Availability.first_missing([
            (dist.is_available() and dist.is_nccl_available(), "this torch build has no NCCL"),
            (torch.cuda.is_available(), "no CUDA GPU is visible"),
        ])

    def wire_device(self) -> torch.device:
        return self.device

    def start(self, sends: Exchange, recvs: Exchange) -> object:
        self._peers.update(p for p, _ in (*sends, *recvs))
        ops = [dist.P2POp(dist.isend, t, self.global_rank(p), self.group) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.global_rank(p), self.group) for p, t in recvs]
        if not ops:
            return []
        try:
            return dist.batch_isend_irecv(ops)
        except Exception as e:
            raise self.peer_error(min(p for p, _ in (*sends, *recvs)), "exchange", e) from e

    def finish(self, handle: object) -> None:
        for w in handle:  # type: ignore[union-attr]
            try:
                w.wait()  # the caller's stream waits; the host does not
            except Exception as e:
                raise TransportError(f"nccl: a round with ranks {sorted(self._peers)} failed: "
                                     f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                                     ranks=sorted(self._peers), rule="transport") from e

    def watch(self) -> None:
        peers, self._peers = sorted(self._peers), set()
        if not peers or self.timeout is None:
            return
        if self._watchdog is None:
            self._watchdog = _Watchdog(self)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._watchdog.put(event, time.monotonic() + self.timeout, peers)

    def raise_if_failed(self) -> None:
        if self._watchdog is not None and self._watchdog.error is not None:
            raise self._watchdog.error

    def abort(self) -> None:
        """End every NCCL operation of the group (blocked kernels return)."""
        try:
            self.group._get_backend(self.device).abort()  # type: ignore[attr-defined]
        except Exception:
            dist.distributed_c10d._abort_process_group(self.group)

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None


class _Watchdog:
    """One daemon thread per transport: polls the events of queued refits in order and
    aborts the communicator when one is not done by its deadline."""

    def __init__(self, transport: NcclTransport) -> None:
        self.transport = transport
        self.error: TransportError | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="torchrefit-nccl-watchdog", daemon=True)
        self._thread.start()

    def put(self, event: torch.cuda.Event, deadline: float, peers: list[int]) -> None:
        self._queue.put((event, deadline, peers))

    def stop(self) -> None:
        self._queue.put(None)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            event, deadline, peers = item
            while not event.query():
                if time.monotonic() > deadline:
                    self.error = TransportError(
                        f"nccl: a refit exchanging with ranks {peers} did not complete within the "
                        f"timeout of {self.transport.timeout} s (a peer died or stopped); the "
                        "communicator was aborted, this rank's destination may be partly "
                        "updated: rebuild the process group and the Refitter",
                        ranks=peers, rule="timeout")
                    self.transport.abort()
                    return
                time.sleep(_POLL_SECONDS)
