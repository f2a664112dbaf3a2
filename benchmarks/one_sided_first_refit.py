"""Where a one-sided transport's first refit and its copies spend their time (one GPU).

Two processes on one GPU, the seed's model (``--layers`` to shrink it), TP1 -> TP1
non-collocated: rank 0 holds the source, rank 1 the destination (``--collocated``: TP2 ->
TP1 collocated, where ipc's rank 0 copies for both, ``transport.delegates``). Each rank profiles
construction plus the first refit with cProfile and prints its top functions; the
receiver then times, with CUDA events and the device idle before each, (a) a whole
refit (wall time; when its host returned; when the peer's header arrived, after
which the copies can start; device time between events around it; on the host clock the
processes share, when each rank left the barrier, sent and saw a header, returned
and saw its device work finished), (b) the replay of its compiled copies out of the sender's memory alone (ipc),
and (c) the same bytes copied locally by one flat copy (the floor's kernel). The shared
clock also marks when each rank passed each step of its refit (``_STEPS``: its checks,
its header out or in, its copies queued, its done word out or in).

    python benchmarks/one_sided_first_refit.py --transport ipc [--layers 20] [--collocated [--nproc 4]] [--warm-profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
import torch.distributed as dist

import torchrefit as tr
from torchrefit.bench.world import one_gpu_toy_pair
from torchrefit.testing import run_world
from torchrefit.transport.ipc import StreamWords


def _device_ms(fn, iters: int = 20) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


#: steps of a refit marked on the shared host clock (when each first returned in an
#: iteration): (whose method, its name)
_STEPS = {
    "holders": ("refitter", "_rebind"),        # the holders check (watch="every")
    "views": ("program", "check_storage"),     # the storage and views check
    "ready": ("transport", "ready"),           # a target's ready token made (ipc: its word's kind)
    "queried": ("words", "_query"),            # ipc's word: its first stream query (is the stream idle?)
    "posted": ("transport", "post_header"),    # a target's header out (its ready word)
    "seen": ("transport", "recv_header"),      # an initiator's first peer header in
    "queued": ("one_sided", "_transfer"),      # the copies out of the peer's memory queued
    "done": ("transport", "post_done"),        # an initiator's done word out
    "acked": ("transport", "recv_done"),       # a target's first done word in
    "settled": ("one_sided", "finish"),        # a target's exchange over (its waits and settle)
    "ran": ("program", "run"),                 # the program's run over (then the refit's tail)
}


def _mark_after(obj, attr: str, step: str, marks: dict[str, float]) -> None:
    """Wrap ``obj.attr`` (an instance attribute shadows the method) so that the first
    return in an iteration stamps ``marks[step]``."""
    inner = getattr(obj, attr)

    def timed(*args, **kwargs):
        out = inner(*args, **kwargs)
        marks.setdefault(step, time.perf_counter())
        return out
    setattr(obj, attr, timed)


def mark_steps(r: tr.Refitter, marks: dict[str, float], cuda: bool = True) -> None:
    """Stamp each of ``_STEPS`` of ``r``'s compiled refit into ``marks`` (after a refit, so
    that what the first one made exists); ``cuda``: also ipc's first stream query (its
    ``StreamWords``' driver query)."""
    program = r._program
    # (src before the twenty-third session queried through torch's Stream: not stamped)
    words = [w for w in getattr(r._transport, "_writers", {}).values()
             if isinstance(w, StreamWords) and hasattr(w, "_query")]
    owners = {"refitter": r, "program": program, "transport": r._transport,
              "one_sided": program.compiled.one_sided, "words": words[0] if cuda and words else None}
    for step, (owner, attr) in _STEPS.items():
        if owners[owner] is not None:
            _mark_after(owners[owner], attr, step, marks)


def _rank(rank: int, world: int, transport: str, layers: int, collocated: bool, warm_profile: bool) -> tuple:
    src, dst = one_gpu_toy_pair(rank, layers, collocated, world)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    r = tr.Refitter(src, dst, transport=transport)
    t1 = time.perf_counter()
    r.refit()
    torch.cuda.synchronize()
    prof.disable()
    t2 = time.perf_counter()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
    lines = [f"rank {rank}: construct {t1 - t0:.3f} s, first refit {t2 - t1:.3f} s"]
    whole, header, launched, device = [], [], [], []
    # per iteration, on the host clock every process shares (perf_counter: CLOCK_MONOTONIC):
    # when this rank left the barrier, passed each step of its refit (the first time in the
    # iteration), returned, and saw its device work finished
    clock: dict[str, list[float]] = {k: [] for k in ("start", *_STEPS, "returned", "finished")}
    marks: dict[str, float] = {}
    mark_steps(r, marks)
    one = r._program.compiled.one_sided
    # no event on a pure sender's stream: it would keep the stream busy past refit() and
    # so turn the host-written ready word into a stream-written one (transport.ipc.StreamWords)
    events = not (one is not None and one.compiled.targets and not one.compiled.initiated)
    for _ in range(20):
        torch.cuda.synchronize()
        dist.barrier()
        marks.clear()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        clock["start"].append(t)
        if events:
            a.record()
        r.refit()
        clock["returned"].append(time.perf_counter())
        launched.append((clock["returned"][-1] - t) * 1e3)
        if events:
            b.record()
        torch.cuda.synchronize()
        clock["finished"].append(time.perf_counter())
        whole.append((clock["finished"][-1] - t) * 1e3)
        if events:
            device.append(a.elapsed_time(b))
        if "seen" in marks:
            header.append((marks["seen"] - t) * 1e3)
        for step in _STEPS:
            clock[step].append(marks.get(step, float("nan")))
    if warm_profile:  # the host's work of warm refits alone (the device idle and ranks aligned before each)
        warm = cProfile.Profile()
        for _ in range(50):
            torch.cuda.synchronize()
            dist.barrier()
            warm.enable()
            r.refit()
            warm.disable()
        text = io.StringIO()
        pstats.Stats(warm, stream=text).sort_stats("tottime").print_stats(22)
        lines.append(f"rank {rank}: 50 warm refits, by own time\n" + "\n".join(text.getvalue().splitlines()[4:34]))
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
    lines.append(f"rank {rank}: refit wall ms median {med(whole):.3f}; host returned after {med(launched):.3f}, "
                 f"header arrived after {med(header):.3f}; device start-to-end {med(device):.3f}")
    one = r._program.compiled.one_sided
    pulls = one._pulls[1] if one is not None and one._pulls is not None else None
    if pulls is not None and pulls.graph is not None:
        nbytes = sum(c.dst.nbytes for c in pulls.copies())
        try:
            flat = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
        except torch.OutOfMemoryError:  # a delegate of 4 processes on an 80 GB GPU
            lines.append(f"rank {rank}: {nbytes / 1e9:.2f} GB pulled; no room for the flat copy")
        else:
            lines.append(f"rank {rank}: {nbytes / 1e9:.2f} GB; mapped-copies graph replay "
                         f"{_device_ms(pulls.graph.replay):.3f} ms, "
                         f"one flat local copy {_device_ms(lambda: flat[1].copy_(flat[0])):.3f} ms, "
                         f"{len(pulls.big)} large + {sum(len(g.dst) for g in pulls.small)} small copies")
    dist.barrier()
    r.close()
    return "\n".join(lines) + "\n" + "\n".join(out.getvalue().splitlines()[:52]), clock


def _skew(clocks: list[dict]) -> str:
    """Per rank, medians over iterations (ms after the first rank left the barrier) of
    when it left the barrier and passed each step of its refit (``_STEPS``): how much of
    a receiver's wait for a header is the barrier's skew, how much the sender's host
    work before its header, how much its own work after it."""
    def med(xs):
        xs = sorted(x for x in xs if x == x)
        return xs[len(xs) // 2] if xs else float("nan")

    first = [min(c["start"][i] for c in clocks) for i in range(len(clocks[0]["start"]))]
    rows = []
    for rank, c in enumerate(clocks):
        rel = {k: med([(v - f) * 1e3 for v, f in zip(c[k], first)]) for k in c}
        steps = ", ".join(f"{k} {v:.3f}" for k, v in rel.items() if v == v and k not in ("start",))
        rows.append(f"rank {rank}: left the barrier {rel['start']:.3f}; {steps} (ms after the first rank left it)")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", default="ipc")
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--collocated", action="store_true")
    p.add_argument("--nproc", type=int, default=2, help="processes (collocated only: TP2 x DP over them)")
    p.add_argument("--warm-profile", action="store_true", help="also profile 50 warm refits per rank")
    args = p.parse_args()
    if args.nproc != 2 and not args.collocated:
        p.error("--nproc other than 2 needs --collocated")
    results = run_world(_rank, args.nproc, args.transport, args.layers, args.collocated, args.warm_profile,
                        backend="gloo", timeout=600)
    for text, _ in results:
        print(text)
    print(_skew([clock for _, clock in results]))


if __name__ == "__main__":
    main()
