"""Rendezvous store connections (``_util.tcp_store``, used by ``tr.connect`` and the vLLM
backend's discovery store): every wait bounded by the timeout, a self-connect refused.

* a listener that accepts and never answers (torch's ``TCPStore`` client then waits in
  its constructor with no bound of its own) makes ``tr.connect`` raise ``ConnectError``
  within the timeout, not hang;
* a client whose connection lands on itself (no store listening yet on a port of the
  kernel's ephemeral range; forced here by binding the source port) is refused with an
  error naming the port, the range and what to do, for ``tr.connect`` and for the vLLM
  backend's discovery store;
* a store that comes up late is still reached (the connection is retried until the
  deadline).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch.distributed as dist

import torchrefit as tr
from torchrefit._util import tcp_store
from torchrefit.engines._link import _discovery_store

TIMEOUT = 3.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bounded(fn, limit: float) -> tuple[BaseException | None, float]:
    """``fn()``'s exception and the seconds it took; fails the test if it runs past ``limit``."""
    out: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            fn()
        except BaseException as e:
            out["error"] = e
        out["took"] = time.monotonic() - t0

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(limit)
    assert not worker.is_alive(), f"still waiting after {limit} s: the store wait is unbounded"
    return out.get("error"), out["took"]


def test_a_store_that_never_answers_raises_within_the_timeout() -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    held: list[socket.socket] = []

    def accept() -> None:  # accepts every connection and never writes a byte
        while True:
            try:
                held.append(silent.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        error, took = _bounded(lambda: tr.connect("engine", 0, 1, 1, "127.0.0.1", port,
                                                  timeout=TIMEOUT), TIMEOUT + 30)
    finally:
        silent.close()
        for c in held:
            c.close()
    assert isinstance(error, tr.ConnectError), error
    assert "did not answer within 3 s" in str(error) and f"127.0.0.1:{port}" in str(error)
    assert took < TIMEOUT + 5, took


def _self_connecting(monkeypatch) -> None:
    """Every probe connection binds its source port to the port it connects to: with no
    listener there, TCP's simultaneous open connects the socket to itself, as the kernel
    may do by chance for a port of its ephemeral range."""
    plain = socket.create_connection

    def to_itself(address, timeout=None, source_address=None):
        return plain(address, timeout=timeout, source_address=address)

    monkeypatch.setattr(tcp_store.socket, "create_connection", to_itself)


@pytest.mark.parametrize("path", ["connect", "vllm discovery store"])
def test_a_self_connect_is_refused_clearly(monkeypatch, path: str) -> None:
    _self_connecting(monkeypatch)
    port = _free_port()
    if path == "connect":
        call = lambda: tr.connect("engine", 1, 2, 1, "127.0.0.1", port, timeout=TIMEOUT)  # noqa: E731
    else:
        call = lambda: _discovery_store("engine", 1, "127.0.0.1", port, TIMEOUT)  # noqa: E731
    error, took = _bounded(call, TIMEOUT + 30)
    assert isinstance(error, tr.ConnectError), error
    text = str(error)
    assert "engine rank 1" in text and f"127.0.0.1:{port}" in text
    assert "connected this process to itself" in text and "ephemeral range" in text, text
    span = tcp_store.ephemeral_ports()
    if span is not None:
        assert f"{span[0]}-{span[1]}" in text and f"below {span[0]}" in text, text
    assert took < TIMEOUT, took


def test_a_store_that_comes_up_late_is_reached() -> None:
    port = _free_port()
    hosted: dict = {}

    def host_later() -> None:
        time.sleep(1.0)
        hosted["store"] = dist.TCPStore("127.0.0.1", port, None, is_master=True, wait_for_workers=False)
        hosted["store"].set("k", "v")

    threading.Thread(target=host_later, daemon=True).start()
    store = tcp_store.open_store("127.0.0.1", port, host=False, world=None, timeout=20.0, who="engine rank 0")
    assert store.get("k") == b"v"


def test_nothing_listening_raises_at_the_deadline() -> None:
    port = _free_port()
    error, took = _bounded(lambda: tcp_store.open_store("127.0.0.1", port, host=False, world=None,
                                                        timeout=1.0, who="engine rank 0"), 30)
    assert isinstance(error, tr.ConnectError) and "nothing listens at" in str(error), error
    assert 0.9 < took < 5, took
