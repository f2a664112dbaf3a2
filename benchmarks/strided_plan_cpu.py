"""The host's work of cutting TP halves into rows for the batched copy kernel, on CPU
(no GPU needed: pure tensor arithmetic): ``strided_runs`` for one bf16 half [4096, 2048]
landing in a [4096, 4096] weight, and ``plan_runs`` over 160 such halves' rows (655,360
runs, the run table a first refit uploads). Microseconds / milliseconds per call, best of
5 x ``--number``.

    python benchmarks/strided_plan_cpu.py [--number 200]
"""

from __future__ import annotations

import argparse
import timeit

import torch

from torchrefit.execute.batched import strided_runs
from torchrefit.execute.copy_kernel import ByteRuns, plan_runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--number", type=int, default=200)
    args = ap.parse_args()
    full = torch.empty(4096, 4096, dtype=torch.bfloat16)
    half = torch.empty(4096, 2048, dtype=torch.bfloat16)
    dst = full[:, :2048]
    n = args.number
    one = min(timeit.repeat(lambda: strided_runs(dst, half), number=n, repeat=5)) / n
    every = ByteRuns.cat([strided_runs(dst, half) for _ in range(160)])
    table = min(timeit.repeat(lambda: plan_runs(every), number=5, repeat=5)) / 5
    print(f"strided_runs {one * 1e6:.1f} us per half; plan_runs {table * 1e3:.2f} ms for {len(every)} runs")


if __name__ == "__main__":
    main()
