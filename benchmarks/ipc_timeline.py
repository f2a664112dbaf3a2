"""Where a two-process ipc refit spends its time beyond its copies (one GPU).

Two processes on one GPU, the seed's model (``--layers`` to shrink it), TP1 -> TP1
non-collocated: rank 0 (the sender) holds the source, rank 1 (the receiver) the
destination. Every timed iteration starts as ``torchrefit bench`` starts one (device
idle, ranks aligned by a barrier); a rank's time runs from its own start to its
finished device work, and an iteration costs the slower rank's time.

1. ``refit``: whole ``Refitter.refit()`` calls with a timeline, once per ipc order
   (``--variants``: ``word``, the stream-written mailbox words, or ``ready:done``,
   interprocess events, where the receiver waits for the sender's ready event and the
   sender for the receiver's done event, ``host`` or ``stream``):
   host timestamps (``time.perf_counter``, CLOCK_MONOTONIC, comparable between the two
   processes) entering and leaving every one-sided primitive and the refit's binding
   and storage checks on both ranks, and device events (receiver: after
   ``wait_ready`` and before ``done``, bracketing the copies; sender: after
   ``wait_done``).
2. Raw protocols without torchrefit, over the receiver's compiled copies (its CUDA
   graph) and the same two processes, each removing one suspect:
   ``alone`` (the copies, the sender idle), ``events+gloo`` (the refit's protocol:
   Gloo header, interprocess ready event, copies, done event, Gloo token, the sender's
   stream waits), ``events`` (no header), ``host-poll`` (the sender's host polls the
   done event instead of queuing a wait), ``idle-sender`` (the sender's context has
   nothing queued; its host waits for a Gloo message sent after the receiver's copies
   finished), ``flags`` (no host message at all: a ready and a done word in the
   sender's memory, written and waited for on the streams with
   ``cuStreamWriteValue32`` / ``cuStreamWaitValue32``), ``flags+gloo`` (as ``flags``
   with the Gloo header kept).
3. Gloo's round trip for a 128-byte message.

    python benchmarks/ipc_timeline.py [--layers 20] [--iters 30] [--variants word,host:host]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import torchrefit as tr
from torchrefit._cuda_driver import driver_function
from torchrefit.bench.world import one_gpu_toy_pair
from torchrefit.testing import run_world
from torchrefit.transport.ipc import IpcTransport, export_segments

SENDER, RECEIVER = 0, 1
PHASES = ("ready", "post_header", "recv_header", "wait_ready", "done", "post_done", "recv_done", "wait_done",
          "settle")
_HDR, _TOK, _FIN, _PING, _PONG = 41, 42, 43, 44, 45


class Memops:
    """``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` on the current stream, through
    the driver library (ctypes: no cuda-python needed)."""

    GEQ = 0x0

    def __init__(self) -> None:
        args = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._write = driver_function("cuStreamWriteValue32", args)
        self._wait = driver_function("cuStreamWaitValue32", args)

    def write(self, addr: int, value: int) -> None:
        rc = self._write(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), addr, value, 0)
        if rc:
            raise RuntimeError(f"cuStreamWriteValue32 failed: CUresult {rc}")

    def wait(self, addr: int, value: int) -> None:
        rc = self._wait(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), addr, value, self.GEQ)
        if rc:
            raise RuntimeError(f"cuStreamWaitValue32 failed: CUresult {rc}")


def _send(peer: int, tag: int) -> object:
    return dist.isend(torch.zeros(128, dtype=torch.uint8), peer, tag=tag)


def _recv(peer: int, tag: int) -> None:
    dist.recv(torch.empty(128, dtype=torch.uint8), peer, tag=tag)


def _ping(rank: int, n: int = 200) -> float:
    buf, times = torch.zeros(128, dtype=torch.uint8), []
    for _ in range(n):
        t = time.perf_counter()
        if rank == SENDER:
            dist.send(buf, RECEIVER, tag=_PING)
            dist.recv(buf, RECEIVER, tag=_PONG)
        else:
            dist.recv(buf, SENDER, tag=_PING)
            dist.send(buf, SENDER, tag=_PONG)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


# ----------------------------------------------------------------- 1. refit timeline
def _refit_timeline(r, iters: int) -> list[dict]:
    tp = r._transport
    marks: list[tuple[str, float]] = []
    events: dict[str, torch.cuda.Event] = {}
    # the refit's own host work before the exchange (binding and storage checks)
    for obj, name in ((r, "_rebind"), (r._program, "check_storage")):
        _host_marks(obj, name, marks)

    def device_mark(name: str) -> None:
        events[name] = torch.cuda.Event(enable_timing=True)
        events[name].record()

    def wrap(name: str) -> None:
        f = getattr(tp, name)
        before = (lambda: device_mark("copies_end")) if name == "done" else None
        after = {"wait_ready": lambda: device_mark("copies_start"),
                 "wait_done": lambda: device_mark("done_seen")}.get(name)

        def timed(*a, **k):
            marks.append((name + ">", time.perf_counter()))
            if before:
                before()
            out = f(*a, **k)
            if after:
                after()
            marks.append((name + "<", time.perf_counter()))
            return out

        setattr(tp, name, timed)

    for name in PHASES:
        wrap(name)
    rows = []
    try:
        for _ in range(iters):
            torch.cuda.synchronize()
            dist.barrier()
            marks.clear()
            events.clear()
            t0 = time.perf_counter()
            device_mark("t0")
            r.refit()
            returned = time.perf_counter()
            device_mark("end")
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            rows.append({"t0": t0, "returned": returned, "end": t1, "marks": list(marks),
                         "device_ms": {k: events["t0"].elapsed_time(e) for k, e in events.items() if k != "t0"}})
    finally:
        for name in PHASES:
            delattr(tp, name)  # the class's methods again
        del r._rebind, r._program.check_storage
    return rows


def _host_marks(obj, name: str, marks: list) -> None:
    f = getattr(obj, name)

    def timed(*a, **k):
        marks.append((name + ">", time.perf_counter()))
        out = f(*a, **k)
        marks.append((name + "<", time.perf_counter()))
        return out

    setattr(obj, name, timed)


# ---------------------------------------------------------------- 2. raw protocols
def _raw(r, rank: int, iters: int) -> dict:
    one = r._program.compiled.one_sided
    copies = one._pulls[1] if rank == RECEIVER else None
    replay = (copies.graph.replay if copies.graph is not None else lambda: copies.run_on_caller(one.side)) \
        if copies is not None else None
    device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.cuda.Event(interprocess=True)
    handles: list = [None, None]
    dist.all_gather_object(handles, mine.ipc_handle())
    peer = torch.cuda.Event.from_ipc_handle(device, handles[1 - rank])
    memops, flags_error = None, None
    try:  # probe on a word of its own first: a wait that never ends would hang the device
        memops = Memops()
        scratch = torch.zeros(1, dtype=torch.int32, device=device)
        memops.write(scratch.data_ptr(), 7)
        memops.wait(scratch.data_ptr(), 7)
        torch.cuda.synchronize()
        if int(scratch.item()) != 7:
            raise RuntimeError(f"the written word reads {int(scratch.item())}")
    except Exception as e:
        memops, flags_error = None, f"{type(e).__name__}: {e}"
    usable: list = [None, None]
    dist.all_gather_object(usable, memops is not None)
    memops = memops if all(usable) else None
    # the ready word at [0], the done word at [32] (another 128-byte line), in the sender's memory
    flags = torch.zeros(64, dtype=torch.int32, device=device) if rank == SENDER else None
    table: list = [export_segments([flags]) if rank == SENDER else None]
    dist.broadcast_object_list(table, src=SENDER)
    if rank == SENDER:
        ready_addr = flags.data_ptr()
    else:
        (segment,), (exported,) = table[0]
        mapped = torch.UntypedStorage._new_shared_cuda(*segment.share)
        ready_addr = mapped.data_ptr() + exported.offset
    done_addr = ready_addr + 128
    seq = [0]
    stream = torch.cuda.current_stream

    def copies_timed() -> tuple:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        return a, b

    def alone(k: int):
        return copies_timed() if rank == RECEIVER else None

    def events_gloo(k: int):
        if rank == SENDER:
            mine.record()
            w = _send(RECEIVER, _HDR)
            _recv(RECEIVER, _TOK)
            stream().wait_event(peer)
            w.wait()
            return None
        _recv(SENDER, _HDR)
        stream().wait_event(peer)
        ab = copies_timed()
        mine.record()
        _send(SENDER, _TOK).wait()
        return ab

    def events(k: int, poll: bool = False):
        if rank == SENDER:
            _recv(RECEIVER, _TOK)
            if poll:
                while not peer.query():
                    pass
            else:
                stream().wait_event(peer)
            return None
        ab = copies_timed()
        mine.record()
        _send(SENDER, _TOK).wait()
        return ab

    def idle_sender(k: int):
        if rank == SENDER:
            _recv(RECEIVER, _FIN)
            return None
        ab = copies_timed()
        ab[1].synchronize()
        _send(SENDER, _FIN).wait()
        return ab

    def flags_(k: int, header: bool = False):
        seq[0] += 1
        if rank == SENDER:
            memops.write(ready_addr, seq[0])
            w = _send(RECEIVER, _HDR) if header else None
            memops.wait(done_addr, seq[0])
            if w is not None:
                w.wait()
            return None
        if header:
            _recv(SENDER, _HDR)
        memops.wait(ready_addr, seq[0])
        ab = copies_timed()
        memops.write(done_addr, seq[0])
        return ab

    steps: dict[str, Callable[[int], object]] = {
        "alone": alone, "events+gloo": events_gloo, "events": events,
        "host-poll": lambda k: events(k, poll=True), "idle-sender": idle_sender}
    if memops is not None:
        steps["flags"] = flags_
        steps["flags+gloo"] = lambda k: flags_(k, header=True)
    out = {"flags_error": flags_error}
    for name, step in steps.items():
        try:
            out[name] = _aligned(step, iters)
        except Exception as e:  # one broken protocol must not hide the others
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            torch.cuda.synchronize()
            dist.barrier()
    return out


def _aligned(step: Callable[[int], object], iters: int) -> dict:
    walls, copies = [], []
    for k in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        ab = step(k)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        if ab is not None:
            copies.append(ab[0].elapsed_time(ab[1]))
    return {"wall_ms": walls, "copies_ms": copies}


# ------------------------------------------------------------------------- driver
def _refitter(src, dst, variant: str):
    """A warm ipc Refitter ordered as ``variant`` says, whatever the environment says:
    ``"word"`` (stream-written mailbox words), or ``"ready:done"`` (interprocess events,
    each wait ``host`` or ``stream``)."""
    device = torch.device("cuda", torch.cuda.current_device())
    if variant == "word":
        transport = IpcTransport(dist.group.WORLD, device, order="word")
    else:
        ready, done = variant.split(":")
        transport = IpcTransport(dist.group.WORLD, device, done_wait=done, ready_wait=ready, order="event")
    r = tr.Refitter(src, dst, transport=transport)
    for _ in range(5):
        r.refit()
    torch.cuda.synchronize()
    dist.barrier()
    return r


def _rank(rank: int, world: int, layers: int, iters: int, variants: list[str]) -> dict:
    src, dst = one_gpu_toy_pair(rank, layers)
    out = {"rank": rank, "gloo_rtt_us": _ping(rank), "refits": {}}
    for variant in variants[1:]:
        other = _refitter(src, dst, variant)
        out["refits"][variant] = _refit_timeline(other, iters)
        other.close()
    r = _refitter(src, dst, variants[0])  # the raw protocols reuse its compiled copies
    out["refits"][variants[0]] = _refit_timeline(r, iters)
    out["raw"] = _raw(r, rank, iters)
    nbytes = r.plan.bytes_received
    if rank == RECEIVER:
        flat = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
        out["flat_copy_ms"] = _aligned(lambda k: _flat(flat), iters)["copies_ms"]
    else:
        _aligned(lambda k: None, iters)
    out["bytes"] = nbytes
    torch.cuda.synchronize()
    dist.barrier()
    r.close()
    return out


def _flat(bufs: list[torch.Tensor]) -> tuple:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    bufs[1].copy_(bufs[0])
    b.record()
    return a, b


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(ranks: list[dict]) -> list[str]:
    snd, rcv = ranks[SENDER], ranks[RECEIVER]
    lines = [f"{rcv['bytes'] / 1e9:.2f} GB received; gloo round trip (128 B) {snd['gloo_rtt_us']:.0f} us; "
             f"one flat local copy {_med(rcv['flat_copy_ms']):.3f} ms"]
    totals = []
    for variant in snd["refits"]:
        lines.append(f"refit timeline, ipc order {variant}, medians in ms from the sender's start "
                     "(S: sender, R: receiver):")
        lines += _timeline(snd["refits"][variant], rcv["refits"][variant])
        totals.append(f"  {variant:<12} iteration {_med(_iterations(snd, rcv, variant)):.3f}")
    lines.append("refits, per ipc order: median iteration (slower rank) in ms")
    lines += totals
    return lines + _raw_lines(snd, rcv)


def _iterations(snd: dict, rcv: dict, variant: str) -> list[float]:
    return [max(s["end"] - s["t0"], r["end"] - r["t0"]) * 1e3
            for s, r in zip(snd["refits"][variant], rcv["refits"][variant])]


def _timeline(srows: list[dict], rrows: list[dict]) -> list[str]:
    lines = []
    rel: dict[str, list[float]] = {}
    for s, r in zip(srows, rrows):
        base = s["t0"]
        for who, row in (("S", s), ("R", r)):
            rel.setdefault(f"{who} start", []).append((row["t0"] - base) * 1e3)
            for name, t in row["marks"]:
                rel.setdefault(f"{who} {name}", []).append((t - base) * 1e3)
            rel.setdefault(f"{who} host returned", []).append((row["returned"] - base) * 1e3)
            rel.setdefault(f"{who} device idle (sync returned)", []).append((row["end"] - base) * 1e3)
            for k, ms in row["device_ms"].items():
                rel.setdefault(f"{who} device {k}", []).append((row["t0"] - base) * 1e3 + ms)
        rel.setdefault("iteration (slower rank)", []).append(
            max(s["end"] - s["t0"], r["end"] - r["t0"]) * 1e3)
    for key, xs in sorted(rel.items(), key=lambda kv: _med(kv[1])):
        lines.append(f"  {_med(xs):8.3f}  {key}")
    return lines


def _raw_lines(snd: dict, rcv: dict) -> list[str]:
    lines = []
    lines.append("raw protocols over the same copies: median ms (iteration = slower rank; copies = receiver's device time)")
    if rcv["raw"].get("flags_error"):
        lines.append(f"  flags unavailable: {rcv['raw']['flags_error']}")
    for name, got in rcv["raw"].items():
        if name == "flags_error":
            continue
        other = snd["raw"].get(name, {})
        if "error" in got or "error" in other:
            lines.append(f"  {name:<12} failed: {got.get('error') or other.get('error')}")
            continue
        it = [max(a, b) for a, b in zip(got["wall_ms"], other["wall_ms"])]
        lines.append(f"  {name:<12} iteration {_med(it):.3f}  receiver {_med(got['wall_ms']):.3f}  "
                     f"sender {_med(other['wall_ms']):.3f}  copies {_med(got['copies_ms']):.3f}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--variants", default="word,host:host",
                   help="comma list of ipc orders to time: word, or ready:done (events, host|stream each); "
                        "the first also serves the raw protocols")
    p.add_argument("--json")
    args = p.parse_args()
    ranks = run_world(_rank, 2, args.layers, args.iters, args.variants.split(","), backend="gloo", timeout=240)
    print("\n".join(summarize(ranks)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ranks, f)


if __name__ == "__main__":
    main()
