"""Where a four-process ipc refit on one GPU spends its time (issue 10).

Four processes on GPU 0, the seed's model (``--layers`` to shrink it), collocated
TP2 -> TP1 as ``torchrefit bench --nproc 4 --src tp2 --dst tp1 --transport ipc``
runs it: each rank copies its own half of the weights locally and pulls the other
half from its TP peer through CUDA IPC, and is the target of its peer's pull. Every
iteration starts as the bench starts one (device idle, ranks aligned by a barrier).
Per rank, the host timestamps of ``ipc_timeline.py`` (entering and leaving each
one-sided primitive and the refit's checks; CLOCK_MONOTONIC, comparable between
processes) and its device events (after ``wait_ready``: the pulls are queued next;
before ``done``; after ``wait_done``), as medians in ms from the earliest rank's start.

    python benchmarks/ipc_four_timeline.py [--layers 20] [--iters 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist
from ipc_timeline import (
    _refit_timeline,  # the same instrumentation (this script's folder is on sys.path)
)

import torchrefit as tr
from torchrefit.bench.config import spec_from_preset
from torchrefit.simulate.meshes import parse_mesh
from torchrefit.testing import build_toy, run_world


def _rank(rank: int, world: int, layers: int | None, iters: int) -> dict:
    torch.cuda.set_device(0)
    spec = spec_from_preset("gpt-4b", layers=layers)
    src = build_toy(spec, parse_mesh("tp2", world), rank, 1, device="cuda", random_init=True)
    dst = build_toy(spec, parse_mesh("tp1", world), rank, 2, device="cuda", random_init=True)
    torch.cuda.synchronize()
    dist.barrier()
    r = tr.Refitter(src, dst, transport="ipc")
    for _ in range(5):
        r.refit()
    torch.cuda.synchronize()
    dist.barrier()
    rows = _refit_timeline(r, iters)
    out = {"rank": rank, "rows": rows, "local_bytes": r.plan.bytes_local, "received": r.plan.bytes_received}
    torch.cuda.synchronize()
    dist.barrier()
    r.close()
    return out


def summarize(ranks: list[dict]) -> list[str]:
    iters = len(ranks[0]["rows"])
    rel: dict[tuple[int, str], list[float]] = {}
    walls = []
    for i in range(iters):
        rows = [r["rows"][i] for r in ranks]
        base = min(row["t0"] for row in rows)
        walls.append(max(row["end"] - row["t0"] for row in rows) * 1e3)
        for k, row in enumerate(rows):
            points = [("start", row["t0"]), *row["marks"], ("host returned", row["returned"]),
                      ("device idle (sync returned)", row["end"])]
            points += [(f"device {name}", row["t0"] + ms / 1e3) for name, ms in row["device_ms"].items()]
            for name, t in points:
                rel.setdefault((k, name), []).append((t - base) * 1e3)
    lines = [f"4 ranks, each {ranks[0]['local_bytes'] / 1e9:.2f} GB local + {ranks[0]['received'] / 1e9:.2f} GB "
             f"pulled; median iteration (slowest rank) {statistics.median(walls):.3f} ms; per rank, medians in "
             "ms from the earliest rank's start:"]
    for k in range(len(ranks)):
        lines.append(f"rank {k}:")
        mine = sorted(((statistics.median(xs), name) for (r, name), xs in rel.items() if r == k))
        lines += [f"  {ms:8.3f}  {name}" for ms, name in mine]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=None, help="shrink the seed's 20 layers")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args()
    ranks = run_world(_rank, 4, args.layers, args.iters, backend="gloo", timeout=300)
    print("\n".join(summarize(ranks)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": ranks, "device": torch.cuda.get_device_name(0)}, f)


if __name__ == "__main__":
    main()
