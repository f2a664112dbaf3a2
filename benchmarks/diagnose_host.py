"""Diagnostics on one GPU: where ``refit()`` spends host time, and whether a side stream
that does not wait for the caller reads stale data (the stale-read test's premise)."""

from __future__ import annotations

import cProfile
import os
import pstats

import torch
import torch.distributed as dist

import torchrefit as tr
from torchrefit.bench.config import spec_from_preset
from torchrefit.bench.timing import median_host_ms, sleep_cycles_per_ms
from torchrefit.testing import Mesh, build_toy


def busy_host_ms(fn, cycles_per_ms: float, iters: int = 30) -> float:
    return median_host_ms(fn, iters, torch.device("cuda"), cycles_per_ms)[0]  # warm


def stale_probe(cycles_per_ms: float, user_stream: bool, big: bool) -> float:
    """max(dst) after: gate 50 ms on the caller's stream, producer fills src with 1 behind
    it, then dst.copy_(src) on a side stream that does NOT wait. 1.0 = ordered anyway."""
    n = (64 << 20) if big else 1024
    caller = torch.cuda.Stream() if user_stream else torch.cuda.current_stream()
    side = torch.cuda.Stream()
    src = torch.zeros(n, device="cuda")
    dst = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    release, gate = torch.cuda.Stream(), torch.cuda.Event()
    with torch.cuda.stream(release):
        torch.cuda._sleep(int(50 * cycles_per_ms))
        gate.record(release)
    with torch.cuda.stream(caller):
        caller.wait_event(gate)
        src.fill_(1.0)
        with torch.cuda.stream(side):
            dst.copy_(src)
    torch.cuda.synchronize()
    return dst.max().item()


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29544")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    cpm = sleep_cycles_per_ms(torch.device("cuda"))
    print(f"sleep cycles per ms: {cpm:.0f}")
    for user in (False, True):
        for big in (False, True):
            print(f"stale probe: caller={'user stream' if user else 'default stream'} "
                  f"{'64M' if big else '1K'} floats -> dst max {stale_probe(cpm, user, big)}")
    spec = spec_from_preset("gpt-4b")
    src = build_toy(spec, Mesh(1, ranks=1), 0, 1, device="cuda", random_init=True)
    dst = build_toy(spec, Mesh(1, ranks=1), 0, 2, device="cuda", random_init=True)
    r = tr.Refitter(src, dst)
    r.refit()
    prog = r._program
    cycles = int(20 * cpm)
    side = prog.side

    def session_only():
        with side.session(1):
            pass

    def session_replay():
        with side.session(1), side.placed(0):
            prog.local.graph.replay()

    for name, fn in [("refit()", r.refit), ("program.run()", prog.run), ("_check_storage", prog.check_storage),
                     ("session(1) enter+exit", session_only), ("session + placed + replay", session_replay),
                     ("replay on current stream", prog.local.graph.replay)]:
        print(f"host ms {name:<28} {busy_host_ms(fn, cpm):.3f}")
    prof = cProfile.Profile()
    for _ in range(50):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        prof.enable()
        r.refit()
        prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
