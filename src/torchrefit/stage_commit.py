"""Stage and commit: a refit split so that the engine stalls only for a local copy.

``Refitter.stage()`` moves every byte of the next version into staging twins of the
destination tensors (``execute.staged``) while the engine keeps reading its live
weights; ``Refitter.commit()`` copies the twins into the live tensors on the
caller's stream and stamps the version. This module holds the state between them
and the ordering rules (docs/staging.md states them for users):

1. *A commit never copies bytes that have not arrived.* ``commit()`` first waits
   for the newest requested stage (:meth:`Stager.wait_staged`: the host joins it; on
   CUDA the caller's stream then waits for the stage's completion event).
2. *The engine never reads a half-committed model.* The commit's copies are queued
   on the caller's stream as one unit, into the live tensors in place (addresses a
   CUDA graph captured stay valid).
3. *A stage never overwrites staging a commit still reads.* A stage starts writing
   only once no commit is reading (``reading``, under ``cond``); on CUDA its stream
   also waits for the last commit's event, since the copies outlive the host's part.
4. *A failed stage changes nothing live.* It writes twins only; staging is marked
   no whole version from the moment a stage starts writing it until it finished, so
   a commit after a failed stage raises and the live weights and version stay.
5. *Supersede.* A stage requested while an earlier one awaits its commit replaces it:
   the commit installs the newest stage that completed, never a mix, and stamps its
   version. Stages run one at a time, in the order requested (they are collective).

Stages run on one worker thread per Refitter (so that ``stage(wait=False)``
returns while the bytes move), on a CUDA stream of their own that first waits for
the caller's stream as it was when ``stage()`` was called (the source as the
trainer last wrote it). The source must not be written again before the stage's
handle is waited (``handle.wait()`` orders the caller's stream after the stage's
reads), as with ``refit()``, which returns so ordered.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from .errors import RefitError

__all__ = ["CommitReport", "StageHandle", "StageReport", "Stager"]


@dataclass(frozen=True)
class StageReport:
    """What one ``stage()`` did on this rank: the bytes it moved into staging (``bytes_*``
    as in :class:`~torchrefit.RefitReport`), ``staging`` (``"device"`` or ``"host"``) and
    ``staging_bytes``, the twins' bytes on this rank (allocated once, by the first stage).
    ``pool_bytes`` is the message pools' (shared with ``refit()``)."""

    version: int
    seconds: float
    bytes_local: int
    bytes_sent: int
    bytes_received: int
    transport: str
    rounds: int
    messages_sent: int
    messages_received: int
    staging: str
    staging_bytes: int
    pool_bytes: int
    compiled: bool  # this stage compiled its program (the first stage, or after a rebind)


@dataclass(frozen=True)
class CommitReport:
    """What one ``commit()`` did on this rank. ``seconds`` is host time inside
    ``commit()``, ``waited_seconds`` the part of it spent waiting for the stage to
    finish (zero when the stage was already complete); on CUDA the copies may still run
    when it returns, queued on the caller's stream before anything queued after."""

    version: int
    seconds: float
    waited_seconds: float
    bytes_committed: int
    staging: str
    staging_bytes: int


class StageHandle:
    """One requested stage. ``wait()`` returns its :class:`StageReport` or raises its
    error; ``done()`` says whether it finished (either way)."""

    def __init__(self, version: int, future: Future, device: torch.device | None) -> None:
        self.version = version
        self._future = future
        self._device = device  # CUDA: the caller's stream waits for the stage's event

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> StageReport:
        """Block until the stage finished; raise its error if it failed. On CUDA the
        caller's current stream is then ordered after the stage's work: the source may
        be written and staging read by work queued after this call."""
        try:
            report, event = self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"stage of version {self.version} still running after {timeout} s") from None
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)
        return report


@dataclass(frozen=True)
class _Complete:
    """Staging holds every byte of ``version``: committable once ``event`` (CUDA) passed."""

    version: int
    event: object | None


class Stager:
    """The staging state of one Refitter (see the module docstring for the rules)."""

    def __init__(self, where: str, device: torch.device) -> None:
        self.where = where
        self.device = device
        self.cond = threading.Condition()  # guards the fields below
        self.reading = False  # a commit is queuing its copies from staging
        self._worker: ThreadPoolExecutor | None = None
        self._stream = None  # CUDA: the stages' stream
        self.last: StageHandle | None = None  # the newest stage requested
        self.complete: _Complete | None = None  # staging as a whole version, if it is one
        self.commit_event = None  # CUDA: after the last commit's copies

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def submit(self, version: int, job) -> StageHandle:
        """Queue ``job()`` (which stages ``version`` and returns a StageReport) behind the
        stages requested before; it writes staging once no commit reads it."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="torchrefit-stage")
        producer = None
        if self.cuda:  # the source as the caller's stream leaves it now
            producer = torch.cuda.Event()
            producer.record(torch.cuda.current_stream(self.device))
        with self.cond:  # the job writes nothing before ``last`` names it (see wait_staged)
            future = self._worker.submit(self._run, version, job, producer)
            self.last = StageHandle(version, future, self.device if self.cuda else None)
            return self.last

    def _run(self, version: int, job, producer):
        with self.cond:
            while self.reading:  # rule 3: never overwrite staging a commit still reads
                self.cond.wait()
            self.complete = None  # rule 4: no whole version until it finished
        done = None
        try:
            if not self.cuda:
                report, event = job(), None
            else:
                report, event = self._run_on_stream(job, producer)
            done = _Complete(version, event)
            return report, event
        finally:
            with self.cond:
                self.complete = done
                self.cond.notify_all()

    def _run_on_stream(self, job, producer):
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            self._stream.wait_event(producer)
            if self.commit_event is not None:  # the last commit's copies read staging
                self._stream.wait_event(self.commit_event)
            report = job()
            event = torch.cuda.Event()
            event.record(self._stream)
        return report, event

    def settle(self) -> None:
        """Wait for the stages requested so far (their errors were or will be raised by
        their handles; a plain refit, verify or close only needs them finished)."""
        if self.last is not None:
            try:
                self.last.wait()
            except Exception:  # reported through the stage's handle
                pass

    def drop(self) -> None:
        """Forget the staged version (a plain refit wrote newer weights live)."""
        with self.cond:
            self.complete = None

    def wait_staged(self) -> _Complete:
        """Rule 1, for a commit: wait for the newest requested stage (raising its error;
        again for a newer one another thread requested meanwhile), then mark staging as
        read and return the complete version, the caller's stream ordered after its
        bytes. Pair with :meth:`committed`."""
        while True:
            handle = self.last
            if handle is None:
                raise RefitError("commit() before any stage(): nothing staged to commit")
            try:
                handle.wait()
            except Exception as e:
                raise RefitError(f"commit(): nothing staged to commit: the stage of version "
                                 f"{handle.version} failed, nothing was committed (the live weights "
                                 f"and their version are unchanged): {e}", ranks=getattr(e, "ranks", ()),
                                 rule="nothing staged") from e
            with self.cond:
                if self.last is not handle:  # another thread asked for a newer stage: that one
                    continue
                got = self.complete
                if got is None:
                    raise RefitError("commit(): nothing staged to commit (its version was already "
                                     "committed, or a refit() since replaced it); the live weights and "
                                     "version are unchanged")
                self.reading = True
                break
        if got.event is not None:
            torch.cuda.current_stream(self.device).wait_event(got.event)
        return got

    def committed(self, version: int | None) -> None:
        """The commit's copies are queued (``version``; None: it raised before copying):
        staging may be written again, after them."""
        with self.cond:
            if version is not None:
                self.complete = None
                if self.cuda:
                    self.commit_event = torch.cuda.Event()
                    self.commit_event.record(torch.cuda.current_stream(self.device))
            self.reading = False
            self.cond.notify_all()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
