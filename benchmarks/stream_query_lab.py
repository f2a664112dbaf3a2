"""What a host-side stream query, event query and stream-written word cost in a process
sharing its GPU with another (as ipc's two processes do), and what each costs alone.

Two processes on GPU 0. Rank 1 never touches CUDA (*solo*: rank 0 alone on the GPU),
holds a context and idles, or keeps the GPU busy with copies (its context then holds the
GPU for 20 s); rank 0 times each step right after its host waited for the device
(*cold*: a 7 ms GPU sleep, then ``synchronize``, as a timed refit starts) and back to
back (*hot*), in microseconds (median of 30). Each world prints its row as it ends.
Written after the twenty-second session's device time was spent; the solo world and the
steps from ``event_record`` on came in the twenty-third (no device then): not yet run.

* ``current_stream``: ``torch.cuda.current_stream(device)`` (a Python Stream object);
* ``query_idle``: ``stream.query()`` on rank 0's idle current stream (what ipc's ready
  word does first, ``transport.ipc.StreamWords``);
* ``query_busy``: the same with a copy of rank 0's own queued on it (what the receiver's
  done word does first);
* ``event_query``: ``Event.query()`` of an event recorded on the idle stream;
* ``copy_then_word``: a copy queued, then a word (``StreamWords``: its query finds the
  stream busy and queues one ``cuStreamWriteValue64`` into registered host memory);
* ``raw_write``: that ``cuStreamWriteValue64`` alone, through ctypes;
* ``raw_query_idle``: what ``StreamWords`` asks since the twenty-third session: the raw
  handle of the current stream and the driver's ``cuStreamQuery`` on it;
* ``event_record``: ``Event.record()`` on the current stream (what a benchmark's timing
  event costs the rank that records it);
* ``synchronize_idle``: ``torch.cuda.synchronize()`` with nothing queued (a benchmark's
  wait after a sender's refit returned);
* ``sched_yield``: one ``os.sched_yield()``, what each turn of a spinning host poll makes
  (``transport.base.poll_until``).

    python benchmarks/stream_query_lab.py [--json OUT]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time

import torch
import torch.distributed as dist
from watch_check_lab import after_wait_us, median_us_after

from torchrefit._cuda_driver import driver_function
from torchrefit.testing import run_world
from torchrefit.transport.ipc import StreamWords
from torchrefit.transport.mailbox import Mailbox

_BUSY_S = 20.0  # seconds the busy peer copies: rank 0's timings take a few


def _us(fn, cold: bool, n: int = 30) -> float:
    """Median microseconds of ``fn``: right after a 7 ms wait for the device
    (``watch_check_lab.after_wait_us``), or back to back."""
    if cold:
        return after_wait_us(fn, torch.device("cuda", 0), wait_ms=7.0, calls=n)
    return median_us_after(fn, lambda: None, n)


def _rank(rank: int, world: int, peer: str) -> dict:
    out: dict = {}
    if rank == 1 and peer == "solo":  # no CUDA context in this process
        dist.barrier()
        dist.barrier()
        return out
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    a, b = (torch.empty(1 << 28, dtype=torch.uint8, device=device) for _ in range(2))
    busy_peer = peer == "busy"
    if rank == 1:
        dist.barrier()
        # busy: copies for a fixed time, longer than rank 0's timings. No message ends the
        # loop: the first form of this lab ended it on a gloo irecv's is_completed() and hung
        # on the device, most likely there (not confirmed)
        end = time.monotonic() + (_BUSY_S if busy_peer else 0.0)
        while time.monotonic() < end:
            for _ in range(8):
                b.copy_(a)
            torch.cuda.synchronize()
        dist.barrier()
        return out
    dist.barrier()
    box = Mailbox.create(2)
    words = StreamWords(box, device)
    stream = torch.cuda.current_stream(device)
    event = torch.cuda.Event()

    def query_busy() -> None:
        b.copy_(a)
        stream.query()

    def event_query() -> None:
        event.record(stream)
        event.query()

    query = driver_function("cuStreamQuery", [ctypes.c_void_p])
    raw = torch._C._cuda_getCurrentRawStream

    for cold in (True, False):
        tag = "cold" if cold else "hot"
        print(f"rank 0: timing {tag}", flush=True)
        out[f"current_stream_{tag}"] = _us(lambda: torch.cuda.current_stream(device), cold)
        out[f"query_idle_{tag}"] = _us(stream.query, cold)
        out[f"query_busy_{tag}"] = _us(query_busy, cold)  # includes queuing the copy
        out[f"copy_queued_{tag}"] = _us(lambda: b.copy_(a), cold)
        out[f"event_query_{tag}"] = _us(event_query, cold)
        out[f"copy_then_word_{tag}"] = _us(lambda: (b.copy_(a), words(0, 1)), cold)
        out[f"raw_write_{tag}"] = _us(lambda: words._write(ctypes.c_void_p(stream.cuda_stream), words._base, 1, 0),
                                      cold)
        torch.cuda.synchronize()  # the hot copies above are still queued: idle again first
        out[f"raw_query_idle_{tag}"] = _us(lambda: query(raw(0)), cold)
        out[f"event_record_{tag}"] = _us(lambda: event.record(), cold)
        out[f"synchronize_idle_{tag}"] = _us(torch.cuda.synchronize, cold)
        out[f"sched_yield_{tag}"] = _us(os.sched_yield, cold)
    torch.cuda.synchronize()
    dist.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = {}
    for peer in ("solo", "idle", "busy"):
        key = f"peer_{peer}"
        rows[key] = run_world(_rank, 2, peer, backend="gloo", timeout=120)[0]
        print(key, " ".join(f"{n}={u}" for n, u in rows[key].items()), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
