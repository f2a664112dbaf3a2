"""The transport interface, its two protocols and the registry.

Every transport is one module with one class registered here by name. A class
speaks one of two protocols, and the executor compiles one program per protocol
(``execute.rounds`` and ``execute.one_sided_program``):

* :class:`RoundsTransport`, message rounds (``nccl``, ``gloo``, ``nvshmem``): per
  round a list of (peer, uint8 tensor) to send and one to receive into; the
  executor packs, unpacks and orders streams, the transport posts and completes.
* ``transport.one_sided.protocol.OneSidedTransport`` (``ipc``, ``nixl``): one
  side reads or writes memory its peer registered, with completion signalled
  separately.
"""

from __future__ import annotations

import datetime
import functools
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from ..errors import TransportError

__all__ = ["Transport", "RoundsTransport", "Availability", "register_transport", "get_transport",
           "transport_names", "registered", "transport_class", "Exchange", "require_backend", "require_cuda",
           "host_wait_current", "poll_until", "spinning", "Waits",
           "Pending", "DEFAULT_TIMEOUT"]

Exchange = list[tuple[int, torch.Tensor]]
#: (peer, "send" | "receive", the backend's work) of one posted round
Pending = list[tuple[int, str, object]]
#: seconds a refit waits for a peer before raising TransportError (Refitter(timeout=...))
DEFAULT_TIMEOUT = 300.0


@dataclass(frozen=True)
class Availability:
    """Whether a transport can run in this process; ``reason`` says why not, plainly."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok

    @staticmethod
    def first_missing(checks: list[tuple[bool, str]]) -> Availability:
        """Unavailable with the reason of the first failed check, else available."""
        for ok, reason in checks:
            if not ok:
                return Availability(False, reason)
        return Availability(True)


class Transport(ABC):
    """What every transport has: its group, its device and group-to-global ranks.

    Constructed collectively (on every rank of the group, in the same order).
    """

    name: ClassVar[str]
    #: "rounds" or "one_sided": which program the executor compiles for it
    protocol: ClassVar[str]
    #: rank order of ``transport="auto"``: the available transport with the highest wins
    preference: ClassVar[int] = 0
    #: what the refit must offer (checked on every rank before any byte moves)
    needs_cuda: ClassVar[bool] = False
    #: ``transport="auto"`` picks it for CPU tensors too (else only by name there)
    auto_on_cpu: ClassVar[bool] = True
    one_host: ClassVar[bool] = False
    backend: ClassVar[str] = "gloo"  # the process-group backend it uses

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        #: seconds to wait for a peer; None: the process group's own timeout (Refitter sets it)
        self.timeout: float | None = DEFAULT_TIMEOUT
        self._global = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))] \
            if group is not dist.GroupMember.WORLD else list(range(dist.get_world_size()))

    @classmethod
    def available(cls) -> Availability:
        """Whether this process can use the transport (package, device, backend)."""
        return Availability.first_missing([(dist.is_available(), "torch.distributed is not available")])

    @classmethod
    def plan_problem(cls, plan) -> str | None:
        """Why this rank's plan cannot go through the transport, or None (checked on
        every rank while planning)."""
        return None

    def prepare(self, plan, message_limit: int) -> None:
        """Collective: called once on every rank of the group right after construction,
        with this rank's plan and the message limit of the rounds, for a transport that
        plans shared state from every rank's plan (nvshmem's inbox). Nothing by default."""

    def global_rank(self, group_rank: int) -> int:
        return self._global[group_rank]

    def close(self) -> None:
        """Release what the transport holds (nothing by default)."""

    def watch(self) -> None:
        """Called by ``Refitter.refit()`` after a refit was queued: a transport whose
        completion the host does not wait for (NCCL) bounds it by ``timeout`` here."""

    def raise_if_failed(self) -> None:
        """Called before each refit: raise the :class:`TransportError` a watch found."""

    # ------------------------------------------------ posting and waiting, wrapped
    def post(self, sends: Exchange, recvs: Exchange,
             op: Callable[[str, int, torch.Tensor], object]) -> Pending:
        """``op(kind, global peer, buffer)`` for every message of a round, backend errors
        (a peer that is gone) raised as :class:`TransportError` naming the peer."""
        pending: Pending = []
        for kind, exchange in (("send", sends), ("receive", recvs)):
            for peer, buf in exchange:
                try:
                    pending.append((peer, kind, op(kind, self.global_rank(peer), buf)))
                except Exception as e:
                    raise self.peer_error(peer, kind, e) from e
        return pending

    def wait(self, pending: Pending) -> None:
        """Wait for posted works, all within ``timeout`` seconds of the call; a peer
        that died or stopped raises :class:`TransportError` naming it."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        for peer, kind, work in pending:
            try:
                if deadline is None:
                    work.wait()  # type: ignore[attr-defined]
                else:
                    left = max(deadline - time.monotonic(), 0.001)
                    work.wait(timeout=datetime.timedelta(seconds=left))  # type: ignore[attr-defined]
            except Exception as e:
                raise self.peer_error(peer, kind, e) from e

    def poll_timeout(self) -> float:
        """Seconds a host poll for a peer may last: ``timeout``, or where that is None
        (the group's own timeout rules Gloo's waits) Gloo's default of 30 minutes, so a
        poll never waits forever for a dead peer."""
        return self.timeout if self.timeout is not None else 1800.0

    def peer_error(self, peer: int, kind: str, e: BaseException) -> TransportError:
        """The error a failed or timed-out message with group rank ``peer`` raises."""
        if isinstance(e, TransportError):
            return e
        way = "to" if kind == "send" else "from"
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        g = self.global_rank(peer)
        # a tr.connect joint group's peers have no rank in this process's default group
        # (c10d holds stand-ins for them): name the group rank alone there
        shown = f" (global rank {g})" if dist.is_initialized() and 0 <= g < dist.get_world_size() else ""
        return TransportError(
            f"{self.name}: {kind} {way} rank {peer}{shown} failed "
            f"or did not complete within the timeout of {self.timeout} s: the peer died, stopped "
            f"or left the refit ({type(e).__name__}: {detail[:300]}). This rank's destination "
            "may be partly updated; the group is unusable for refits: rebuild it and the Refitter",
            ranks=(peer,), rule="timeout")


class RoundsTransport(Transport):
    """Two-sided message rounds: ``start`` posts one round and returns a handle;
    ``finish`` completes it so that, for work the caller queues afterwards, received
    bytes are in place and sent buffers may be reused."""

    protocol = "rounds"
    #: bytes handed to ``start`` must be complete on the host (a CPU transport fed from GPU)
    host_staged: ClassVar[bool] = False

    @abstractmethod
    def wire_device(self) -> torch.device:
        """Where message buffers live."""

    def largest_message(self) -> int | None:
        """The most bytes one message may carry (None: any size)."""
        return None

    @abstractmethod
    def start(self, sends: Exchange, recvs: Exchange) -> object: ...

    @abstractmethod
    def finish(self, handle: object) -> None: ...


def host_wait_current(device: torch.device) -> None:
    """Block the host until work queued so far on ``device``'s current stream is done.

    Used where bytes produced on the GPU must be read by the host (a CPU transport
    fed from GPU tensors). It waits for one stream's event, never the whole device.
    """
    if device.type != "cuda":
        return
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    event.synchronize()


_SPIN_S = 0.005  # a poll spins this long (a dense multi-GB model's copies take a few ms), then naps
_NAP_S = 50e-6
#: around the end a wait is expected (:class:`Waits`), a poll spins from this long before
#: it until this long after 1.5x it, and no more than ``_LATE_S`` after it
_AROUND_S = 0.001
_LATE_S = 0.010


def poll_until(done: Callable[[], bool], timeout: float | None, expected: float | None = None) -> bool:
    """Poll on the host until ``done()`` is true (returns True) or ``timeout`` seconds
    passed (returns False; None: no limit): spinning for the first 5 ms and, where
    ``expected`` (seconds: how long the same wait took last time, :class:`Waits`) is
    given, again around then (:func:`spinning`); napping 50 us between polls otherwise.

    For a cross-process wait on a GPU shared by processes: a wait queued on a stream
    and not yet satisfied makes the GPU switch contexts to resolve it, while polling
    the event from the host queues nothing. ``cudaEventSynchronize`` on an interprocess
    event is slower still.
    """
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    while not done():
        now = time.monotonic()
        if deadline is not None and now > deadline:
            return bool(done())
        if spinning(now - start, expected):
            os.sched_yield()  # returns at once on an idle core; lets the peer run on a busy one
        else:  # a long wait (a large model's copies, a slow peer): stop taking a core from others
            time.sleep(_NAP_S)
    return True


def spinning(elapsed: float, expected: float | None) -> bool:
    """Whether a poll ``elapsed`` seconds into its wait spins rather than naps: in its
    first 5 ms, and from 1 ms before ``expected`` until 1 ms after 1.5x it (at most 11 ms
    after it: a slow peer's long wait is not spun through). A nap of 50 us
    lasts ~0.1 ms with Linux's default timer slack: a wait ending during one returns that
    much late, which a refit's sender pays whenever its receiver's copies outlast the
    first 5 ms (a collocated refit of a multi-GB dense model); spinning around the
    expected end saves that without spinning through a slow peer's wait. Pure."""
    if elapsed < _SPIN_S:
        return True
    if expected is None:
        return False
    return expected - _AROUND_S <= elapsed <= expected + min(0.5 * expected, _LATE_S) + _AROUND_S


class Waits:
    """Host polls that remember how long each kind of wait took (per key: what is
    waited for, from which peer), so that the next one spins around when the last one
    ended instead of napping through it (:func:`poll_until`'s ``expected``). A refit's
    waits repeat with the same copies behind them: each lasts about as long as the last."""

    def __init__(self) -> None:
        self._last: dict[Hashable, float] = {}

    def poll(self, key: Hashable, done: Callable[[], bool], timeout: float | None) -> bool:
        start = time.monotonic()
        if not poll_until(done, timeout, self._last.get(key)):
            return False
        self._last[key] = time.monotonic() - start
        return True

    def last(self, key: Hashable) -> float | None:
        """Seconds the last completed wait of ``key`` took, or None."""
        return self._last.get(key)

    def poller(self, key: Hashable) -> Callable[[Callable[[], bool], float | None], bool]:
        """``poll`` for one key, in ``poll_until``'s form (what ``Mailbox.take`` and
        ``Turn.wait`` call)."""
        return functools.partial(self.poll, key)


def require_backend(group: dist.ProcessGroup, backend: str, transport: str, use: str) -> None:
    """Raise unless ``group`` has ``backend`` (alone or in a mixed ``cpu:...,cuda:...``)."""
    have = str(dist.get_backend(group))
    if backend not in have:
        raise TransportError(
            f"the {transport} transport {use} over {backend}; the refit group's backend is "
            f"{have!r} (create it with backend='cpu:gloo,cuda:nccl' or pass a {backend} group)"
        )


def require_cuda(device: torch.device, transport: str) -> None:
    if device.type != "cuda":
        raise TransportError(f"the {transport} transport needs CUDA tensors on every rank that holds a model")


_REGISTRY: dict[str, type[Transport]] = {}


def register_transport(cls: type[Transport]) -> type[Transport]:
    _REGISTRY[cls.name] = cls
    return cls


def transport_names() -> list[str]:
    return sorted(_REGISTRY)


def registered() -> list[type[Transport]]:
    """Every registered transport class, most preferred first."""
    return sorted(_REGISTRY.values(), key=lambda c: (-c.preference, c.name))


def transport_class(name: str) -> type[Transport]:
    """The class registered as ``name``, available or not."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise TransportError(
            f"unknown transport {name!r}; registered: {transport_names()}"
        ) from None


def get_transport(name: str) -> type[Transport]:
    """The class registered as ``name``; raises, saying why, where it cannot run here."""
    cls = transport_class(name)
    ok = cls.available()
    if not ok:
        raise TransportError(f"transport {name!r} is not available on this machine: {ok.reason}")
    return cls
