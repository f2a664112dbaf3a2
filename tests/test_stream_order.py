"""The order of stream waits around side-stream work, checked on CPU with a recording
fake of ``torch.cuda``'s streams (CI has no GPU; the GPU test is test_gpu_stale_read).

``SideStreams.session()`` must make every side stream wait for the caller's stream (the
producer: the optimizer step) before any work is placed on it, and the caller's stream
wait for every side stream before ``SideStreams.session()`` ends (the consumer). Removing either wait
in ``execute/streams.py`` fails these tests; so does placing work outside ``session()``.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from torchrefit.execute import streams as streams_module
from torchrefit.execute.streams import SideStreams


class _Recorder:
    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.current = None


class _FakeStream:
    def __init__(self, rec: _Recorder, name: str) -> None:
        self.rec, self.name = rec, name

    def wait_stream(self, other: _FakeStream) -> None:
        self.rec.log.append(("wait", self.name, other.name))

    def __repr__(self) -> str:
        return self.name


@pytest.fixture
def fake_cuda(monkeypatch):
    rec = _Recorder()
    caller = _FakeStream(rec, "caller")
    rec.current = caller
    count = iter(range(100))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream(rec, f"side{next(count)}"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: rec.current)

    @contextmanager
    def stream(s):
        outer, rec.current = rec.current, s
        try:
            yield
        finally:
            rec.current = outer
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(streams_module.torch.cuda, "stream", stream)
    return rec


def _work(rec: _Recorder, what: str) -> None:
    rec.log.append(("work", rec.current.name, what))


def _first(log, item) -> int:
    return log.index(item)


def test_side_work_waits_for_the_producer_and_the_consumer_waits_for_it(fake_cuda) -> None:
    rec = fake_cuda
    side = SideStreams(torch.device("cuda", 0), 3)
    _work(rec, "optimizer step")
    with side.session():
        for i in range(3):
            with side.placed(i):
                _work(rec, f"copy {i}")
        _work(rec, "exchange on the caller's stream")
    _work(rec, "rollout")
    log = rec.log
    for i in range(3):
        s = f"side{i}"
        produced = _first(log, ("wait", s, "caller"))
        copied = _first(log, ("work", s, f"copy {i}"))
        joined = _first(log, ("wait", "caller", s))
        assert produced < copied, f"{s} copies before waiting for the producer: {log}"
        assert copied < joined < _first(log, ("work", "caller", "rollout")), f"{s}: consumer not ordered: {log}"


def test_a_partial_session_orders_only_its_streams_and_refuses_others(fake_cuda) -> None:
    rec = fake_cuda
    side = SideStreams(torch.device("cuda", 0), 3)
    with side.session(1):
        with side.placed(0):
            _work(rec, "graph replay")
        with pytest.raises(RuntimeError, match="outside a SideStreams.session"):
            with side.placed(1):
                pass
    waits = [e for e in rec.log if e[0] == "wait"]
    assert waits == [("wait", "side0", "caller"), ("wait", "caller", "side0")], waits
