"""Diagnostics on one GPU: where ``refit()`` spends host time (warm, and constructing plus
the first refit), and whether a side stream that does not wait for the caller reads
stale data (the stale-read test's premise).

    python benchmarks/diagnose_host.py                                   # the seed's gpt-4b
    python benchmarks/diagnose_host.py --preset qwen3-30b-a3b --layers 8 --no-stale
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import torchrefit as tr
from torchrefit.bench.config import spec_from_preset
from torchrefit.bench.timing import median_host_ms, sleep_cycles_per_ms
from torchrefit.bench.world import one_gpu_world
from torchrefit.testing import Mesh, build_toy


def busy_host_ms(fn, cycles_per_ms: float, iters: int = 30) -> tuple[float, float]:
    """Median (warm, cold) host ms of ``fn`` while the GPU is busy."""
    return median_host_ms(fn, iters, torch.device("cuda"), cycles_per_ms)


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
    one_gpu_world(29544)
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt-4b")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--no-stale", action="store_true", help="skip the stale-read probes")
    args = ap.parse_args()
    cpm = sleep_cycles_per_ms(torch.device("cuda"))
    print(f"sleep cycles per ms: {cpm:.0f}")
    for user in (False, True) if not args.no_stale else ():
        for big in (False, True):
            print(f"stale probe: caller={'user stream' if user else 'default stream'} "
                  f"{'64M' if big else '1K'} floats -> dst max {stale_probe(cpm, user, big)}")
    spec = spec_from_preset(args.preset, layers=args.layers)
    src = build_toy(spec, Mesh(1, ranks=1), 0, 1, device="cuda", random_init=True)
    dst = build_toy(spec, Mesh(1, ranks=1), 0, 2, device="cuda", random_init=True)
    tr.Refitter(src, dst).refit()  # imports, CUDA context, allocator: not the first refit's own cost
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    r = tr.Refitter(src, dst)
    r.refit()
    prof.disable()
    torch.cuda.synchronize()
    print(f"construction + first refit: {time.perf_counter() - t0:.3f} s (under cProfile)")
    pstats.Stats(prof).sort_stats("cumtime").print_stats(25)
    prog = r._program
    print(f"watched tensors {len(prog.compiled.watched)}, planned copies {len(prog.local.planned)}, "
          f"large {len(prog.local.big)}, small groups {[len(g.dst) for g in prog.local.small]}")
    cycles = int(20 * cpm)
    side = prog.side

    def session_only():
        with side.session(1):
            pass

    def session_replay():
        with side.session(1), side.placed(0):
            prog.local.graph.replay()

    watched, pointers = list(prog.compiled.watched), prog.compiled.pointers
    every = list(range(len(watched)))
    parts = [("refit()", r.refit), ("program.run()", prog.run), ("check_storage", prog.check_storage),
             ("pointers, Python map", lambda: list(map(torch.Tensor.data_ptr, watched)) == pointers),
             ("_rebind (binding check)", r._rebind),
             ("session(1) enter+exit", session_only), ("session + placed + replay", session_replay),
             ("replay on current stream", prog.local.graph.replay)]
    at_indices = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if at_indices is not None:  # CUDA builds: one C++ loop
        parts.append(("pointers, torch C++ loop", lambda: at_indices(watched, pointers, every)))
        print(f"C++ loop finds the pointers unchanged: {at_indices(watched, pointers, every)}")
    print(f"{'host ms':<36} {'warm':>7} {'cold':>7}")
    for name, fn in parts:
        warm, cold = busy_host_ms(fn, cpm)
        print(f"host ms {name:<28} {warm:7.3f} {cold:7.3f}")
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
