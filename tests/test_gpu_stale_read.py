"""The stale-read test, on a real GPU, for every transport that runs on one GPU: no copy
may read a source before the producer's step that wrote it has finished.

The producer's update of the source weights is queued on the caller's stream
behind a ~50 ms gate (``torch.cuda._sleep``, its cycle count converted from a
cycles-per-ms rate measured at run time); ``refit()`` is called at once, and the
destination must then hold the updated values. Paths covered: NCCL and Gloo in
one process (local copies on the side streams, replayed as a CUDA graph, and
eagerly), Gloo with two processes on one GPU collocated (local copies on the side
streams overlapping staged remote rounds), and Gloo non-collocated (GPU -> pinned
host staging), and CUDA IPC with two processes on one GPU (collocated and not:
receivers read the sender's memory after waiting for its interprocess event),
and every other one-sided transport usable here (nixl: the sender's host waits for
its producer before posting its WRITEs), and nvshmem on its one PE (one process). NCCL cannot pair two ranks on one GPU;
its remote path runs in the multi-GPU suite.

Setting ``TORCHREFIT_BREAK_PRODUCER_WAIT=1`` removes the side stream's wait for the
producer and every one-sided transport's ``wait_ready``, and makes ipc's stream-written
mailbox words land at once, written by the host (test-only monkeypatches), to show
that the test then fails. ipc runs in both orders: ``ipc`` (stream-written words, the
default) and ``ipc:event`` (interprocess events), both with ranks sharing the GPU taking
turns (``settings.delegate_copies`` off), and collocated also as ``ipc:delegate`` (one copier per
shared GPU, the default: the member's stream-written word orders its delegate's reads,
and its ``refit()`` returns after the delegate's done word).

The other direction: a one-sided sender's next step (queued right after ``refit()``
returns) must not overwrite sources a receiver, its reads queued behind a gate,
has not read yet; for ipc with the done token awaited on the sender's stream and on
its host, and with stream-written words. ``TORCHREFIT_BREAK_DONE_WAIT=1`` removes every
one-sided ``wait_done`` and every push initiator's wait for its own writes
(``finish_writes``: nixl's sources are guarded by it, not by the target's done token), and
makes ipc's words land at once. The model of this direction is larger (about 0.4 GB):
a pushed write must still be in flight when the next step is queued.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch

import torchrefit as tr
from torchrefit import settings
from torchrefit.bench.timing import sleep_cycles_per_ms
from torchrefit.testing import (
    Mesh,
    ModelSpec,
    build_toy,
    expected_local,
    run_world,
    usable_transports,
)
from torchrefit.transport.base import transport_class

pytestmark = pytest.mark.gpu

SPEC = ModelSpec(layers=2, hidden=256, heads=8, groups=4, ffn=1024, vocab=4096)
#: the early-overwrite case's model: large enough that a push write (nixl) lasts past the
#: host's return from refit(), so that dropping its completion wait shows
OVERWRITE_SPEC = ModelSpec(layers=2, hidden=1024, heads=8, groups=4, ffn=4096, vocab=32768)
GATE_MS = 50.0
BUMP = 1000.0


def _break_producer_wait() -> None:
    from torchrefit.execute import streams

    @contextmanager
    def session(self, n=None, keep_alive=()):
        if not self.streams:
            yield self
            return
        used = self.streams[: n or len(self.streams)]
        caller = torch.cuda.current_stream(self.device)
        outer, self._open = self._open, len(used)  # no stream.wait_stream(caller): the stale read
        try:
            yield self
        finally:
            self._open = outer
            for stream in used:
                caller.wait_stream(stream)

    streams.SideStreams.session = session
    from torchrefit.transport.base import registered

    for cls in registered():  # one-sided: initiators stop waiting for their producer's token
        if cls.protocol == "one_sided":
            cls.wait_ready = lambda self, peer, token: None
    _words_at_once()


def _words_at_once() -> None:
    """ipc's mailbox words written by the host when queued, not by the stream after
    the work before them: a word then no longer orders anything."""
    from torchrefit.transport import ipc

    def at_once(self, index: int, value: int) -> None:
        self._box.store(index, value)

    ipc.StreamWords.__call__ = at_once


def _order(transport: str) -> str:
    """``"ipc:event"``: ipc with interprocess events, ``"ipc:delegate"``: with one copier
    per shared GPU (the default), every other ipc case with turns (set for this
    process); the name."""
    name, _, order = transport.partition(":")
    settings.configure(delegate_copies=order == "delegate")
    if order and order != "delegate":
        _ipc_defaults(order=order)
    return name


def _ipc_defaults(**kwargs) -> None:
    """Make ``IpcTransport``'s constructor default to ``kwargs`` in this process (the
    Refitter builds it from its name)."""
    from torchrefit.transport import ipc

    init = ipc.IpcTransport.__init__
    ipc.IpcTransport.__init__ = lambda self, group, device, **kw: init(self, group, device, **{**kwargs, **kw})


def _stale_read(rank: int, world: int, src_mesh: Mesh, dst_mesh: Mesh, transport: str,
                cuda_graph: bool) -> list[str]:
    if os.environ.get("TORCHREFIT_BREAK_PRODUCER_WAIT") == "1":
        _break_producer_wait()
    transport = _order(transport)
    torch.cuda.set_device(0)
    src = build_toy(SPEC, src_mesh, rank, seed=1)
    dst = build_toy(SPEC, dst_mesh, rank, seed=2)
    src = src.cuda() if src is not None else None
    dst = dst.cuda() if dst is not None else None
    refitter = tr.Refitter(src, dst, transport=transport, cuda_graph=cuda_graph)
    refitter.refit()  # compile and warm up
    if src is not None:
        with torch.no_grad():
            for p in src.parameters():  # load the producer's kernel now: with lazy module
                p.add_(0.0)             # loading, its first launch inside the gate would block
    torch.cuda.synchronize()            # the host until the gate ends, hiding the race
    cycles = int(GATE_MS * sleep_cycles_per_ms(torch.device("cuda")))
    gate, release = torch.cuda.Event(), torch.cuda.Stream()
    with torch.cuda.stream(release):
        torch.cuda._sleep(cycles)
        gate.record(release)
    torch.cuda.current_stream().wait_event(gate)
    if src is not None:
        with torch.no_grad():
            for p in src.parameters():  # the producer: queued behind the gate
                p.add_(BUMP)
    refitter.refit()  # no synchronisation in between: the refit must order itself
    torch.cuda.synchronize()
    expected = expected_local(SPEC, dst_mesh, rank, seed=1)
    stale = []
    for name, value in (dst.state_dict().items() if dst is not None else ()):
        want = expected[name] + BUMP
        if not torch.equal(value.cpu(), want):
            stale.append(f"{name}: max diff {(value.cpu() - want).abs().max().item():.1f}")
    return stale


CASES = {
    "nccl-1proc-local-graph": (1, Mesh(1, ranks=1), Mesh(1, ranks=1), "nccl", True),
    "nccl-1proc-local-eager": (1, Mesh(1, ranks=1), Mesh(1, ranks=1), "nccl", False),
    "gloo-1proc-local-graph": (1, Mesh(1, ranks=1), Mesh(1, ranks=1), "gloo", True),
    "gloo-2proc-collocated-tp2->tp1": (2, Mesh(2, ranks=2), Mesh(1, ranks=2), "gloo", True),
    "gloo-2proc-noncollocated": (2, Mesh(1, ranks=1), Mesh(1, ranks=1, offset=1), "gloo", True),
}
if torch.cuda.is_available() and transport_class("nvshmem").available():  # one PE: one process per GPU
    CASES["nvshmem-1proc-local-graph"] = (1, Mesh(1, ranks=1), Mesh(1, ranks=1), "nvshmem", True)
for _t in (usable_transports(cuda=True, one_sided_only=True) if torch.cuda.is_available() else ["ipc"]):
    CASES[f"{_t}-2proc-collocated-tp2->tp1"] = (2, Mesh(2, ranks=2), Mesh(1, ranks=2), _t, True)
    CASES[f"{_t}-2proc-noncollocated"] = (2, Mesh(1, ranks=1), Mesh(1, ranks=1, offset=1), _t, True)
if "ipc-2proc-noncollocated" in CASES:  # ipc ordered by its events too
    CASES["ipc:event-2proc-collocated-tp2->tp1"] = (2, Mesh(2, ranks=2), Mesh(1, ranks=2), "ipc:event", True)
    CASES["ipc:event-2proc-noncollocated"] = (2, Mesh(1, ranks=1), Mesh(1, ranks=1, offset=1), "ipc:event", True)
    # both ranks copy on the GPU: rank 0 reads and writes for rank 1 (transport.delegates)
    CASES["ipc:delegate-2proc-collocated-tp2->tp1"] = (2, Mesh(2, ranks=2), Mesh(1, ranks=2), "ipc:delegate", True)
    CASES["ipc:delegate-2proc-collocated-tp1->tp1"] = (2, Mesh(1, ranks=2), Mesh(1, ranks=2), "ipc:delegate", True)


@pytest.mark.parametrize("name", list(CASES))
def test_refit_never_reads_stale_weights(name: str) -> None:
    world, src_mesh, dst_mesh, transport, graph = CASES[name]
    backend = "nccl" if transport == "nccl" else "gloo"
    results = run_world(_stale_read, world, src_mesh, dst_mesh, transport, graph, backend=backend,
                        timeout=180)
    for rank, stale in enumerate(results):
        assert stale == [], f"rank {rank} read stale weights: {stale[:3]}"


def _break_done_wait() -> None:
    from torchrefit.transport.base import registered

    for cls in registered():  # one-sided: targets stop waiting for their initiator's done token
        if cls.protocol == "one_sided":
            cls.wait_done = lambda self, peer, token: None
            if not cls.pull:  # and push initiators for their own writes
                cls.finish_writes = lambda self: None
    _words_at_once()


def _early_overwrite(rank: int, world: int, transport: str, done_wait: str) -> list[str]:
    """Rank 0 (source) refits into rank 1 (destination), whose reads are queued behind a
    gate on its stream; rank 0 bumps its sources right after ``refit()`` returns (the
    next optimizer step). Rank 1 must receive the values from before the bump."""
    _ipc_defaults(done_wait=done_wait)
    if os.environ.get("TORCHREFIT_BREAK_DONE_WAIT") == "1":
        _break_done_wait()
    transport = _order(transport)
    torch.cuda.set_device(0)
    src_mesh, dst_mesh = Mesh(1, ranks=1), Mesh(1, ranks=1, offset=1)
    src = build_toy(OVERWRITE_SPEC, src_mesh, rank, seed=1)
    dst = build_toy(OVERWRITE_SPEC, dst_mesh, rank, seed=2)
    src, dst = (m.cuda() if m is not None else None for m in (src, dst))
    refitter = tr.Refitter(src, dst, transport=transport)
    refitter.refit()  # compile and warm up
    if src is not None:
        with torch.no_grad():
            for p in src.parameters():
                p.add_(0.0)  # load the bump's kernel now (see _stale_read)
    torch.cuda.synchronize()
    torch.distributed.barrier()
    if dst is not None:
        torch.cuda._sleep(int(GATE_MS * sleep_cycles_per_ms(torch.device("cuda"))))  # the engine still busy
    refitter.refit()
    if src is not None:
        with torch.no_grad():
            for p in src.parameters():  # the next step, queued at once
                p.add_(BUMP)
    torch.cuda.synchronize()
    torch.distributed.barrier()
    if dst is None:
        return []
    expected = expected_local(OVERWRITE_SPEC, dst_mesh, rank, seed=1)
    return [f"{k}: max diff {(v.cpu() - expected[k]).abs().max().item():.1f}"
            for k, v in dst.state_dict().items() if not torch.equal(v.cpu(), expected[k])]


OVERWRITE = [("ipc", "host"), ("ipc:event", "stream"), ("ipc:event", "host")] + [
    (t, "stream") for t in (usable_transports(cuda=True, one_sided_only=True) if torch.cuda.is_available() else [])
    if t != "ipc"]


@pytest.mark.parametrize("transport,done_wait", OVERWRITE, ids=[f"{t}-{w}" for t, w in OVERWRITE])
def test_sender_never_overwrites_sources_being_read(transport: str, done_wait: str) -> None:
    results = run_world(_early_overwrite, 2, transport, done_wait, backend="gloo", timeout=180)
    assert results[1] == [], f"rank 1 read sources the next step had overwritten: {results[1][:3]}"
