"""Opening a rendezvous ``TCPStore``: every wait bounded by the timeout, a self-connect refused.

A ``TCPStore`` client retries its connection until its timeout, but once connected it
waits for the server's answers with no bound at all: a peer that accepted the
connection and never answers (a stuck process, something else on the port) holds the
client's constructor forever, whatever ``timeout`` said. One such peer is the client
itself. Where ``port`` lies in the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, usually 32768-60999) and no store listens
there yet, a retried ``connect()`` may be given ``port`` as its own source port, and TCP's
simultaneous open connects the socket to itself: the client reads back its own requests
and waits.

So a client here first connects a plain socket, retrying until the deadline while the
host is not up; a socket whose local and peer addresses are the same is a self-connect,
refused with an error that says to choose a port below the range. Then the store is
built on a helper thread and waited for until the deadline; a store that does not
answer raises :class:`~torchrefit.errors.ConnectError` (the helper thread is left
blocked in torch's constructor: nothing can interrupt it, and it is a daemon).
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from pathlib import Path

import torch.distributed as dist

from ..errors import ConnectError

__all__ = ["open_store", "ephemeral_ports", "NoListener"]

_RETRY = 0.05  # seconds between connection attempts while the host is not listening yet
_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


class NoListener(ConnectError):
    """Nothing listened at the store's address until the deadline (callers say who
    should have hosted it)."""


def ephemeral_ports() -> tuple[int, int] | None:
    """The kernel's ephemeral port range (first, last), or None where it cannot be read."""
    try:
        first, last = (int(p) for p in _RANGE.read_text().split())
        return first, last
    except (OSError, ValueError):
        return None


def open_store(address: str, port: int, *, host: bool, world: int | None, timeout: float,
               who: str) -> dist.TCPStore:
    """The store on ``address:port``: hosted here (``host``) or connected to, within
    ``timeout`` seconds in all. ``who`` names the caller in errors (``"engine rank 1"``)."""
    td = datetime.timedelta(seconds=timeout)
    if host:  # binding and listening do not wait for anyone
        return dist.TCPStore(address, port, world, is_master=True, timeout=td, wait_for_workers=False)
    deadline = time.monotonic() + timeout
    _reach(address, port, deadline, timeout, who)
    return _bounded(lambda: dist.TCPStore(address, port, world, is_master=False, timeout=td,
                                          wait_for_workers=False),
                    deadline, f"{who}: the store at {address}:{port} accepted the connection but did "
                              f"not answer within {timeout:g} s (is something else listening on "
                              "that port?)")


def _reach(address: str, port: int, deadline: float, timeout: float, who: str) -> None:
    """Return once something listens on ``address:port``; raise on a self-connect or at
    the deadline."""
    last: Exception | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise NoListener(f"{who}: nothing listens at {address}:{port} after {timeout:g} s: "
                               f"{type(last).__name__}: {last}")
        try:
            sock = socket.create_connection((address, port), timeout=left)
        except OSError as e:  # refused or unreachable: the host may not be up yet
            last = e
            time.sleep(min(_RETRY, max(0.0, deadline - time.monotonic())))
            continue
        with sock:
            if sock.getsockname() == sock.getpeername():
                raise ConnectError(_self_connect(who, address, port))
        return


def _self_connect(who: str, address: str, port: int) -> str:
    span = ephemeral_ports()
    where = (f"it lies in the kernel's ephemeral range {span[0]}-{span[1]}" if span
             else "it lies in the kernel's ephemeral range")
    below = f" (below {span[0]})" if span else ""
    return (f"{who}: connecting to the store at {address}:{port} connected this process to "
            f"itself: no store listened there yet, and the kernel gave the connection that same "
            f"port as its own source port, which happens where {where}. Choose a port outside "
            f"that range{below} for the store, on both jobs")


def _bounded(build, deadline: float, error: str):
    """``build()`` on a daemon thread, waited for until ``deadline``."""
    out: dict = {}

    def run() -> None:
        try:
            out["store"] = build()
        except BaseException as e:  # handed to the caller below
            out["error"] = e

    worker = threading.Thread(target=run, name="torchrefit-store-connect", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()) + 1.0)  # torch's own timeout first
    if "error" in out:
        raise out["error"]
    if "store" not in out:
        raise ConnectError(error)
    return out["store"]
