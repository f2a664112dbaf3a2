"""What small host steps of a refit cost right after the host waited, caches cold, as
every timed refit starts: microseconds per call, median of ``--calls``, *hot* (back to
back), after a 1 ms *sleep*, and *cold* (on a GPU right after a ``--wait-ms`` GPU sleep
and ``synchronize``; on a CPU right after writing 64 MiB, which evicts the caches).

Pairs timed (the form a refit used before, then the form it uses now):

* ``no_grad`` / ``grad_toggle``: ``with torch.no_grad()`` around nothing, against the
  grad mode switched off and back by hand (``execute.program._grad_off``);
* ``set_aside``: a no-op through ``_caller_state.set_aside`` (every ``refit()``);
* ``refit_report``: building a ``RefitReport`` (every ``refit()``'s tail);
* ``word_store_ctypes`` / ``word_store``: a mailbox word stored through a ctypes object
  made per store, as ``Mailbox.store`` did, against ``Mailbox.store`` now (an item of an
  int64 view);
* ``environ_get``: ``os.environ.get`` of one variable (``ready()`` read
  ``TORCHREFIT_MAILBOX`` on every refit);
* ``current_stream_python``: the Python ``torch.cuda.current_stream(device)`` runs before
  its C call (device index, lazy-init and build checks); on CUDA also the whole
  ``current_stream(device).query()`` against ``StreamWords``' raw handle and driver
  ``cuStreamQuery`` (``stream_query_torch`` / ``stream_query_raw``);
* on CUDA, ``torch.cuda.synchronize(device)`` with nothing queued against the bench's
  wait after each timed call since the twenty-third session (``bench.timing._sync``:
  torch's C call alone) (``synchronize_torch`` / ``synchronize_bench``).

    python benchmarks/cold_host_calls.py [--calls 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time

import torch
from torch.cuda._utils import _get_device_index
from watch_check_lab import host_waits, median_us_after

from torchrefit._caller_state import set_aside
from torchrefit.bench.timing import _sync
from torchrefit.execute.program import _grad_off
from torchrefit.refitter import RefitReport
from torchrefit.transport.mailbox import Mailbox


def _waits(device: torch.device, wait_ms: float) -> list:
    """``(name, wait)`` pairs: what runs before each timed call."""
    return [("hot", lambda: None), ("sleep", lambda: time.sleep(0.001)),
            ("cold", host_waits(device, wait_ms, flush_mib=64))]


def _steps(device: torch.device) -> dict:
    @set_aside
    def noop() -> None:
        pass

    def no_grad() -> None:
        with torch.no_grad():
            pass

    def grad_toggle() -> None:
        was = _grad_off()
        try:
            pass
        finally:
            torch._C._set_grad_enabled(was)

    cuda = torch.device("cuda", 0)

    def current_stream_python() -> None:  # what runs in Python before its C call
        torch.cuda.is_initialized()
        _get_device_index(cuda, optional=True)
        torch.backends.cuda.is_built()

    args = (1, 0.1, 10, 20, 30, "ipc", 0, 1, 1, 0, False, 0, 0, 0, 0, 0)
    box = Mailbox.create(2)

    def word_store_ctypes() -> None:
        ctypes.c_int64.from_address(box.address + 8).value = 5

    steps = {"no_grad": no_grad, "grad_toggle": grad_toggle, "set_aside": noop,
             "refit_report": lambda: RefitReport(*args), "word_store_ctypes": word_store_ctypes,
             "word_store": lambda: box.store(1, 5), "environ_get": lambda: os.environ.get("TORCHREFIT_MAILBOX", "1"),
             "current_stream_python": current_stream_python}
    if device.type == "cuda":
        from torchrefit._cuda_driver import driver_function

        query = driver_function("cuStreamQuery", [ctypes.c_void_p])
        raw = torch._C._cuda_getCurrentRawStream
        steps["stream_query_torch"] = lambda: torch.cuda.current_stream(device).query()
        steps["stream_query_raw"] = lambda: query(raw(device.index))
        steps["synchronize_torch"] = lambda: torch.cuda.synchronize(device)
        steps["synchronize_bench"] = lambda: _sync(device)  # the bench's wait since the twenty-third session
    return steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--wait-ms", type=float, default=7.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "calls": args.calls}
    waits = _waits(device, args.wait_ms)
    for name, fn in _steps(device).items():
        fn()
        out[name] = {when: median_us_after(fn, wait, args.calls) for when, wait in waits}
        print(name, out[name], flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
