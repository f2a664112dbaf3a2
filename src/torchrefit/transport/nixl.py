"""NIXL transport (push): senders WRITE into the receivers' registered memory.

Optional extra ``nixl-cu13`` (imports as ``nixl_cu13``), UCX backend. Each rank
runs one NIXL agent. GPU tensors are registered as NIXL's "VRAM", CPU tensors as
"DRAM" (UCX's shared-memory transports between processes on one host; no GPU
needed). A receiver registers its destination tensors (their storages, once per
compiled program) and sends the agent's metadata with the tensors' addresses,
dtypes, shapes and strides; a sender registers its sources, loads the receiver's
metadata again only when that table changes (a storage moved), and builds one
WRITE request per receiver's table and its own compiled views, from the regions'
common contiguous runs, then re-posts it every refit with a notification.

A storage stays registered while it lives: once freed (its program compiled again
after a move) it is deregistered, so that memory allocated later at its address is
registered afresh (NIXL refused transfers over such stale registrations, and an
RDMA registration pins the pages of what was there before). Ordering:

* ready: the receiver's host waits for its current stream (its engine's reads of
  the old weights) before telling the sender to go; the sender's host waits for
  its own current stream (the producer) before posting: NIXL writes are
  host-initiated and outside stream order;
* done: the sender waits until its writes completed (its sources may then change);
  the receiver waits for the WRITE's notification, which NIXL delivers after the
  data landed.

Both waits poll from the host (``base.poll_until``), and each poll progresses UCX's
worker; NIXL's own progress thread is off unless ``progress_thread=True``: with it on,
the thread and the polls contend for the worker's lock, and a poll that loses waits for
the thread's whole pass instead of progressing the worker itself. A wait gives up after
``settings.nixl_timeout`` seconds (environment: ``TORCHREFIT_NIXL_TIMEOUT``), else the
Refitter's ``timeout``.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .. import settings
from .._util.strides import dense_rows, row_offsets
from ..errors import TransportError
from ..layout._types import dtype_from_name, dtype_name
from .base import Availability, host_wait_current, register_transport
from .one_sided.protocol import OneSidedTransport, Table

__all__ = ["NixlTransport", "RemoteRegion", "contiguous_runs"]

#: WRITE requests kept per peer (a refit's, a stage's and a verify's table, many times over)
_REQUESTS = 16


@dataclass(frozen=True)
class RemoteRegion:
    """A region of a peer's registered tensor: base address, strides and shape (elements)."""

    address: int
    device: int
    memory: str  # NIXL's memory type: "VRAM" or "DRAM"
    itemsize: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str


def contiguous_runs(a: tuple[int, tuple, tuple], b: tuple[int, tuple, tuple], itemsize: int
                    ) -> tuple[list[int], list[int], int]:
    """Start addresses of the runs two strided regions ``(address, shape, stride)`` of
    as many elements have contiguous in common (row-major), and the run length in bytes.
    Where the shapes differ (a stacked experts tensor's ``[1, r, c]`` slice written from
    an ``[r, c]`` weight), ``a``'s elements are taken in ``b``'s shape, as ``a.view(b's
    shape)`` would; ``ValueError`` where no such view exists."""
    (addr_a, shape_a, stride_a), (addr_b, shape, stride_b) = a, b
    if tuple(shape_a) != tuple(shape):
        stride_a = _viewed(shape_a, stride_a, shape)
    outer, sa, sb, inner = dense_rows(shape, stride_a, stride_b)
    if not outer:
        return [addr_a], [addr_b], inner * itemsize
    return (row_offsets(outer, [x * itemsize for x in sa], addr_a).tolist(),
            row_offsets(outer, [x * itemsize for x in sb], addr_b).tolist(), inner * itemsize)


def _viewed(shape: Sequence[int], stride: Sequence[int], as_shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a ``shape`` / ``stride`` region viewed as ``as_shape`` (torch's own
    rule, on a meta tensor: no memory)."""
    try:
        return torch.empty_strided(tuple(shape), tuple(stride), device="meta").view(tuple(as_shape)).stride()
    except RuntimeError as e:
        raise ValueError(f"a {tuple(shape)} region at strides {tuple(stride)} cannot be viewed as "
                         f"{tuple(as_shape)}") from e


def _nixl_failures(what: str) -> Callable:
    """Decorator of a primitive: NIXL's own exceptions (a peer that died or left, a
    refused registration) become :class:`TransportError` naming the peer, the primitive's
    first argument where it has one, so that the Refitter fails the refit as for any
    other transport instead of a raw backend error escaping it."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(self: NixlTransport, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except self._errors as e:
                peer = args[0] if args and isinstance(args[0], int) else None
                where = "" if peer is None else f" with rank {peer}"
                raise TransportError(f"nixl: {what}{where} failed ({type(e).__name__}: {e}); a peer that "
                                     "died or left fails every later refit of this Refitter",
                                     ranks=() if peer is None else (peer,), rule="nixl failure") from e
        return call
    return wrap


class _Registration:
    """One registered storage: its NIXL descriptor and memory type, and a finalizer per
    live storage object at its address (more than one only where storages alias)."""

    def __init__(self, desc: tuple[int, int, int, str], memory: str) -> None:
        self.desc, self.memory = desc, memory
        self._finalizers: list[tuple[weakref.ref, weakref.finalize]] = []

    def holds(self, storage: torch.UntypedStorage) -> bool:
        return any(ref() is storage for ref, _ in self._finalizers)

    def watch(self, storage: torch.UntypedStorage, freed: list[int]) -> None:
        """Queue this address on ``freed`` when ``storage`` is freed."""
        f = weakref.finalize(storage, freed.append, self.desc[0])
        f.atexit = False  # nothing to queue while the interpreter exits
        self._finalizers.append((weakref.ref(storage), f))

    def adopt(self, smaller: _Registration) -> None:
        """Watch the storages ``smaller`` watched (this one covers them)."""
        self._finalizers += smaller._finalizers

    def release(self) -> bool:
        """Forget the storages freed; True where none is left."""
        self._finalizers = [(ref, f) for ref, f in self._finalizers if f.alive]
        return not self._finalizers

    def cancel(self) -> None:
        for _, f in self._finalizers:
            f.detach()


@register_transport
class NixlTransport(OneSidedTransport):
    name = "nixl"
    pull = False
    preference = 10
    # CPU tensors by name only: "auto" keeps gloo there (a process's first NIXL agent
    # costs a large part of a second to start, more than gloo's whole refit of a small model)
    auto_on_cpu = False

    def __init__(self, group: dist.ProcessGroup, device: torch.device, progress_thread: bool = False) -> None:
        super().__init__(group, device)
        import nixl_cu13
        from nixl_cu13._api import nixl_agent, nixl_agent_config

        bindings = getattr(nixl_cu13, "_bindings", None)
        self._errors = tuple(c for n, c in vars(bindings or object).items()
                             if n.startswith("nixl") and isinstance(c, type) and issubclass(c, Exception))

        self._name = f"torchrefit-{self.rank}-{os.getpid()}-{id(self):x}"
        self._agent = nixl_agent(self._name, nixl_agent_config(enable_prog_thread=progress_thread,
                                                               backends=["UCX"]))
        # storage address -> its registration, while a storage registered there lives
        self._registered: dict[int, _Registration] = {}
        self._freed: list[int] = []  # addresses whose registered storage was freed since
        self._remote_agents: dict[int, str] = {}  # peer -> loaded agent name
        # (peer, id of its regions) -> those regions, the local views and their WRITE request
        self._requests: dict[tuple[int, int], tuple[tuple, Sequence[torch.Tensor], object]] = {}
        self._posted: list = []
        # tagged with this rank in the refit group, which the receiver knows it by (not the
        # default group's rank: a trainer and an engine job joined by tr.connect each
        # have their own default group, so those ranks repeat)
        self._notif = b"torchrefit:%d" % self.rank
        self._pending_notifs: list[bytes] = []  # notifications that arrived for a later wait

    @classmethod
    def available(cls) -> Availability:
        return Availability.first_missing([
            (dist.is_available() and dist.is_gloo_available(), "this torch build has no Gloo (control messages)"),
            (importlib.util.find_spec("nixl_cu13") is not None,
             "the nixl-cu13 package is not installed (pip install 'torchrefit[nixl]')"),
        ])

    # ------------------------------------------------------------- registering
    def _register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register each tensor's storage once while it lives. A storage registered here
        is deregistered once freed (``_release_freed``): memory allocated later at its
        address (new pages, a new allocation) is registered afresh, never reached through
        a registration of what was there before."""
        self._release_freed()
        new: dict[str, list] = {}
        for t in tensors:
            s = t.untyped_storage()
            addr, nbytes = s.data_ptr(), s.nbytes()
            reg = self._registered.get(addr)
            if nbytes == 0 or (reg is not None and reg.holds(s)):
                continue
            if reg is not None and reg.desc[1] >= nbytes:  # another storage object aliasing it
                reg.watch(s, self._freed)
                continue
            desc = (addr, nbytes, _device_id(t), "")
            grown = _Registration(desc, _memory(t))
            if reg is not None:  # a larger storage aliasing the one registered: register it whole
                self._agent.deregister_memory(self._agent.get_reg_descs([reg.desc], reg.memory))
                grown.adopt(reg)  # deregistered only once both are freed
            grown.watch(s, self._freed)
            self._registered[addr] = grown
            new.setdefault(_memory(t), []).append(desc)
        for memory, regions in new.items():
            self._agent.register_memory(regions, memory)

    def _release_freed(self) -> None:
        """Deregister the storages freed since the last call (each finalizer queued its
        address; the deregistration runs here, in this transport's own calls)."""
        while self._freed:
            addr = self._freed.pop()
            reg = self._registered.get(addr)
            if reg is not None and reg.release():
                self._deregister(addr)

    def _deregister(self, addr: int) -> None:
        reg = self._registered.pop(addr)
        reg.cancel()
        self._agent.deregister_memory(self._agent.get_reg_descs([reg.desc], reg.memory))

    @_nixl_failures("registering this rank's tensors")
    def expose(self, tensors: Sequence[torch.Tensor]) -> object:
        self._register(tensors)
        return (self._agent.get_agent_metadata(),
                tuple((t.data_ptr(), _device_id(t), _memory(t), t.element_size(), tuple(t.shape),
                       tuple(t.stride()), dtype_name(t.dtype)) for t in tensors))

    def attach(self, peer: int, table: Table) -> tuple:  # its failures: OneSidedTransport._attach_table
        (metadata, tensors), regions = table
        for key in [k for k in self._requests if k[0] == peer]:
            self._requests.pop(key)[2].release()  # requests of the peer's older table
        old = self._remote_agents.pop(peer, None)
        if old is not None:  # its registrations changed: load its metadata afresh
            self._agent.remove_remote_agent(old)
        self._remote_agents[peer] = self._agent.add_remote_agent(metadata)
        out = []
        for i, box in regions:
            addr, dev, memory, itemsize, _, stride, dtype = tensors[i]
            start = addr + sum(o * s for o, s in zip(box.offset, stride)) * itemsize
            out.append(RemoteRegion(start, dev, memory, itemsize, tuple(box.size), tuple(stride), dtype))
        return tuple(out)

    def narrow(self, region: RemoteRegion, nbytes: int) -> RemoteRegion:
        return replace(region, shape=(nbytes // region.itemsize,))

    def region_bytes(self, region: RemoteRegion) -> int:
        return math.prod(region.shape) * region.itemsize

    # ------------------------------------------------------------------ writing
    @_nixl_failures("the WRITE")
    def write(self, peer: int, local: Sequence[torch.Tensor], remote: tuple) -> None:
        # one request per table and local views, re-posted every refit: views compiled
        # again (this rank's sources moved while the peer's table stayed) need a new one,
        # or the WRITE would read the old storage
        key = (peer, id(remote))
        cached = self._requests.get(key)
        if cached is not None and cached[0] is remote and cached[1] is local:
            request = cached[2]
        else:
            if cached is not None:
                cached[2].release()
            request = self._request(peer, local, remote)
            self._requests[key] = (remote, local, request)
            self._forget_requests(peer)
        if self._agent.transfer(request, self._notif) == "ERR":
            raise TransportError(f"nixl: posting the WRITE to rank {peer} failed")
        self._posted.append((peer, request))

    def _forget_requests(self, peer: int) -> None:
        """Release ``peer``'s oldest requests beyond :data:`_REQUESTS` (none posted since
        the last ``finish_writes``): delta refits write other lengths of their slots each
        call (``execute.delta_one_sided``), a request each, never posted again."""
        posted = {id(r) for _, r in self._posted}
        mine = [k for k, v in self._requests.items() if k[0] == peer and id(v[2]) not in posted]
        for key in mine[: max(0, len(mine) - _REQUESTS)]:
            self._requests.pop(key)[2].release()

    def _request(self, peer: int, local: Sequence[torch.Tensor], remote: tuple):
        """One WRITE request for all regions sent to ``peer``, built once per table."""
        self._register(local)
        src, dst = [], []
        src_memory = {_memory(view) for view in local}
        dst_memory = {r.memory for r in remote}
        if len(src_memory) > 1 or len(dst_memory) > 1:  # one request has one memory type a side
            raise TransportError(f"nixl: the regions sent to rank {peer} mix GPU and CPU memory "
                                 f"({sorted(src_memory)} -> {sorted(dst_memory)})")
        for view, r in zip(local, remote):
            if dtype_from_name(r.dtype) != view.dtype:
                raise TransportError(f"nixl: rank {peer} lands {r.dtype} where this rank sends {view.dtype}")
            try:
                a, b, n = contiguous_runs((view.data_ptr(), tuple(view.shape), tuple(view.stride())),
                                          (r.address, r.shape, r.stride), r.itemsize)
            except ValueError as e:
                raise TransportError(f"nixl: a region this rank writes to rank {peer} does not fit the "
                                     f"one it lands in there: {e}; the plans disagree", ranks=(peer,),
                                     rule="region shape") from e
            dev = _device_id(view)
            src += [(x, n, dev) for x in a]
            dst += [(y, n, r.device) for y in b]
        return self._agent.initialize_xfer("WRITE", self._agent.get_xfer_descs(src, src_memory.pop()),
                                           self._agent.get_xfer_descs(dst, dst_memory.pop()),
                                           self._remote_agents[peer], self._notif)

    def finish_writes(self) -> None:
        deadline = time.monotonic() + self._timeout()
        for peer, request in self._posted:
            self._finish(peer, request, deadline)
        self._posted = []

    @_nixl_failures("completing the WRITE")
    def _finish(self, peer: int, request: object, deadline: float) -> None:
        state = "PROC"

        def finished() -> bool:
            nonlocal state
            state = self._agent.check_xfer_state(request)  # also progresses UCX's worker
            return state != "PROC"

        if not self.waits.poll(("write", peer), finished, max(0.0, deadline - time.monotonic())):
            raise TransportError(f"nixl: the WRITE to rank {peer} did not complete in {self._timeout():.0f} s",
                                 ranks=(peer,), rule="timeout")
        if state != "DONE":
            raise TransportError(f"nixl: the WRITE to rank {peer} failed ({state})")

    # ---------------------------------------------------------------- ordering
    @_nixl_failures("deregistering freed storage")
    def ready(self) -> bytes:
        host_wait_current(self.device)  # the engine's reads of the old weights are done
        if self._freed:  # storages of a program compiled again: no pages stay registered
            self._release_freed()
        return b""

    @_nixl_failures("deregistering freed storage")
    def wait_ready(self, peer: int, token: bytes) -> None:
        if self._freed:
            self._release_freed()
        # NIXL reads the sources outside stream order: the producer must have finished
        # (tests/test_gpu_stale_read.py removes this wait to prove that)
        host_wait_current(self.device)

    def done(self) -> bytes:
        return b""  # finish_writes returned: the sources may change again

    def post_done(self, peer: int, token: bytes) -> None:
        """The WRITE's own notification is the done signal."""

    def recv_done(self, peer: int) -> bytes:
        return b""

    @_nixl_failures("waiting for the notification")
    def wait_done(self, peer: int, token: bytes) -> None:
        want = self._notif_of(peer)
        if not self.waits.poll(("notification", peer), lambda: self._take_notif(want), self._timeout()):
            raise TransportError(f"nixl: no write notification from rank {peer} in {self._timeout():.0f} s",
                                 ranks=(peer,), rule="timeout")

    def _timeout(self) -> float:
        """Seconds a write or a notification may take."""
        limit = settings.current().nixl_timeout
        return limit if limit is not None else self.poll_timeout()

    def _notif_of(self, peer: int) -> bytes:
        return b"torchrefit:%d" % peer

    def _take_notif(self, want: bytes) -> bool:
        for msgs in self._agent.get_new_notifs().values():
            self._pending_notifs.extend(msgs)
        if want in self._pending_notifs:
            self._pending_notifs.remove(want)
            return True
        return False

    def close(self) -> None:
        for _, _, request in self._requests.values():
            request.release()
        self._requests.clear()
        super().close()


def _memory(t: torch.Tensor) -> str:
    """NIXL's memory type of a tensor's storage."""
    return "VRAM" if t.is_cuda else "DRAM"


def _device_id(t: torch.Tensor) -> int:
    return (t.device.index or 0) if t.is_cuda else 0
