"""A first refit's Python work on CPU, where a GPU is not at hand: construction (describe,
plan, bind) and the first ``refit()`` (compile, copy) of a preset's tensor count at toy
sizes (hidden 64), TP1 -> TP1 in one process, after a first Refitter in the process.
CPU seconds (``time.process_time``: steadier than wall time on a shared 2-core VM),
minimum and median of ``--repeat`` runs.

    python benchmarks/first_refit.py --preset qwen3-30b-a3b --layers 8 [--megatron]
        [--default-device cpu] [--json OUT]

``--megatron`` builds megatron-core ``GPTModel``s of the same tiny shape on the CPU
(megatron-core installed: it needs Python 3.12). ``--default-device`` sets
``torch.set_default_device`` after building the models, as a caller may (a torch function
mode: every torch call made from Python goes through it). ``warm_refit_median_s``: the
median CPU seconds of 20 later refits of the last Refitter (its copies included:
hidden 64, so mostly host work).

On a GPU host the same work is ``benchmarks/first_refit_phases.py`` (at full sizes,
with graph capture and the copy kernel on top).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torchrefit as tr
from torchrefit.bench.world import report_and_leave, tiny_toy_pair


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=12)
    ap.add_argument("--megatron", action="store_true",
                    help="megatron-core GPTModels of the same tiny shape (megatron-core installed)")
    ap.add_argument("--default-device", help="torch.set_default_device(DEVICE) after building the models")
    ap.add_argument("--json")
    args = ap.parse_args()
    src, dst = tiny_toy_pair(args.preset, args.layers, 29631, megatron=args.megatron)
    if args.default_device:
        torch.set_default_device(args.default_device)
    tr.Refitter(src, dst).refit()  # the process's first: imports and caches, not per Refitter
    construct, first = [], []
    for _ in range(args.repeat):
        t0 = time.process_time()
        r = tr.Refitter(src, dst)
        t1 = time.process_time()
        r.refit()
        construct.append(t1 - t0)
        first.append(time.process_time() - t1)
        if len(first) < args.repeat:
            r.close()
    warm = []
    for _ in range(20):
        t0 = time.process_time()
        r.refit()
        warm.append(time.process_time() - t0)
    r.close()
    total = [a + b for a, b in zip(construct, first)]
    out = {"preset": args.preset, "layers": args.layers, "megatron": args.megatron,
           "default_device": args.default_device,
           "tensors": 2 * sum(1 for _ in src.parameters()),
           **{f"{k}_{f.__name__}_s": round(f(v), 4) for k, v in
              (("construct", construct), ("first_refit", first), ("total", total))
              for f in (min, statistics.median)},
           "warm_refit_median_s": round(statistics.median(warm), 5)}
    report_and_leave(out, args.json)


if __name__ == "__main__":
    main()
