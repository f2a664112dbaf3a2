"""The one-sided protocol on CPU, through the shared-memory test transports of
``shm_transport.py`` (pull: receivers read senders' memory, as ipc; push: senders
write receivers' memory, as nixl), in one 8-process Gloo world.

Covers: a selection of the layout suite's cases (TP, PP, EP, SwiGLU, tied,
non-collocated with idle ranks) through both directions, destinations checked
against the toy's global values (an independent oracle), each refit twice and
``verify()``; storage moves on both sides followed by a new table (and only then);
the order of the protocol's calls on every rank (initiators wait for the target's
ready token before anything else and send done after; targets wait for done last),
and the same seen in data (a target whose initiator dawdles returns only after the
transfer: a pull sender's next step cannot reach the engine, a push receiver reads
the new weights);
a push transport converting a dtype through buffers of the wire dtype (the sender's
bf16 buffers written, exact); and
which transport ``"auto"`` picks, with ``available()``'s reasons, and what it means under
``TORCHREFIT_TRANSPORT`` (set alike: that transport; set differently on some ranks, or
naming one that does not fit: ``TransportError`` on every rank); and that building a
Refitter of plain models does not import ``torch.distributed.tensor``.
"""

from __future__ import annotations

import time

import pytest
import shm_transport
import torch
from test_layouts import CASES, WORLD, _build_dst, _expected, _state

import torchrefit as tr
from torchrefit import settings
from torchrefit.testing import build_toy, run_world

PICK = ["dense-(2, 1)->(1, 1)", "dense-(2, 2)->(1, 1)", "moe-(2, 1, 2)->(4, 1, 1)", "tp2->tp3",
        "tied-pp2->untied-tp2", "noncolloc-pp2(0-1)->tp4(2-5)-idle", "noncolloc-moe-ep2(4-7)->ep4tp1(0-3)",
        "cast-fp32->bf16"]
SELECTED = [c for c in CASES if c.id in PICK]


def _shared(model):
    if model is None:
        return None
    for m in model if isinstance(model, list) else [model]:
        m.share_memory()
    return model


def _case(case, rank: int, transport: str) -> dict:
    src = _shared(build_toy(case.spec, case.src, rank, 1))
    dst = _shared(_build_dst(case, rank))
    expected = _expected(case, rank)
    shm_transport.LOG.clear()
    r = tr.Refitter(src, dst, transport=transport, **case.kwargs)
    r.refit()
    log = list(shm_transport.LOG)
    shm_transport.LOG.clear()
    r.refit()
    wrong = [k for k, v in _state(dst).items() if not torch.equal(v.detach(), expected[k])]
    r.verify()
    second = list(shm_transport.LOG)
    out = {"wrong": wrong, "log": log, "second": second, "sends": sorted(r.plan.send_peers),
           "recvs": sorted(r.plan.recv_peers), "has_src": src is not None}
    if src is not None:  # the sender's storage moves: its receivers must attach a new table
        with torch.no_grad():
            for p in src.parameters():
                p.data = p.data.clone().share_memory_()
    shm_transport.LOG.clear()
    r.refit()
    out["after_move"] = list(shm_transport.LOG)
    out["moved_wrong"] = [k for k, v in _state(dst).items() if not torch.equal(v.detach(), expected[k])]
    return out


def _world(rank: int, world: int, transport: str) -> dict:
    out = {}
    for case in SELECTED:
        try:
            out[case.id] = _case(case, rank, transport)
        except Exception as e:  # agreed errors: every rank records one
            out[case.id] = {"error": f"{type(e).__name__}: {e}"}
        torch.distributed.barrier()
    return out


@pytest.fixture(scope="module", params=["shm-pull", "shm-push"])
def results(request):
    return request.param, run_world(_world, WORLD, request.param, timeout=900)


def _initiated(got: dict, pull: bool) -> list[int]:
    return got["recvs"] if pull else got["sends"]


def _targets(got: dict, pull: bool) -> list[int]:
    return got["sends"] if pull else got["recvs"]


@pytest.mark.parametrize("case", [c.id for c in SELECTED])
def test_layouts_through_one_sided(case: str, results) -> None:
    transport, per_rank = results
    pull = transport == "shm-pull"
    for rank, got in enumerate(per_rank):
        got = got[case]
        assert "error" not in got, f"rank {rank}: {got['error']}"
        assert got["wrong"] == [] and got["moved_wrong"] == [], f"rank {rank}: {got}"
        mine, theirs = _initiated(got, pull), _targets(got, pull)
        _check_order(got["log"], mine, theirs, pull, attach=True)
        _check_order(got["second"], mine, theirs, pull, attach=False)
        # after every source moved, an initiator re-attaches exactly the targets that
        # recompiled: those holding a source (pull: every sender; push: collocated receivers)
        attached = sorted(int(e.split(":")[1]) for e in got["after_move"] if e.startswith("attach:"))
        moved = [p for p in mine if per_rank[p][case]["has_src"]]
        assert attached == moved, f"rank {rank}: {got['after_move']}"


def test_most_cases_move_bytes_one_sidedly(results) -> None:
    """Guards the selection: the cases must exercise the transport, not only local copies."""
    transport, per_rank = results
    pull = transport == "shm-pull"
    moved = [c.id for c in SELECTED if any(_initiated(r[c.id], pull) for r in per_rank if "error" not in r[c.id])]
    assert len(moved) >= len(SELECTED) - 2, moved


def _check_order(log: list[str], mine: list[int], theirs: list[int], pull: bool, attach: bool) -> None:
    """A refit's calls: ready (if a target) before any wait; per initiated peer attach
    (first refit only) then wait_ready (then write, push), all before done; wait_done
    for every target peer after everything else."""
    expect = (["ready"] if theirs else [])
    for p in mine:
        expect += ([f"attach:{p}"] if attach else []) + [f"wait_ready:{p}"]
    if mine:
        expect += ([] if pull else [f"write:{p}" for p in mine]) + ["done"]
    expect += [f"wait_done:{p}" for p in theirs]
    assert log[:len(expect)] == expect, f"protocol order {log} != {expect}"


def _targets_wait_world(rank: int, world: int, transport: str) -> dict:
    """Rank 0 trains, rank 1 serves; the initiator dawdles before each transfer. Pull:
    the trainer (the target) overwrites its weights as soon as ``refit()`` returns (the
    next optimizer step); push: the engine (the target) reads its weights as soon as
    ``refit()`` returns. Either sees the other's transfer only if it waited for it."""
    src_mesh, dst_mesh = tr.testing.Mesh(1, ranks=1), tr.testing.Mesh(1, ranks=1, offset=1)
    src = _shared(build_toy(MAILBOX_SPEC, src_mesh, rank, 1))
    dst = _shared(build_toy(MAILBOX_SPEC, dst_mesh, rank, 2))
    pull = transport == "shm-pull"
    shm_transport.INITIATOR_DELAY = LATE if (rank == 1) == pull else 0.0
    r = tr.Refitter(src, dst, transport=transport, timeout=10)  # a desynchronized pair fails fast
    want = tr.testing.expected_local(MAILBOX_SPEC, dst_mesh, rank, 1)
    stale = []
    for _ in range(3):
        torch.distributed.barrier()
        if src is not None:
            with torch.no_grad():
                for p in src.parameters():
                    p.add_(1.0)  # this step's weights
        r.refit()
        kept = []
        if src is not None:  # the next step starts at once
            with torch.no_grad():
                for p in src.parameters():
                    kept.append(p.clone())
                    p.fill_(float("nan"))
        else:
            want = {n: v + 1.0 for n, v in want.items()}
            stale.append([n for n, v in _state(dst).items() if not torch.equal(v.detach(), want[n])])
        torch.distributed.barrier()
        with torch.no_grad():  # (undone once the engine has looked, so that the source stays known)
            for p, v in zip(src.parameters() if src is not None else (), kept):
                p.copy_(v)
    return {"stale": stale}


@pytest.mark.parametrize("transport", ["shm-pull", "shm-push"])
def test_targets_return_after_their_initiators_transfer(transport: str) -> None:
    """The target side's ``refit()`` returns only once its initiator's transfer is done,
    seen in data: a pull sender that overwrote its weights early, or a push receiver
    that read its weights early, leaves the engine's values differing from the oracle
    (the toy's values plus each step's bump)."""
    _, receiver = run_world(_targets_wait_world, 2, transport, timeout=90, pg_timeout=20)
    assert receiver["stale"] == [[], [], []], receiver["stale"]


def _auto(rank: int, world: int) -> dict:
    from torchrefit.transport.base import registered

    case = next(c for c in CASES if c.id == "dense-(2, 1)->(1, 1)")
    r = tr.Refitter(build_toy(case.spec, case.src, rank, 1), _build_dst(case, rank))
    reasons = {c.name: c.available().reason for c in registered() if not c.available()}
    try:
        tr.Refitter(build_toy(case.spec, case.src, rank, 1), _build_dst(case, rank), transport="ipc")
        ipc = "no error"
    except tr.TransportError as e:
        ipc = str(e)
    import sys

    out = {"auto": r.refit().transport, "reasons": reasons, "ipc": ipc,
           "dtensor_imported": "torch.distributed.tensor" in sys.modules}
    # TORCHREFIT_TRANSPORT: what "auto" means, alike on every rank or refused on every rank
    for name, env in (("env", "shm-push"), ("env differs", "shm-push" if rank % 2 else "gloo"),
                      ("env unfit", "ipc")):
        try:
            settings.configure(transport=env)
            r = tr.Refitter(build_toy(case.spec, case.src, rank, 1), _shared(_build_dst(case, rank)))
            out[name] = r.refit().transport
        except tr.TransportError as e:
            out[name] = f"TransportError: {e}"
        finally:
            settings.configure(transport="")
    return out


_NIXL_MISSING = "the nixl-cu13 package is not installed (pip install 'torchrefit[nixl]')"


def test_auto_and_availability_reasons() -> None:
    for rank, got in enumerate(run_world(_auto, WORLD, timeout=300)):
        if torch.cuda.is_available():
            continue
        assert got["auto"] == "gloo", f"rank {rank}: {got}"
        assert got["reasons"]["ipc"] == "no CUDA GPU is visible"
        assert "needs CUDA tensors" in got["ipc"] and "ranks [0, 1" in got["ipc"], got["ipc"]
        assert got["env"] == "shm-push", got["env"]
        assert got["env differs"].startswith("TransportError: settings.transport (TORCHREFIT_TRANSPORT) differs between ranks "
                                             "(ranks [0, 2, 4, 6]: gloo; ranks [1, 3, 5, 7]: shm-push)"), got
        assert "transport 'ipc' needs CUDA tensors" in got["env unfit"], got["env unfit"]
        # nixl runs on CPU memory too, but "auto" leaves it to be asked for there
        assert got["reasons"].get("nixl", "") in ("", _NIXL_MISSING), got["reasons"]
        # plain models: the DTensor check must not import torch.distributed.tensor
        # (seconds of Python import on a cold machine, counted in the first refit)
        assert not got["dtensor_imported"], f"rank {rank}"


def test_host_poll_waits_for_the_event_and_is_bounded() -> None:
    """ipc's default done wait polls the receiver's event from the sender's host
    (``poll_until``): it returns only once the event completed, and gives up after the
    timeout (the transport then raises TransportError naming the peer)."""
    from torchrefit.transport.base import poll_until

    calls = []

    def done() -> bool:  # an event that completes on the fifth query
        calls.append(1)
        return len(calls) >= 5

    assert poll_until(done, timeout=10.0) and len(calls) == 5
    t0 = time.monotonic()
    assert not poll_until(lambda: False, timeout=0.05)
    assert time.monotonic() - t0 >= 0.05
    assert poll_until(lambda: True, timeout=None)


def test_a_poll_spins_where_the_same_wait_ended_last_time(monkeypatch) -> None:
    """A host poll spins (``sched_yield``) in its first 5 ms and naps (50 us sleeps)
    after, except around when the same kind of wait ended last time (``Waits``): a
    collocated refit's copies outlast the first 5 ms, and a nap then returns ~0.1 ms
    late. A fake clock: each poll advances it by its nap or 10 us."""
    from torchrefit.transport import base

    now = [0.0]
    log: list[tuple[float, str]] = []

    def nap(s: float) -> None:
        log.append((now[0], "nap"))
        now[0] += s

    def spin() -> None:
        log.append((now[0], "spin"))
        now[0] += 10e-6

    monkeypatch.setattr(base.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(base.time, "sleep", nap)
    monkeypatch.setattr(base.os, "sched_yield", spin)
    waits = base.Waits()
    assert waits.last("done") is None

    def wait(ends: float) -> list[tuple[float, str]]:
        log.clear()
        start = now[0]
        assert waits.poll("done", lambda: now[0] - start >= ends, timeout=1.0)
        return [(t - start, how) for t, how in log]

    first = wait(0.020)  # nothing known yet: spins 5 ms, then naps to the end
    assert {how for t, how in first if t < 0.005} == {"spin"} and {how for t, how in first if t > 0.005} == {"nap"}
    assert 0.020 <= waits.last("done") < 0.0201
    second = wait(0.020)  # spins from 1 ms before 20 ms on
    assert {how for t, how in second if 0.005 < t < 0.019} == {"nap"}
    assert {how for t, how in second if t > 0.019} == {"spin"}
    assert [t for t, _ in second][-1] < 0.020  # seen within one spin of its end, not a nap's
    assert base.spinning(0.031, 0.020) and not base.spinning(0.0315, 0.020)  # until 1.5x + 1 ms
    assert base.spinning(1.010, 1.0) and not base.spinning(1.012, 1.0)  # at most 11 ms after
    assert not base.spinning(0.010, None) and base.spinning(0.004, None)
    waits.poll("other", lambda: False, timeout=0.001)  # a timed-out wait teaches nothing
    assert waits.last("other") is None


class _Event:
    """A peer's interprocess event as ipc's waits see it: completes on query ``n``."""

    def __init__(self, n: int | None) -> None:
        self.n, self.queries = n, 0

    def query(self) -> bool:
        self.queries += 1
        return self.n is not None and self.queries >= self.n


def _bare_ipc(ready_wait: str, done_wait: str, event: _Event, timeout: float = 10.0):
    """An ``IpcTransport`` without CUDA or a group: only what its waits read."""
    from torchrefit.transport.base import Waits
    from torchrefit.transport.ipc import IpcTransport

    t = object.__new__(IpcTransport)
    t.ready_wait, t.done_wait, t.timeout = ready_wait, done_wait, timeout
    t.device, t._global, t._peer_events = torch.device("cpu"), [0, 1], {b"token": event}
    t.waits = Waits()
    return t


@pytest.mark.parametrize("wait", ["wait_ready", "wait_done"])
def test_ipc_host_waits_poll_the_peer_event(wait: str, monkeypatch) -> None:
    """ipc's default waits (``ready_wait`` / ``done_wait`` "host") return only once the
    peer's event completed, queue nothing on a stream, and raise TransportError naming
    the peer after the timeout; "stream" queues the wait on the stream and polls nothing."""
    queued = []

    class Stream:
        def wait_event(self, event) -> None:
            queued.append(event)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    event = _Event(5)
    getattr(_bare_ipc("host", "host", event), wait)(1, b"token")
    assert event.queries == 5 and queued == []
    never = _Event(None)
    with pytest.raises(tr.TransportError, match="rank 1") as e:
        getattr(_bare_ipc("host", "host", never, timeout=0.05), wait)(1, b"token")
    assert ("ready event" if wait == "wait_ready" else "done event") in str(e.value)
    event = _Event(5)
    getattr(_bare_ipc("stream", "stream", event), wait)(1, b"token")
    assert event.queries == 0 and queued == [event]
    from torchrefit.transport.one_sided.protocol import WORD

    for mode in ("host", "stream"):
        getattr(_bare_ipc(mode, mode, event), wait)(1, WORD)
    assert event.queries == 0 and queued == [event]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback where CUDA's driver is absent")
def test_ipc_without_stream_words_orders_by_events() -> None:
    """Where the driver cannot write words from a stream (no libcuda here), ipc's
    ``stream_writer`` declines instead of raising, so ``ready()`` and ``post_done``
    fall back to interprocess events; with ``order="event"`` it is never asked."""
    from torchrefit.transport.one_sided.mailbox import Mailbox

    box = Mailbox.create(1)
    t = _bare_ipc("host", "host", _Event(1))
    t.order = "word"
    assert t.stream_writer(box) is None
    t.order = "event"
    assert t.stream_writer(box) is None


def test_ipc_stream_word_is_stored_at_once_only_on_an_idle_stream(monkeypatch) -> None:
    """ipc's stream-written word (``StreamWords``, driver calls faked): on a stream whose
    work all finished (``cuStreamQuery`` succeeds) the host stores the word at once; with
    work pending (not ready) the stream writes it behind that work, never the host; on
    any other answer torch's own query decides (it binds the device's context)."""
    from torchrefit.transport import ipc
    from torchrefit.transport.one_sided.mailbox import Mailbox

    box = Mailbox.create(2)
    writes: list[tuple[int, int, int]] = []
    torch_says: list[bool] = []

    class Stream:
        def query(self) -> bool:
            return torch_says.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    w = object.__new__(ipc.StreamWords)
    w.device, w._box, w._base, w._stream = torch.device("cpu"), box, 4096, lambda: 77
    w._write = lambda stream, address, value, flags: writes.append((stream, address, value)) or 0
    for rc, torch_idle, stored, written in ((0, None, 5, []), (600, None, 0, [(77, 4096 + 8, 5)]),
                                            (201, True, 5, []), (201, False, 0, [(77, 4096 + 8, 5)])):
        box.store(1, 0)
        writes.clear()
        torch_says[:] = [] if torch_idle is None else [torch_idle]
        w._query = lambda stream, rc=rc: rc if stream == 77 else -1
        w(1, 5)
        assert (box.load(1), writes) == (stored, written), (rc, torch_idle)
        assert torch_says == [], "torch's query was not asked for an unexpected driver answer"
    w._query, w._write = (lambda stream: 600), (lambda *args: 1)
    with pytest.raises(tr.TransportError, match="cuStreamWriteValue64 into the mailbox failed"):
        w(1, 5)


def test_ipc_wait_modes_are_checked(monkeypatch) -> None:
    from torchrefit.transport import ipc

    monkeypatch.setattr(ipc, "require_cuda", lambda device, name: None)
    with pytest.raises(tr.TransportError, match="ready_wait must be 'stream' or 'host', not 'device'"):
        ipc.IpcTransport(None, torch.device("cpu"), ready_wait="device")
    with pytest.raises(tr.TransportError, match="order must be 'word' or 'event', not 'flags'"):
        ipc.IpcTransport(None, torch.device("cpu"), ready_wait="host", order="flags")


MAILBOX_SPEC = tr.testing.ModelSpec(layers=2, hidden=64, heads=4, groups=2, ffn=128, vocab=256)
LATE = 0.3  # seconds a slow producer, reader or peer dawdles


def _mailbox_world(rank: int, world: int) -> dict:
    """Rank 0 holds the source, rank 1 the destination (shm-pull: headers and done
    tokens as shared-memory words once the pair exchanged its table)."""
    src_mesh, dst_mesh = tr.testing.Mesh(1, ranks=1), tr.testing.Mesh(1, ranks=1, offset=1)
    src, dst = _shared(build_toy(MAILBOX_SPEC, src_mesh, rank, 1)), build_toy(MAILBOX_SPEC, dst_mesh, rank, 2)
    r = tr.Refitter(src, dst, transport="shm-pull")
    r.refit()
    r.refit()
    tp, out = r._transport, {}
    before = tp.gloo_messages
    for _ in range(3):  # the producer is late: the receiver must wait for the sender's header word
        torch.distributed.barrier()
        if src is not None:
            time.sleep(LATE)
            with torch.no_grad():
                for p in src.parameters():
                    p.add_(1.0)
        r.refit()
    out["gloo_messages"] = tp.gloo_messages - before
    want = tr.testing.expected_local(MAILBOX_SPEC, dst_mesh, rank, 1)
    want = {k: v + 1.0 + 1.0 + 1.0 for k, v in want.items()}  # the same roundings as the source's
    out["stale"] = [k for k, v in _state(dst).items() if not torch.equal(v.detach(), want[k])] if dst else []
    torch.distributed.barrier()
    if dst is not None:  # the reader is late: the sender must wait for its done word
        wait_ready = tp.wait_ready
        tp.wait_ready = lambda peer, token: (time.sleep(LATE), wait_ready(peer, token))[1]
    r.refit()
    if src is not None:
        with torch.no_grad():
            for p in src.parameters():  # the next step, right after refit() returned
                p.add_(1000.0)
    torch.distributed.barrier()
    out["overwritten"] = [k for k, v in _state(dst).items() if not torch.equal(v.detach(), want[k])] if dst else []
    if src is not None:  # the sources move to new storage: a new table, which the receiver must read from
        with torch.no_grad():
            for p in src.parameters():
                p.data = (p.data + 5.0).share_memory_()
    r.refit()
    want = {k: v + 1000.0 + 5.0 for k, v in want.items()}
    out["moved"] = [k for k, v in _state(dst).items() if not torch.equal(v.detach(), want[k])] if dst else []
    tp.timeout = 1.0  # a peer that stops: each side raises within its timeout, naming the other
    if src is not None:
        time.sleep(3.0)
    t0 = time.perf_counter()
    try:
        r.refit()
        out["stopped"] = "no error"
    except tr.TransportError as e:
        out["stopped"] = str(e)
    out["stopped_s"] = time.perf_counter() - t0
    # the words' waits, each remembered for the next refit's poll (base.Waits)
    out["waited"] = [what for what in ("header", "done token") if tp.waits.last((what, 1 - rank)) is not None]
    return out


def test_mailbox_orders_both_ways_and_times_out() -> None:
    """After a pair's first exchange, shm-pull (as ipc) sends no Gloo message per refit:
    the receiver waits for the sender's header word before reading (a late producer's
    update is never missed), the sender waits for the receiver's done word before
    returning (a late reader never sees the next step's values), sources moved to new
    storage are read there (a new table, new copies), and a stopped peer raises
    TransportError naming it within the timeout on both sides."""
    sender, receiver = run_world(_mailbox_world, 2, timeout=240)
    assert sender["gloo_messages"] == 0 and receiver["gloo_messages"] == 0, (sender, receiver)
    assert receiver["stale"] == [], f"the receiver read before the producer finished: {receiver['stale'][:3]}"
    assert receiver["overwritten"] == [], f"the sender overwrote sources being read: {receiver['overwritten'][:3]}"
    assert receiver["moved"] == [], f"the receiver read the sources' old storage: {receiver['moved'][:3]}"
    assert "rank 0" in receiver["stopped"] and "header" in receiver["stopped"], receiver["stopped"]
    assert "rank 1" in sender["stopped"] and "done token" in sender["stopped"], sender["stopped"]
    assert sender["waited"] == ["done token"] and receiver["waited"] == ["header"], (sender, receiver)
    assert receiver["stopped_s"] < 1.0 + 5.0 and sender["stopped_s"] < 1.0 + 5.0, (sender, receiver)


class _Headers:
    """A pull transport whose next header is set by the test (the target's regions)."""

    pull = True

    def __init__(self) -> None:
        self.header: tuple = ()

    def recv_header(self, peer: int) -> tuple:
        return self.header

    def wait_ready(self, peer: int, token) -> None:
        pass


def test_initiator_refuses_regions_that_disagree_once_per_generation() -> None:
    """The initiator checks a target's exposed regions against its own views before any
    copy: on the first header of each target generation (a generation's regions never
    change, so a refit within it skips the check). Oracle: the numels of the two sides."""
    from torchrefit.errors import TransportError
    from torchrefit.execute.one_sided_program import Initiated, OneSided, OneSidedProgram

    mine = (torch.zeros(4), torch.zeros(6))
    pair = Initiated(1, mine, ("w[0:4] from rank 1", "v[0:6] from rank 1"))
    transport = _Headers()
    program = OneSidedProgram(OneSided(0, None, (), (), 0, 0), transport, torch.device("cpu"), False)
    wrong = (torch.zeros(4), torch.zeros(5))
    transport.header = (7, None, wrong)
    with pytest.raises(TransportError, match=r"rank 1's exposed regions do not match.*w\[0:4\]"):
        program._attach(pair)
    transport.header = (7, None, (torch.zeros(4),))  # one region short
    with pytest.raises(TransportError, match="rank 1's exposed regions"):
        program._attach(pair)
    right = (torch.zeros(4), torch.zeros(6))
    transport.header = (7, None, right)
    assert program._attach(pair) == (1, 7, right)
    transport.header = (8, None, wrong)  # the target re-exposed: checked again
    with pytest.raises(TransportError, match="rank 1's exposed regions"):
        program._attach(pair)


def _stream_word_world(rank: int, world: int) -> dict:
    """Rank 0 holds the source, rank 1 the destination; shm-pull-word orders by words
    the fake stream writes. Each refit, the sender's producer and the receiver's
    reads are late on their streams (queued before ``refit()``, run LATE later)."""
    from torchrefit.transport.one_sided.mailbox import Mailbox

    src_mesh, dst_mesh = tr.testing.Mesh(1, ranks=1), tr.testing.Mesh(1, ranks=1, offset=1)
    src, dst = _shared(build_toy(MAILBOX_SPEC, src_mesh, rank, 1)), build_toy(MAILBOX_SPEC, dst_mesh, rank, 2)
    marks = Mailbox.create(1) if rank == 1 else None  # the receiver's stream marks its reads done here
    handle = [marks.handle() if marks else None]
    torch.distributed.broadcast_object_list(handle, src=1)
    marks = marks or Mailbox.open(handle[0])
    stream = shm_transport.STREAM
    r = tr.Refitter(src, dst, transport="shm-pull-word")
    want = tr.testing.expected_local(MAILBOX_SPEC, dst_mesh, rank, 1)
    out: dict = {"stale": [], "marks_seen": [], "log": []}
    for k in range(1, 4):  # 1: the pair's first exchange (its header over Gloo, then the word)
        torch.distributed.barrier()
        shm_transport.LOG.clear()
        late = 2.0 if k == 1 else LATE  # the first refit also compiles: its producer is later still
        if src is not None:
            stream.queue(lambda late=late: (time.sleep(late), [p.data.add_(1.0) for p in src.parameters()]))
        else:  # the reads end after the producer's bump was seen
            stream.queue(lambda k=k, late=late: (time.sleep(late + 0.6), marks.post(0, k, False)))
        r.refit()
        out["log"].append(list(shm_transport.LOG))
        if src is not None:  # the receiver's stream has passed its reads of this refit
            out["marks_seen"].append(marks.load(0) >> 1)
        else:
            want = {n: v + 1.0 for n, v in want.items()}  # the same roundings as the source's
            out["stale"].append([n for n, v in _state(dst).items() if not torch.equal(v.detach(), want[n])])
        stream.synchronize()
    r.close()
    torch.distributed.barrier()
    settings.configure(mailbox=False)  # no mailbox: the same transport falls back to its tokens
    shm_transport.LOG.clear()
    r = tr.Refitter(src, dst, transport="shm-pull-word")
    r.refit()
    r.refit()
    out["fallback_log"] = list(shm_transport.LOG)
    out["fallback_wrong"] = [n for n, v in _state(dst).items() if not torch.equal(v.detach(), want[n])] if dst else []
    return out


def test_stream_words_order_both_ways() -> None:
    """Ordered by words a stream writes (ipc's default): the receiver reads only after
    the sender's late producer ran, on the pair's first exchange and later ones, and the
    sender's ``refit()`` returns only after the receiver's late reads; where no mailbox
    can be shared, both sides fall back to their tokens. Oracle: the toy's values plus
    the producer's bumps; the receiver's mark, written by its stream before its word."""
    sender, receiver = run_world(_stream_word_world, 2, timeout=240)
    assert receiver["stale"] == [[], [], []], f"the receiver read before the producer ran: {receiver['stale']}"
    assert sender["marks_seen"] == [1, 2, 3], f"the sender returned before the reads ran: {sender['marks_seen']}"
    assert all("ready:word" in log and "ready:event" not in log for log in sender["log"]), sender["log"]
    assert all("done:word" in log and "done:event" not in log for log in receiver["log"]), receiver["log"]
    assert "ready:event" in sender["fallback_log"] and "done:event" in receiver["fallback_log"], (sender, receiver)
    assert receiver["fallback_wrong"] == [], receiver["fallback_wrong"]


def test_memory_a_peer_no_longer_exposes_is_its_transport_error() -> None:
    """Opening a table whose memory the peer freed (or a dead peer's) raises
    :class:`TransportError` naming that rank, not the backend's own error."""
    from torchrefit.errors import TransportError

    class _Gone(shm_transport.ShmPull):
        def attach(self, peer: int, table) -> tuple:
            raise RuntimeError("unable to open shared memory object </torch_1_2_3>")

    transport = object.__new__(_Gone)  # only the name and attach are used
    with pytest.raises(TransportError, match=r"shm-pull: cannot open the memory rank 3 exposed \(RuntimeError") as e:
        transport._attach_table(3, (None, ()))
    assert e.value.ranks == (3,) and e.value.rule == "peer memory"
