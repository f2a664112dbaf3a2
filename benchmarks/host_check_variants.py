"""Host cost of the two per-refit checks (``Binding.changed``, ``Program.storage_moved``)
written several ways, interleaved on one machine, for a MoE-like set of tensors: how
much of a refit's host time each formulation costs where it runs (no GPU work timed;
on a CUDA machine the tensors are tiny CUDA tensors, else CPU ones).

    python benchmarks/host_check_variants.py --tensors 4182 --reps 300 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import operator
import random
import statistics
import time

import torch
from torch import nn


def build(n: int, device: str) -> tuple[list, list, list, list]:
    """``n`` parameters, two per module (an expert's fc1 and fc2), in shuffled allocation
    order as a model built layer by layer leaves them after other allocations."""
    mods = []
    for _ in range((n + 1) // 2):
        m = nn.Module()
        m.register_parameter("w1", nn.Parameter(torch.empty(4, device=device)))
        m.register_parameter("w2", nn.Parameter(torch.empty(4, device=device)))
        mods.append(m)
    pairs = [(m._parameters, k) for m in mods for k in ("w1", "w2")][:n]
    random.Random(0).shuffle(pairs)
    dicts, names = [d for d, _ in pairs], [k for _, k in pairs]
    held = [d[k] for d, k in pairs]
    return dicts, names, held, [t.data_ptr() for t in held]


def variants(dicts, names, held, ptrs) -> dict:
    get, dp, eq, is_ = dict.get, torch.Tensor.data_ptr, operator.eq, operator.is_
    held_t = tuple(held)
    return {
        "pointers: list != (main)": lambda: list(map(dp, held_t)) != ptrs,
        "pointers: all(map(eq))": lambda: not all(map(eq, map(dp, held_t), ptrs)),
        "binding: list then is_ (main)": lambda: all(map(is_, list(map(get, dicts, names)), held)),
        "binding: lazy is_": lambda: all(map(is_, map(get, dicts, names), held)),
        # the dicts' current tensors' pointers: moved and most replaced tensors in one pass
        # (a replacement sharing the old storage still needs the identity pass)
        "pointers of the dicts' tensors": lambda: list(map(dp, map(get, dicts, names))) != ptrs,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=4182)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fns = variants(*build(args.tensors, device))
    thrash = bytearray(64 << 20)  # touched between calls: caches as cold as after other work
    out = {}
    for cold in (False, True):
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.reps):
            for name, fn in fns.items():  # interleaved: drifts of the host's clock hit all alike
                if cold:
                    thrash[:: 4096] = bytes(len(thrash[:: 4096]))
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            ms = 1e3 * statistics.median(ts)
            out[f"{'cold' if cold else 'warm'} {name}"] = ms
            print(f"{'cold' if cold else 'warm'} {name:<50} {ms:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tensors": args.tensors, "device": device, "ms": out}, f, indent=1)


if __name__ == "__main__":
    main()
