"""The physical floor of N processes copying on one GPU, with no torchrefit at all.

Each of ``--nproc`` processes on GPU 0 owns two buffers of ``--gb`` GB and, aligned
by a barrier with the device idle, copies one into the other; an iteration costs the
slowest process's time (as ``torchrefit bench`` times a refit). Compared, in the same
world: the same bytes copied by one process alone (rank 0 copies its buffer N times
while the others wait), and one process's single copy (the copy bandwidth). Without
CUDA MPS the GPU time-slices processes' contexts; this measures what that costs.

    python benchmarks/shared_gpu_copies.py --nproc 4 --gb 8.88 [--iters 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from torchrefit.testing import run_world


def _timed(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _rank(rank: int, world: int, nbytes: int, iters: int) -> dict:
    torch.cuda.set_device(0)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)

    def alone() -> None:
        if rank == 0:
            for _ in range(world):
                dst.copy_(src)

    def single() -> None:
        if rank == 0:
            dst.copy_(src)

    together = _timed(lambda: dst.copy_(src), iters)
    return {"together": together, "alone": _timed(alone, iters), "single": _timed(single, iters),
            "exact": bool(torch.equal(dst, src))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--gb", type=float, default=8.88, help="bytes each process copies, in GB")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args()
    nbytes = int(args.gb * 1e9)
    ranks = run_world(_rank, args.nproc, nbytes, args.iters, backend="gloo", timeout=240)
    med = statistics.median
    together = med([max(xs) for xs in zip(*(r["together"] for r in ranks))])
    alone, single = med(ranks[0]["alone"]), med(ranks[0]["single"])
    bandwidth = 2 * nbytes / (single / 1e3)
    floor = 2 * nbytes * args.nproc / bandwidth * 1e3
    out = {"nproc": args.nproc, "bytes_per_process": nbytes, "together_ms": together, "alone_ms": alone,
           "single_ms": single, "copy_bandwidth_gbs": bandwidth / 1e9, "floor_ms": floor,
           "exact": all(r["exact"] for r in ranks), "device": torch.cuda.get_device_name(0)}
    print(f"{args.nproc} processes x {nbytes / 1e9:.2f} GB on one GPU: all at once {together:.2f} ms "
          f"({together / floor:.3f}x the floor {floor:.2f} ms at {bandwidth / 1e9:.0f} GB/s); "
          f"the same bytes from one process {alone:.2f} ms ({alone / floor:.3f}x); one copy {single:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**out, "ranks": ranks}, f)


if __name__ == "__main__":
    main()
