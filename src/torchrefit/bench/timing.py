"""Timing refits honestly: each iteration starts with the device idle, and the floor
(what the hardware cannot beat) is measured in the same run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["copy_bandwidth", "link_bandwidth", "time_calls", "median_ms", "host_times", "median_host_ms",
           "device_times", "summarize", "sleep_cycles_per_ms"]


def _sync(device: torch.device) -> None:
    """Wait for ``device``'s work. Where it is the current device (every bench rank sets
    its own), torch's C call alone: the wait that ends each timed call belongs to the
    harness, not to what is timed, and ``torch.cuda.synchronize``'s Python (a device
    switch and back) runs right after the call, caches cold, in every iteration."""
    if device.type != "cuda":
        return
    if device.index == torch._C._cuda_getDevice():
        torch._C._cuda_synchronize()
    else:
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 4 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    if device.type != "cuda":
        nbytes = min(nbytes, 256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    seconds = (time.perf_counter() - t0) / reps
    del src, dst
    return 2 * nbytes / seconds


def link_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 5) -> float | None:
    """Point-to-point bandwidth between ranks 0 and 1 in bytes/s per direction, both
    directions at once (a large send and receive each way). Collective: every rank of
    the world calls it; ranks other than 0 and 1 only wait. None for a single rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return None
    if device.type != "cuda":
        nbytes = min(nbytes, 64 << 20)
    out: list[float | None] = [None]
    if rank < 2:
        send = torch.empty(nbytes, dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)
        peer = 1 - rank

        def exchange() -> None:
            ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        exchange()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            exchange()
        _sync(device)
        out[0] = nbytes * reps / (time.perf_counter() - t0)
    dist.barrier()
    return out[0]


def time_calls(fn: Callable[[], object], warmup: int, iters: int, device: torch.device,
               group: dist.ProcessGroup | None = None) -> list[float]:
    """Seconds per call; before each call the device is idle and all ranks are aligned,
    after it the device has finished (as Megatron's ``benchmark_refit.py`` times)."""
    def align() -> None:
        _sync(device)
        if dist.is_initialized():
            dist.barrier(group=group)

    for _ in range(warmup):
        align()
        fn()
    out = []
    for _ in range(iters):
        align()
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    align()
    return out


def median_ms(fn: Callable[[], object], iters: int, device: torch.device, warmup: int = 3) -> float:
    """Median milliseconds per call, timed as :func:`time_calls` times (the benchmark
    scripts' one measure of a call's device work)."""
    return 1e3 * statistics.median(time_calls(fn, warmup, iters, device))


def sleep_cycles_per_ms(device: torch.device) -> float:
    """``torch.cuda._sleep`` cycles per millisecond, measured now (clocks vary)."""
    torch.cuda._sleep(1_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def host_times(fn: Callable[[], object], iters: int, device: torch.device, busy_ms: float = 20.0,
               cycles_per_ms: float | None = None, calls: int = 4) -> tuple[list[float], list[float]]:
    """Seconds the host spends inside ``fn`` while the GPU is still busy with earlier
    work, as ``(warm, cold)``. Each of ``iters`` rounds queues ``busy_ms`` of GPU sleep
    and then calls ``fn`` ``calls`` times back to back. *Cold*: the first call of a
    round, made right after the host waited for the device (its clocks and caches may
    have dropped, so it varies several-fold between runs). *Warm*: the
    calls after it, like a trainer's host that has just queued its optimizer step."""
    if device.type != "cuda":
        return [], []
    cycles = int(busy_ms * (cycles_per_ms or sleep_cycles_per_ms(device)))
    warm, cold = [], []
    for _ in range(iters):
        _sync(device)
        torch.cuda._sleep(cycles)
        for i in range(calls):
            t0 = time.perf_counter()
            fn()
            (warm if i else cold).append(time.perf_counter() - t0)
    _sync(device)
    return warm, cold


def device_times(fn: Callable[[], object], iters: int, device: torch.device, busy_ms: float = 20.0,
                 cycles_per_ms: float | None = None) -> list[float]:
    """Seconds of device work per call of ``fn``, host time left out: each call is
    queued behind ``busy_ms`` of GPU sleep, between two events on the caller's
    stream, so the first event fires when the sleep ends and the host has long
    queued the call's work (where the host takes longer than the sleep, the gap
    counts, so this never reads below the device time). Shows how much of a wall
    time (:func:`time_calls`, device idle before each call) is host time spent
    before the first copy starts. Empty off CUDA."""
    if device.type != "cuda":
        return []
    cycles = int(busy_ms * (cycles_per_ms or sleep_cycles_per_ms(device)))
    out = []
    for _ in range(iters):
        _sync(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    _sync(device)
    return out


def median_host_ms(fn: Callable[[], object], iters: int, device: torch.device,
                   cycles_per_ms: float | None = None) -> tuple[float, float]:
    """Median warm and cold host milliseconds of ``fn`` (see :func:`host_times`)."""
    warm, cold = host_times(fn, iters, device, cycles_per_ms=cycles_per_ms)
    return 1e3 * statistics.median(warm), 1e3 * statistics.median(cold)


def summarize(seconds: list[float], prefix: str = "") -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    if not ms:
        return {}
    return {
        f"{prefix}mean_ms": statistics.fmean(ms),
        f"{prefix}median_ms": statistics.median(ms),
        f"{prefix}stddev_ms": statistics.pstdev(ms),
        f"{prefix}min_ms": min(ms),
        f"{prefix}max_ms": max(ms),
    }
