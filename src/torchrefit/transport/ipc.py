"""CUDA IPC transport (pull): receivers copy straight out of the senders' GPU memory.

For processes on one machine (collocated trainer and engine processes sharing
GPUs, the common RL layout). A sender exports its source tensors once per
compiled program, per allocation segment of PyTorch's caching allocator, not per
tensor: one ``_share_cuda_()`` handle per segment plus each tensor's byte offset,
dtype, shape and strides. A receiver opens each segment once (again only when a
sender's storage moves to a segment it has not opened) and then copies its
regions device to device on its own streams, like local copies: the executor
captures them in a CUDA graph.

Ordering (``order``):

* ``"word"`` (default): the control words of the mailbox (``transport.one_sided.mailbox``, a
  page of host shared memory) are registered with CUDA, and each side's *stream*
  writes its word: the sender's after everything queued before ``refit()`` (its
  producer, the optimizer step), the receiver's after its copies. The peer's host
  polls the word, so seeing it is the order: the receiver launches its copies once
  the sender's producer finished, and the sender's ``refit()`` returns once the
  receiver's copies finished. No interprocess event is recorded or waited for, and
  no wait is queued in one process's context on work of another's, which a GPU
  time-sliced between processes pays as context switches. A word is one ``cuStreamWriteValue64`` (:class:`StreamWords`).
* ``"event"``: interprocess CUDA events, with the host writing the words (what
  ``"word"`` falls back to for a peer without a mailbox, e.g. with
  ``settings.mailbox`` off). *ready*: the sender records its event after its
  producer; the receiver waits for it (``ready_wait``): ``"stream"`` (default), its stream waits, or ``"host"``, its
  host polls the event and then launches its copies. *done*: the receiver records
  its event after queuing its copies; the sender waits (``done_wait``):
  ``"host"`` (default) polls it, so ``refit()`` returns on
  the sender once the copies finished, or ``"stream"``: its stream waits and the
  host returns at once. On a GPU shared without MPS the stream wait costs a context
  switch when it resolves, which the host's polling does not.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._util.cuda_driver import driver_function
from ..errors import TransportError
from ..layout._types import dtype_from_name, dtype_name
from .base import Availability, register_transport, require_cuda
from .one_sided.mailbox import Mailbox
from .one_sided.protocol import WORD, OneSidedTransport, Table

__all__ = ["IpcTransport", "Segment", "Exported", "StreamWords", "export_segments"]

_EVENT_BYTES = 64  # cudaIpcEventHandle_t
_WAITS = ("stream", "host")  # how this rank waits for a peer's interprocess event
_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: the device may write the mailbox's pages
_CUDA_SUCCESS, _CUDA_ERROR_NOT_READY = 0, 600  # cuStreamQuery: all work done / some pending


@dataclass(frozen=True)
class Segment:
    """One exported allocation segment: ``torch.UntypedStorage._share_cuda_()``'s fields
    for a storage inside it, rebased so the storage it opens spans ``nbytes`` from
    the segment's base."""

    share: tuple  # (device, handle, size, offset, ref handle, ref offset, event handle, event sync)
    nbytes: int

    @property
    def handle(self) -> bytes:
        return self.share[1]


@dataclass(frozen=True)
class Exported:
    """An exported tensor: its segment, byte offset there, dtype, shape and strides."""

    segment: int
    offset: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def export_segments(tensors: Sequence[torch.Tensor]) -> tuple[tuple[Segment, ...], tuple[Exported, ...]]:
    """Export ``tensors`` per allocation segment: one IPC handle per segment they occupy.

    Segments come from the caching allocator's snapshot; a tensor outside every
    listed segment (memory the allocator does not own) is exported on its own. Under
    ``expandable_segments:True`` torch shares a storage as the mapped pieces that hold
    it, not as its segment: such a handle opens those pieces only, so it is used for
    the tensors of that storage's pieces alone (never grown to the segment's other
    tensors, which would open unmapped addresses), found by its handle, not the snapshot.
    """
    starts, sizes = _segments()
    by_base: dict[object, int] = {}  # segment base, or (pieces' handle, their base)
    segments: list[list] = []  # [share fields, base address, end address]
    out = []
    for t in tensors:
        ptr, end = t.data_ptr(), t.data_ptr() + _extent(t)
        i = bisect.bisect_right(starts, ptr) - 1
        base = starts[i] if i >= 0 and ptr < starts[i] + sizes[i] else None
        index = by_base.get(base) if base is not None else None
        if index is None:
            storage = t.untyped_storage()
            share = _share(storage)
            base = storage.data_ptr() - share[3]
            key = (share[1], base) if _pieces(share) else base
            index = by_base.get(key)
            if index is None:
                index = by_base[key] = len(segments)
                segments.append([share, base, end])
        seg = segments[index]
        seg[2] = max(seg[2], end)
        out.append(Exported(index, ptr - seg[1], dtype_name(t.dtype), tuple(t.shape), tuple(t.stride())))
    # the opened storage spans from the segment's base to the end of the last tensor in it
    exported = tuple(Segment(tuple(share[:2]) + (end - base, 0) + tuple(share[4:]), end - base)
                     for share, base, end in segments)
    return exported, tuple(out)


def _open_hint(segment: Segment) -> str:
    if not _pieces(segment.share):
        return ""
    return (" (memory of expandable_segments:True: torch opens it through pidfd_getfd, which needs "
            "Linux >= 5.6 and ptrace access to the peer's process; allocate the weights with "
            "expandable_segments:False (torch.cuda.memory._set_allocator_settings), or pick another transport)")


def _share(storage: torch.UntypedStorage) -> tuple:
    return storage._share_cuda_()


def _pieces(share: tuple) -> bool:
    """Whether torch shared the storage as an expandable segment's pieces: its handle is
    a version byte, then ``b"e"`` (``b"c"``: a cudaMalloc allocation's IPC handle)."""
    return share[1][1:2] == b"e"


def _segments() -> tuple[list[int], list[int]]:
    segs = sorted((s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot())
    return [a for a, _ in segs], [n for _, n in segs]


def _extent(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


@register_transport
class IpcTransport(OneSidedTransport):
    name = "ipc"
    pull = True
    mailbox = True  # one host: headers and done tokens as shared-memory words (transport.one_sided.mailbox)
    turns = True  # ranks copying on one shared GPU take turns (transport.turns)
    delegate = True  # ... or, where they can, the first copies for all (transport.delegates)
    preference = 30  # no message pools and no packing: copies at the device's copy bandwidth
    needs_cuda = True
    one_host = True

    def __init__(self, group: dist.ProcessGroup, device: torch.device, done_wait: str | None = None,
                 ready_wait: str | None = None, order: str | None = None) -> None:
        require_cuda(device, "ipc")
        self.order = _mode("order", order or "word", ("word", "event"))
        self.done_wait = _mode("done_wait", done_wait or "host", _WAITS)
        self.ready_wait = _mode("ready_wait", ready_wait or "stream", _WAITS)
        super().__init__(group, device)
        # two events, one per role, so a rank that both sends and receives never makes
        # its readers wait for its own reads
        self._ready = torch.cuda.Event(interprocess=True)  # sender: sources are final
        self._done = torch.cuda.Event(interprocess=True)  # receiver: regions were read
        self._ready_handle = _fixed(self._ready.ipc_handle())
        self._done_handle = _fixed(self._done.ipc_handle())
        self._peer_events: dict[bytes, torch.cuda.Event] = {}
        self._opened: dict[bytes, torch.UntypedStorage] = {}  # segment handle -> storage

    @classmethod
    def available(cls) -> Availability:
        return Availability.first_missing([
            (dist.is_available() and dist.is_gloo_available(), "this torch build has no Gloo (control messages)"),
            (torch.cuda.is_available(), "no CUDA GPU is visible"),
        ])

    # ------------------------------------------------------------- registering
    def expose(self, tensors: Sequence[torch.Tensor]) -> object:
        return export_segments([t.detach() for t in tensors])

    def attach(self, peer: int, table: Table) -> tuple:
        (segments, exported), regions = table
        storages = [self._open(peer, s) for s in segments]
        tensors = [torch.empty(0, dtype=dtype_from_name(e.dtype), device=self.device).set_(
            storages[e.segment], e.offset // dtype_from_name(e.dtype).itemsize, e.shape, e.stride)
            for e in exported]
        return tuple(tensors[i][box.slices()] for i, box in regions)

    def _open(self, peer: int, segment: Segment) -> torch.UntypedStorage:
        storage = self._opened.get(segment.handle)
        if storage is None or storage.nbytes() < segment.nbytes:
            try:
                storage = torch.UntypedStorage._new_shared_cuda(*segment.share)
            except RuntimeError as e:
                raise TransportError(f"ipc: rank {self.rank} cannot open {segment.nbytes} bytes of rank "
                                     f"{peer}'s GPU memory{_open_hint(segment)}: {e}") from e
            self._opened[segment.handle] = storage
        return storage

    # ---------------------------------------------------------------- ordering
    def ready(self) -> bytes:
        if self.order == "word" and self.own_stream_words():
            return WORD  # the header word, written by this stream after the producer
        return self.event_token("ready")

    def wait_ready(self, peer: int, token: bytes) -> None:
        # with a stream word, taking the word was the wait (one_sided.recv_header); else
        # the only thing that keeps a receiver from reading sources the producer has
        # not finished writing (tests/test_gpu_stale_read.py removes it to prove that)
        if token != WORD:
            self._wait_peer(peer, token, self.ready_wait, "ready event (sources final)")

    def done(self) -> bytes:
        return WORD if self.order == "word" else self.event_token("done")

    def wait_done(self, peer: int, token: bytes) -> None:
        # the token (a Gloo message or a mailbox word) came after the peer recorded its
        # event behind its reads: waiting for that record is waiting for the reads
        # (tests/test_gpu_one_sided.py moves the sources right after a refit); a stream
        # word was written after the reads themselves
        if token != WORD:
            self._wait_peer(peer, token, self.done_wait, "done event (reads finished)")

    def event_token(self, role: str) -> bytes:
        event, handle = (self._ready, self._ready_handle) if role == "ready" else (self._done, self._done_handle)
        event.record(torch.cuda.current_stream(self.device))
        return handle

    def stream_writer(self, box: Mailbox) -> StreamWords | None:
        if self.order != "word":
            return None
        try:
            return StreamWords(box, self.device)
        except RuntimeError:  # no driver memops or registration here: this rank orders by events
            return None

    def _wait_peer(self, peer: int, token: bytes, mode: str, what: str) -> None:
        """``mode`` "stream": the current stream waits for the peer's event; "host": poll
        it until it completed (not synchronize(): it measured slower), bounded."""
        event = self._peer_event(token)
        if mode == "stream":
            torch.cuda.current_stream(self.device).wait_event(event)
        elif not self.waits.poll((what, peer), event.query, self.poll_timeout()):
            raise self.peer_error(peer, "receive", TimeoutError(f"its {what} never completed"))

    def _peer_event(self, handle: bytes) -> torch.cuda.Event:
        event = self._peer_events.get(handle)
        if event is None:
            event = self._peer_events[handle] = torch.cuda.Event.from_ipc_handle(self.device, handle)
        return event

    def close(self) -> None:
        super().close()
        self._opened.clear()
        self._peer_events.clear()


class StreamWords:
    """Writes one mailbox's words from the caller's current stream: the mailbox's pages
    are registered with CUDA as mapped host memory, and a word is one
    ``cuStreamWriteValue64`` into them (through the driver library; no kernel, no
    copy). It runs once everything queued before it on the stream finished, behind a
    memory fence, so a host that sees the word may rely on that work. Raises
    RuntimeError where the driver cannot (the transport then orders by events)."""

    def __init__(self, box: Mailbox, device: torch.device) -> None:
        self.device = device
        self._box = box  # keeps the mapping while words are written into it
        self._write, device_pointer, self._query = _driver()
        self._stream = _raw_stream(device)
        with torch.cuda.device(device):
            err = torch.cuda.cudart().cudaHostRegister(box.address, box.nbytes, _HOST_REGISTER_MAPPED)
            if err != 0:
                raise RuntimeError(f"cudaHostRegister of the mailbox failed ({err})")
            weakref.finalize(self, _unregister, box.address, device)  # before the mapping goes (self holds it)
            self._base = device_pointer(box.address)

    def __call__(self, index: int, value: int) -> None:
        # The stream's raw handle and the driver's query, not torch's Stream object and
        # its query(): a sender's ready word is on the refit's critical path, right after
        # its host waited, caches cold, where torch.cuda.current_stream's Python alone
        # costs tens of microseconds
        stream = self._stream()
        rc = self._query(stream)
        if rc == _CUDA_SUCCESS:
            # everything queued before has finished: the host stores the word now, rather
            # than queue a write that needs this process's context to get a time slice of a
            # GPU busy with other processes' copies
            self._box.store(index, value)
            return
        if rc != _CUDA_ERROR_NOT_READY:  # e.g. no context current on this thread: torch's query binds it
            if torch.cuda.current_stream(self.device).query():
                self._box.store(index, value)
                return
        rc = self._write(stream, self._base + 8 * index, value, 0)
        if rc:
            raise TransportError(f"ipc: cuStreamWriteValue64 into the mailbox failed (CUresult {rc})")


def _raw_stream(device: torch.device) -> Callable[[], int]:
    """The raw ``cudaStream_t`` of ``device``'s current stream, as an int, per call:
    torch's C accessor where this build has it (CUDA builds), else through the Stream."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return functools.partial(raw, device.index if device.index is not None else torch.cuda.current_device())
    return lambda: torch.cuda.current_stream(device).cuda_stream


def _driver() -> tuple:
    """``cuStreamWriteValue64``, a host -> device pointer function and ``cuStreamQuery``
    from libcuda."""
    write = driver_function("cuStreamWriteValue64", [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint])
    get = driver_function("cuMemHostGetDevicePointer", [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p,
                                                        ctypes.c_uint])
    query = driver_function("cuStreamQuery", [ctypes.c_void_p])

    def device_pointer(address: int) -> int:
        out = ctypes.c_uint64()
        rc = get(ctypes.byref(out), ctypes.c_void_p(address), 0)
        if rc:
            raise RuntimeError(f"cuMemHostGetDevicePointer failed (CUresult {rc})")
        return out.value

    return write, device_pointer, query


def _unregister(address: int, device: torch.device) -> None:
    try:
        torch.cuda.synchronize(device)  # a word still queued would land in pages no longer registered
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # noqa: BLE001 (at exit CUDA may be gone; the pages go with the process)
        pass


def _mode(what: str, mode: str, allowed: tuple[str, ...]) -> str:
    if mode not in allowed:
        raise TransportError(f"ipc: {what} must be {' or '.join(map(repr, allowed))}, not {mode!r}")
    return mode


def _fixed(handle: bytes) -> bytes:
    if len(handle) != _EVENT_BYTES:
        raise TransportError(f"ipc: unexpected CUDA event handle of {len(handle)} bytes")
    return handle
