"""Where a process's first refit goes: construction plus the
first ``refit()`` of a preset on one GPU, timed by phase (describe, plan, compile, run)
and profiled, for toy or megatron-core models (TP1 -> TP1, one process).

A first Refitter on the same models runs before the timed one, as in ``torchrefit
bench`` (imports, the CUDA context, the allocator and the copy kernel are warm; what is
left is the per-Refitter work a trainer pays once per new Refitter).

    python benchmarks/first_refit_phases.py --preset qwen3-30b-a3b --layers 8 [--megatron] [--json OUT]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

import torchrefit as tr
from torchrefit.bench.config import spec_from_preset
from torchrefit.bench.world import one_gpu_world
from torchrefit.execute import local as _local
from torchrefit.execute import program as _program
from torchrefit.testing import Mesh, build_toy


def models(spec, megatron: bool, device: torch.device):
    if megatron:
        from torchrefit.bench.megatron_models import build_megatron_gpt

        return build_megatron_gpt(spec, seed=1), build_megatron_gpt(spec, seed=2)
    return (build_toy(spec, Mesh(1, ranks=1), 0, 1, device=device, random_init=True),
            build_toy(spec, Mesh(1, ranks=1), 0, 2, device=device, random_init=True))


#: host seconds spent inside these, per timed Refitter (the GPU-side parts of a first
#: refit that a CPU run cannot show, such as ending the CUDA graph's capture)
PARTS = {
    "capture_end": (torch.cuda.CUDAGraph, "capture_end"),
    "capture": (_local, "_capture"),
    "compile_batch": (_local, "compile_batch"),
    "merge_local": (_local, "merge_local"),
    "compile_copies": (_program, "compile_copies"),
}
_spent: dict[str, float] = {}


def _timing(name: str, f):
    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            _spent[name] = _spent.get(name, 0.0) + time.perf_counter() - t0
    return timed


def time_parts() -> None:
    """Wrap each of :data:`PARTS` so that :func:`timed_first` reports its host seconds."""
    for name, (owner, attr) in PARTS.items():
        setattr(owner, attr, _timing(name, getattr(owner, attr)))


def timed_first(src, dst, device: torch.device) -> dict:
    """Construction and first refit, wall to finished device work, by phase."""
    torch.cuda.synchronize(device)
    _spent.clear()
    t0 = time.perf_counter()
    r = tr.Refitter(src, dst)
    t1 = time.perf_counter()
    r.refit()
    torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    out = {"construct_s": t1 - t0, "first_refit_s": t2 - t1, "total_s": t2 - t0,
           "plan_seconds": r.plan_seconds, "watched": len(r._program.compiled.watched),
           "planned_copies": len(r._program.local.planned),
           **{f"{k}_s": v for k, v in _spent.items()}}
    r.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--megatron", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = one_gpu_world(29571)
    spec = spec_from_preset(args.preset, layers=args.layers)
    src, dst = models(spec, args.megatron, device)
    time_parts()
    tr.Refitter(src, dst).refit()  # process-wide first use: not the per-Refitter cost
    runs = [timed_first(src, dst, device) for _ in range(args.repeat)]
    for run in runs:
        print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in run.items()))
    prof = cProfile.Profile()
    torch.cuda.synchronize(device)
    prof.enable()
    r = tr.Refitter(src, dst)
    r.refit()
    prof.disable()
    torch.cuda.synchronize(device)
    r.close()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumtime").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)
    print(text.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "layers": args.layers, "megatron": args.megatron,
                       "runs": runs, "profile": text.getvalue()}, f, indent=1)


if __name__ == "__main__":
    main()
