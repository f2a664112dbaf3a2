"""The NCCL transport's side of a dead peer, on CPU, through a fake communicator.

NCCL cannot pair two ranks on one GPU, and CI has none, so the real case (a peer killed
mid-refit over NCCL) needs two GPUs and is not run here. What is ours is tested: the
rounds posted to the peer, the watchdog thread that polls an event recorded behind the
refit, aborts the communicator once the timeout passes and leaves a ``TransportError``
naming the peer for the next call; the abort's fallback; a refit that completes in time
is never aborted; ``timeout=None`` starts no watchdog. The fake communicator's work
never completes until ``abort()`` (as a kernel blocked on a dead peer), so a watchdog
that did not abort, or aborted early, or named no peer, fails these tests.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from torchrefit.errors import TransportError
from torchrefit.transport import nccl

TIMEOUT = 0.5
SLACK = 10.0  # a loaded 2-core machine: the thread polls every 5 ms but may be descheduled


class _Comm:
    """A fake NCCL communicator (the group's backend): records posts and aborts."""

    def __init__(self, abort_raises: bool = False) -> None:
        self.aborted = threading.Event()
        self.aborts: list[float] = []
        self.posted: list[tuple[str, int]] = []
        self.abort_raises = abort_raises
        self.complete_after: float | None = None  # seconds after a post: a live peer

    def abort(self) -> None:
        self.aborts.append(time.monotonic())
        if self.abort_raises:
            raise RuntimeError("this backend has no abort()")
        self.aborted.set()


class _Event:
    """``torch.cuda.Event`` stand-in: done when the communicator's work ends."""

    def __init__(self, comm: _Comm) -> None:
        self.comm = comm
        self.at = time.monotonic()

    def record(self, stream) -> None:
        self.at = time.monotonic()

    def query(self) -> bool:
        c = self.comm
        return c.aborted.is_set() or (c.complete_after is not None and time.monotonic() - self.at > c.complete_after)


class _Group:
    def __init__(self, comm: _Comm) -> None:
        self.comm = comm

    def _get_backend(self, device):
        return self.comm


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    comm = _Comm()
    fallback: list[object] = []

    def batch(ops):
        comm.posted.extend(ops)
        return [SimpleNamespace(wait=lambda: None)]  # the caller's stream waits, not the host

    fake_dist = SimpleNamespace(
        P2POp=lambda op, t, peer, group: (op, peer), isend="isend", irecv="irecv", batch_isend_irecv=batch,
        distributed_c10d=SimpleNamespace(_abort_process_group=lambda g: (fallback.append(g), comm.aborted.set())))
    monkeypatch.setattr(nccl, "dist", fake_dist)
    monkeypatch.setattr(torch.cuda, "Event", lambda: _Event(comm))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    t = object.__new__(nccl.NcclTransport)
    t.group, t.device, t.timeout = _Group(comm), torch.device("cpu"), TIMEOUT
    t._global, t._peers, t._watchdog = [0, 10, 20, 30], set(), None
    yield t, comm, fallback
    t.close()


def _refit(t: nccl.NcclTransport, peer: int) -> float:
    """One refit's round with ``peer`` as the executor drives it, then the watch."""
    buf = torch.zeros(4)
    t.finish(t.start([(peer, buf)], [(peer, buf)]))
    t.watch()
    return time.monotonic()


def _wait_error(t: nccl.NcclTransport, bound: float) -> TransportError | None:
    end = time.monotonic() + bound
    while time.monotonic() < end:
        try:
            t.raise_if_failed()
        except TransportError as e:
            return e
        time.sleep(0.01)
    return None


def test_dead_peer_aborts_within_the_timeout_and_names_it(fake) -> None:
    t, comm, fallback = fake
    started = _refit(t, 3)
    assert comm.posted == [("isend", 30), ("irecv", 30)]  # group rank 3 is global rank 30
    err = _wait_error(t, TIMEOUT + SLACK)
    assert err is not None, "no TransportError although the refit never completed"
    assert err.ranks == (3,) and err.rule == "timeout", (err.ranks, err.rule)
    assert "ranks [3]" in str(err) and "timeout" in str(err) and "aborted" in str(err), str(err)
    assert len(comm.aborts) == 1 and not fallback
    waited = comm.aborts[0] - started
    assert TIMEOUT <= waited <= TIMEOUT + SLACK, waited  # not before the deadline, not long after
    assert comm.aborted.is_set()  # the blocked work ended: no stream stays blocked
    with pytest.raises(TransportError):  # and every later call raises at once
        t.raise_if_failed()


def test_refitter_raises_the_watchdogs_error_before_the_next_refit(fake) -> None:
    from torchrefit.refitter import Refitter

    t, comm, _ = fake
    _refit(t, 2)
    assert _wait_error(t, TIMEOUT + SLACK) is not None
    r = SimpleNamespace(_transport=t, _failed=None)
    with pytest.raises(TransportError, match=r"earlier refit failed.*ranks \[2\]"):
        Refitter._raise_if_failed(r)


def test_completed_refits_are_not_aborted(fake) -> None:
    t, comm, _ = fake
    comm.complete_after = 0.05  # the peer is alive: the work ends soon after it is posted
    for _ in range(3):
        _refit(t, 1)
    time.sleep(3 * TIMEOUT)
    assert _wait_error(t, 0.1) is None and not comm.aborts
    comm.complete_after = None  # now the peer dies: the same watchdog still catches it
    _refit(t, 1)
    err = _wait_error(t, TIMEOUT + SLACK)
    assert err is not None and "ranks [1]" in str(err) and len(comm.aborts) == 1


def test_abort_falls_back_to_aborting_the_process_group(fake) -> None:
    t, comm, fallback = fake
    comm.abort_raises = True
    _refit(t, 3)
    assert _wait_error(t, TIMEOUT + SLACK) is not None
    assert len(comm.aborts) == 1 and fallback == [t.group]


def test_no_timeout_no_watchdog(fake) -> None:
    t, comm, _ = fake
    t.timeout = None
    _refit(t, 3)
    assert t._watchdog is None
    t.raise_if_failed()
