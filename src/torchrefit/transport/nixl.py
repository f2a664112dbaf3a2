"""NIXL transport (push): senders WRITE into the receivers' registered GPU memory.

Optional extra ``nixl-cu13`` (imports as ``nixl_cu13``), UCX backend. Each rank
runs one NIXL agent. A receiver registers its destination tensors (their
storages, once per compiled program) and sends the agent's metadata with the
tensors' addresses, dtypes, shapes and strides; a sender registers its sources,
loads the receiver's metadata again only when that table changes (a storage
moved), and builds one WRITE request per receiver once, from the regions' common
contiguous runs, then re-posts it every refit with a notification. Ordering:

* ready: the receiver's host waits for its current stream (its engine's reads of
  the old weights) before telling the sender to go; the sender's host waits for
  its own current stream (the producer) before posting: NIXL writes are
  host-initiated and outside stream order;
* done: the sender waits until its writes completed (its sources may then change);
  the receiver waits for the WRITE's notification, which NIXL delivers after the
  data landed.

Both waits poll from the host (``base.poll_until``), and each poll progresses UCX's
worker; NIXL's own progress thread is off unless ``TORCHREFIT_NIXL_PROGRESS_THREAD=1``
(or ``progress_thread=True``): with it on, it and the polls contend for the worker. On
one H200, two processes, the seed's model: 9.99 ms with the thread, 5.68 ms without
(BENCHMARKS.md, "Tenth session").
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._strides import dense_rows, row_offsets
from ..errors import TransportError
from ..layout._types import dtype_from_name, dtype_name
from .base import Availability, host_wait_current, poll_until, register_transport, require_cuda
from .one_sided import OneSidedTransport, Table

__all__ = ["NixlTransport", "RemoteRegion", "contiguous_runs"]

_TIMEOUT_S = float(os.environ.get("TORCHREFIT_NIXL_TIMEOUT", "300"))


@dataclass(frozen=True)
class RemoteRegion:
    """A region of a peer's registered tensor: base address, strides and shape (elements)."""

    address: int
    device: int
    itemsize: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str


def contiguous_runs(a: tuple[int, tuple, tuple], b: tuple[int, tuple, tuple], itemsize: int
                    ) -> tuple[list[int], list[int], int]:
    """Start addresses of the runs two equally shaped strided regions ``(address, shape,
    stride)`` have contiguous in common (row-major), and the run length in bytes."""
    (addr_a, shape, stride_a), (addr_b, _, stride_b) = a, b
    outer, sa, sb, inner = dense_rows(shape, stride_a, stride_b)
    if not outer:
        return [addr_a], [addr_b], inner * itemsize
    return ((row_offsets(outer, sa) * itemsize + addr_a).tolist(),
            (row_offsets(outer, sb) * itemsize + addr_b).tolist(), inner * itemsize)


@register_transport
class NixlTransport(OneSidedTransport):
    name = "nixl"
    pull = False
    preference = 10
    needs_cuda = True

    def __init__(self, group: dist.ProcessGroup, device: torch.device, progress_thread: bool | None = None) -> None:
        require_cuda(device, "nixl")
        super().__init__(group, device)
        from nixl_cu13._api import nixl_agent, nixl_agent_config

        if progress_thread is None:
            progress_thread = os.environ.get("TORCHREFIT_NIXL_PROGRESS_THREAD", "0") == "1"
        self._name = f"torchrefit-{dist.get_rank()}-{os.getpid()}-{id(self):x}"
        self._agent = nixl_agent(self._name, nixl_agent_config(enable_prog_thread=progress_thread,
                                                               backends=["UCX"]))
        self._registered: dict[int, int] = {}  # storage address -> registered bytes
        self._remote_agents: dict[int, str] = {}  # peer -> loaded agent name
        self._requests: dict[tuple, object] = {}  # (peer, id of its regions) -> WRITE request
        self._posted: list = []
        self._notif = b"torchrefit:%d" % dist.get_rank()
        self._pending_notifs: list[bytes] = []  # notifications that arrived for a later wait

    @classmethod
    def available(cls) -> Availability:
        return Availability.first_missing([
            (dist.is_available() and dist.is_gloo_available(), "this torch build has no Gloo (control messages)"),
            (torch.cuda.is_available(), "no CUDA GPU is visible"),
            (importlib.util.find_spec("nixl_cu13") is not None,
             "the nixl-cu13 package is not installed (pip install 'torchrefit[nixl]')"),
        ])

    # ------------------------------------------------------------- registering
    def _register(self, tensors: Sequence[torch.Tensor]) -> None:
        new = []
        for t in tensors:
            s = t.untyped_storage()
            if self._registered.get(s.data_ptr(), 0) < s.nbytes():
                self._registered[s.data_ptr()] = s.nbytes()
                new.append((s.data_ptr(), s.nbytes(), t.device.index or 0, ""))
        if new:
            self._agent.register_memory(new, "VRAM")

    def expose(self, tensors: Sequence[torch.Tensor]) -> object:
        self._register(tensors)
        return (self._agent.get_agent_metadata(),
                tuple((t.data_ptr(), t.device.index or 0, t.element_size(), tuple(t.shape), tuple(t.stride()),
                       dtype_name(t.dtype)) for t in tensors))

    def attach(self, peer: int, table: Table) -> tuple:
        (metadata, tensors), regions = table
        for key in [k for k in self._requests if k[0] == peer]:
            self._requests.pop(key).release()  # requests of the peer's older table
        old = self._remote_agents.pop(peer, None)
        if old is not None:  # its registrations changed: load its metadata afresh
            self._agent.remove_remote_agent(old)
        self._remote_agents[peer] = self._agent.add_remote_agent(metadata)
        out = []
        for i, box in regions:
            addr, dev, itemsize, _, stride, dtype = tensors[i]
            start = addr + sum(o * s for o, s in zip(box.offset, stride)) * itemsize
            out.append(RemoteRegion(start, dev, itemsize, tuple(box.size), tuple(stride), dtype))
        return tuple(out)

    # ------------------------------------------------------------------ writing
    def write(self, peer: int, local: Sequence[torch.Tensor], remote: tuple) -> None:
        key = (peer, id(remote))
        request = self._requests.get(key)
        if request is None:
            request = self._requests[key] = self._request(peer, local, remote)
        if self._agent.transfer(request, self._notif) == "ERR":
            raise TransportError(f"nixl: posting the WRITE to rank {peer} failed")
        self._posted.append((peer, request))

    def _request(self, peer: int, local: Sequence[torch.Tensor], remote: tuple):
        """One WRITE request for all regions sent to ``peer``, built once per table."""
        self._register(local)
        src, dst = [], []
        for view, r in zip(local, remote):
            if dtype_from_name(r.dtype) != view.dtype:
                raise TransportError(f"nixl: rank {peer} lands {r.dtype} where this rank sends {view.dtype}")
            a, b, n = contiguous_runs((view.data_ptr(), tuple(view.shape), tuple(view.stride())),
                                      (r.address, r.shape, r.stride), r.itemsize)
            dev = view.device.index or 0
            src += [(x, n, dev) for x in a]
            dst += [(y, n, r.device) for y in b]
        return self._agent.initialize_xfer("WRITE", self._agent.get_xfer_descs(src, "VRAM"),
                                           self._agent.get_xfer_descs(dst, "VRAM"),
                                           self._remote_agents[peer], self._notif)

    def finish_writes(self) -> None:
        deadline = time.monotonic() + _TIMEOUT_S
        for peer, request in self._posted:
            self._finish(peer, request, deadline)
        self._posted = []

    def _finish(self, peer: int, request: object, deadline: float) -> None:
        state = "PROC"

        def finished() -> bool:
            nonlocal state
            state = self._agent.check_xfer_state(request)  # also progresses UCX's worker
            return state != "PROC"

        if not poll_until(finished, max(0.0, deadline - time.monotonic())):
            raise TransportError(f"nixl: the WRITE to rank {peer} did not complete in {_TIMEOUT_S:.0f} s")
        if state != "DONE":
            raise TransportError(f"nixl: the WRITE to rank {peer} failed ({state})")

    # ---------------------------------------------------------------- ordering
    def ready(self) -> bytes:
        host_wait_current(self.device)  # the engine's reads of the old weights are done
        return b""

    def wait_ready(self, peer: int, token: bytes) -> None:
        # NIXL reads the sources outside stream order: the producer must have finished
        # (tests/test_gpu_stale_read.py removes this wait to prove that)
        host_wait_current(self.device)

    def done(self) -> bytes:
        return b""  # finish_writes returned: the sources may change again

    def post_done(self, peer: int, token: bytes) -> None:
        """The WRITE's own notification is the done signal."""

    def recv_done(self, peer: int) -> bytes:
        return b""

    def wait_done(self, peer: int, token: bytes) -> None:
        want = self._notif_of(peer)
        if not poll_until(lambda: self._take_notif(want), _TIMEOUT_S):
            raise TransportError(f"nixl: no write notification from rank {peer} in {_TIMEOUT_S:.0f} s")

    def _notif_of(self, peer: int) -> bytes:
        return b"torchrefit:%d" % self.global_rank(peer)

    def _take_notif(self, want: bytes) -> bool:
        for msgs in self._agent.get_new_notifs().values():
            self._pending_notifs.extend(msgs)
        if want in self._pending_notifs:
            self._pending_notifs.remove(want)
            return True
        return False

    def close(self) -> None:
        for request in self._requests.values():
            request.release()
        self._requests.clear()
        super().close()
