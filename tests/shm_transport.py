"""Two one-sided transports over CPU shared memory, for testing the one-sided protocol
(``execute.one_sided_program``) on CPU: ``shm-pull`` (receivers copy out of the senders'
shared storages, as ``ipc`` does on GPUs) and ``shm-push`` (senders write into the
receivers' shared storages, as ``nixl`` does). Tensors must live in shared memory
(``model.share_memory()``). Each rank logs the protocol calls it made, in order,
so tests can check the cross-process ordering without a GPU. ``shm-pull-word``
is ``shm-pull`` ordered as ``ipc`` orders by default: by mailbox words its
"stream" writes (:data:`STREAM`, one worker thread per process standing in for
the GPU stream that runs what was queued before, in order). ``shm-nvshmem`` is
the ``nvshmem`` transport itself (inbox schedule, slots, signals, acknowledgements)
with NVSHMEM's host bindings faked over CPU shared memory.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from torchrefit.layout._types import dtype_from_name, dtype_name
from torchrefit.transport.base import Availability, register_transport
from torchrefit.transport.nvshmem import NvshmemTransport
from torchrefit.transport.one_sided.mailbox import Mailbox
from torchrefit.transport.one_sided.protocol import WORD, OneSidedTransport, Table

LOG: list[str] = []  # this process's protocol calls
#: seconds an initiator dawdles between a target's ready token and its transfer (a
#: test sets it in the process it slows): a target that returned before the transfer shows
INITIATOR_DELAY = 0.0


class _Shm(OneSidedTransport):
    preference = -10  # never chosen by "auto"

    @classmethod
    def available(cls) -> Availability:
        return Availability(True)

    def expose(self, tensors: Sequence[torch.Tensor]) -> object:
        return tuple((t.untyped_storage()._share_filename_cpu_(), t.storage_offset(), tuple(t.shape),
                      tuple(t.stride()), dtype_name(t.dtype)) for t in tensors)

    def attach(self, peer: int, table: Table) -> tuple:
        exposed, regions = table
        LOG.append(f"attach:{peer}")
        tensors = [torch.empty(0, dtype=dtype_from_name(dtype)).set_(
            torch.UntypedStorage._new_shared_filename_cpu(*handle), offset, shape, stride)
            for handle, offset, shape, stride, dtype in exposed]
        return tuple(tensors[i][box.slices()] for i, box in regions)

    def ready(self) -> bytes:
        LOG.append("ready")
        return b"token"

    def wait_ready(self, peer: int, token: bytes) -> None:
        assert token == b"token"
        LOG.append(f"wait_ready:{peer}")
        time.sleep(INITIATOR_DELAY)

    def done(self) -> bytes:
        LOG.append("done")
        return b"done"

    def wait_done(self, peer: int, token: bytes) -> None:
        assert token == b"done"
        LOG.append(f"wait_done:{peer}")


@register_transport
class ShmPull(_Shm):
    name = "shm-pull"
    pull = True
    mailbox = True  # as ipc: control words in host shared memory after a pair's first exchange


@register_transport
class ShmPush(_Shm):
    name = "shm-push"
    pull = False

    def write(self, peer: int, local: Sequence[torch.Tensor], remote: tuple) -> None:
        LOG.append(f"write:{peer}")
        for dst, src in zip(remote, local):
            dst.copy_(src)


@register_transport
class ShmPullTurns(ShmPull):
    """``shm-pull`` where ranks copying on one device take turns (``transport.turns``;
    on CPU every rank of the host copies on "cpu"). Each turn's copies are held
    :attr:`hold` seconds before its word (as a GPU's copies take time), and every turn's
    start and end are logged with ``time.monotonic()`` (one clock for all processes)."""

    name = "shm-pull-turns"
    turns = True
    hold = 0.05

    def wait_turn(self) -> None:
        super().wait_turn()
        LOG.append(f"turn_start:{time.monotonic()}")

    def post_turn(self) -> None:
        time.sleep(self.hold)
        LOG.append(f"turn_end:{time.monotonic()}")
        super().post_turn()


class _Stream:
    """A GPU stream's order on CPU: what is queued runs on one worker thread, in order."""

    def __init__(self) -> None:
        self._worker = ThreadPoolExecutor(1)

    def queue(self, fn: Callable[[], object]) -> Future:
        return self._worker.submit(fn)

    def synchronize(self) -> None:
        self.queue(lambda: None).result()


STREAM = _Stream()  # this process's fake stream


@register_transport
class ShmPullWord(ShmPull):
    """``shm-pull`` ordered by stream-written mailbox words: ``ready()`` and ``done()``
    return :data:`WORD` and :data:`STREAM` writes the words, after whatever a test
    queued on it before (a late producer, late reads)."""

    name = "shm-pull-word"

    def ready(self) -> bytes:
        if self.own_stream_words():
            LOG.append("ready:word")
            return WORD
        return self.event_token("ready")

    def done(self) -> bytes:
        LOG.append("done:word")
        return WORD

    def event_token(self, role: str) -> bytes:
        LOG.append(f"{role}:event")
        return b"token" if role == "ready" else b"done"

    def wait_ready(self, peer: int, token: bytes) -> None:
        assert token in (WORD, b"token"), token
        LOG.append(f"wait_ready:{peer}")

    def wait_done(self, peer: int, token: bytes) -> None:
        assert token in (WORD, b"done"), token
        LOG.append(f"wait_done:{peer}")

    def stream_writer(self, box: Mailbox) -> Callable[[int, int], None]:
        def write(index: int, value: int) -> None:
            STREAM.queue(lambda: box.store(index, value))
        return write


class _SymmetricHeaps:
    """NVSHMEM's host bindings, faked on CPU: every PE's symmetric heap is one row of a
    shared-memory tensor all processes map; a symmetric address is an address in this
    PE's row, and an operation on PE ``pe`` lands at the same offset of row ``pe``.
    Operations run at once on the host (CPU "streams" are program order); waits spin."""

    class Cmp_type:  # noqa: N801 (the bindings' names)
        CMP_GE = 5

    class Signal_op:  # noqa: N801
        SIGNAL_SET = 0

    def __init__(self, rows: torch.Tensor, rank: int, slow: float) -> None:
        self.rows, self.rank = rows, rank
        self.base = rows[rank].data_ptr()
        self.slow = slow  # seconds to dawdle before each wait: a missing wait then shows

    def _at(self, addr: int, pe: int) -> int:
        return self.rows[pe].data_ptr() + (addr - self.base)

    def putmem_signal_on_stream(self, dst, src, nbytes, sig, value, op, pe, stream) -> None:
        LOG.append(f"put:{pe}:{value}")
        ctypes.memmove(self._at(dst, pe), src, nbytes)
        ctypes.c_int64.from_address(self._at(sig, pe)).value = value  # x86: stores stay ordered

    def signal_op_on_stream(self, sig, value, op, pe, stream) -> None:
        LOG.append(f"ack:{pe}:{value}")
        ctypes.c_int64.from_address(self._at(sig, pe)).value = value

    def signal_wait_until_on_stream(self, sig, cmp, value, stream) -> None:
        if self.slow:
            time.sleep(self.slow)
        deadline = time.monotonic() + 120
        while ctypes.c_int64.from_address(sig).value < value:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: signal never reached {value}")
            time.sleep(20e-6)


@register_transport
class ShmNvshmem(NvshmemTransport):
    """The nvshmem transport's schedule, signals and flow control over CPU shared memory."""

    name = "shm-nvshmem"
    needs_cuda = False
    preference = -10
    slow_receiver = 0.0
    shared_place = False  # every rank claims the same "GPU"

    @classmethod
    def available(cls) -> Availability:
        return Availability(True)

    def _where(self) -> tuple[str, str]:
        return "cpu", "pe0" if self.shared_place else f"pe{self.rank}"

    def _allocate(self, nbytes: int) -> torch.Tensor:
        world = torch.distributed.get_world_size(self.group)
        rows = torch.zeros(world, nbytes, dtype=torch.uint8).share_memory_() if self.rank == 0 else None
        handle = [rows.untyped_storage()._share_filename_cpu_() if rows is not None else None]
        torch.distributed.broadcast_object_list(handle, src=self.global_rank(0), group=self.group)
        if rows is None:
            storage = torch.UntypedStorage._new_shared_filename_cpu(*handle[0])
            rows = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (world, nbytes), (nbytes, 1))
        self.fake = _SymmetricHeaps(rows, self.rank, self.slow_receiver)
        torch.distributed.barrier(group=self.group)  # every rank mapped it before rank 0 may drop its handle
        return rows[self.rank]

    def _free(self, heap: torch.Tensor) -> None:
        # collective like nvshmem_free: a rank that skipped close() would leave the others waiting
        assert heap.data_ptr() == self.fake.base, "freed memory that _allocate did not return"
        LOG.append("free")
        torch.distributed.barrier(group=self.group)

    def _bindings(self):
        return self.fake

    def _stream(self) -> int:
        return 0


@register_transport
class ShmPullDelegate(ShmPullTurns):
    """``shm-pull-turns`` where, as with ``ipc``, the first rank copying on a device
    copies for all of them (``transport.delegates``); turns where one cannot."""

    name = "shm-pull-delegate"
    delegate = True


@register_transport
class ShmPullWordDelegate(ShmPullWord):
    """``shm-pull-word`` with a delegate per device (``transport.delegates``): the
    members' header words come from their fake streams, after what a test queued."""

    name = "shm-pull-word-delegate"
    turns = True
    delegate = True
