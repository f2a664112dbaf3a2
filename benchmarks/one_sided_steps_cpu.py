"""A one-sided refit's host steps on CPU: the same stamps as ``one_sided_first_refit.py``
(``_STEPS``: checks, ready token, header out or in, copies queued, done word out or in,
acked, returned), here for two CPU processes over the tests' ``shm-pull`` transport (the
one-sided protocol with mailbox words, copies out of shared memory). A toy with the
seed's tensor count (20 layers, 83 tensors) but tiny tensors, so that host time is what
is seen. Each rank's medians over ``--iters`` refits, in microseconds after its refit
started (each refit right after a barrier).

    python benchmarks/one_sided_steps_cpu.py [--iters 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT / "tests"), str(_ROOT / "benchmarks")]

import one_sided_first_refit as steps  # noqa: E402
import shm_transport  # noqa: E402,F401 (registers shm-pull)
import torch.distributed as dist  # noqa: E402

import torchrefit as tr  # noqa: E402
from torchrefit.testing import build_toy, run_world  # noqa: E402

SPEC = tr.testing.ModelSpec(layers=20, hidden=64, heads=4, groups=2, ffn=128, vocab=256)


def _rank(rank: int, world: int, iters: int) -> dict[str, float]:
    src_mesh, dst_mesh = tr.testing.Mesh(1, ranks=1), tr.testing.Mesh(1, ranks=1, offset=1)
    src = build_toy(SPEC, src_mesh, rank, 1)
    if src is not None:
        src.share_memory()
    r = tr.Refitter(src, build_toy(SPEC, dst_mesh, rank, 2), transport="shm-pull")
    r.refit()
    r.refit()
    marks: dict[str, float] = {}
    steps.mark_steps(r, marks, cuda=False)
    rows = []
    for _ in range(iters):
        dist.barrier()
        marks.clear()
        t = time.perf_counter()
        r.refit()
        marks["returned"] = time.perf_counter()
        rows.append({k: (v - t) * 1e6 for k, v in marks.items()})
    return {k: round(statistics.median(row[k] for row in rows), 1) for k in rows[-1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = run_world(_rank, 2, args.iters, timeout=300)
    for rank, row in enumerate(out):
        print(f"rank {rank}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
