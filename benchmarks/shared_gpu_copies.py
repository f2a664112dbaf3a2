"""The physical floor of N processes copying on one GPU, with no torchrefit at all.

Each of ``--nproc`` processes on GPU 0 owns two buffers of ``--gb`` GB and, aligned
by a barrier with the device idle, copies one into the other; an iteration costs the
slowest process's time (as ``torchrefit bench`` times a refit). Compared, in the same
world: the same bytes copied by one process alone (rank 0 copies its buffer N times
while the others wait), and one process's single copy (the copy bandwidth). Without
CUDA MPS the GPU time-slices processes' contexts; this measures what that costs.
With ``--peer``, also: each process copies from its peer's (rank ^ 1) source, mapped
through CUDA IPC (``peer``), and half from its own source on a side stream while
the other half comes from the peer's (``mixed``: the bytes and streams of ipc's
collocated TP2 -> TP1 refit, no torchrefit).

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


def _rank(rank: int, world: int, nbytes: int, iters: int, peer: bool = False) -> dict:
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
    out = {"together": together, "alone": _timed(alone, iters), "single": _timed(single, iters),
           "exact": bool(torch.equal(dst, src))}
    if peer:
        out.update(_peer_copies(rank, world, src, dst, iters))
    return out


def _peer_copies(rank: int, world: int, src: torch.Tensor, dst: torch.Tensor, iters: int) -> dict:
    shares: list = [None] * world
    dist.all_gather_object(shares, src.untyped_storage()._share_cuda_())
    storage = torch.UntypedStorage._new_shared_cuda(*shares[rank ^ 1])
    theirs = torch.empty(0, dtype=torch.uint8, device="cuda").set_(storage, 0, src.shape, (1,))
    half, side = src.numel() // 2, torch.cuda.Stream()

    def mixed() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dst[:half].copy_(src[:half])
        dst[half:].copy_(theirs[half:])
        torch.cuda.current_stream().wait_stream(side)

    out = {"peer": _timed(lambda: dst.copy_(theirs), iters)}
    out["peer_exact"] = bool(torch.equal(dst, theirs))
    out["mixed"] = _timed(mixed, iters)
    torch.cuda.synchronize()
    dist.barrier()  # no peer drops its buffer while another still maps it
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--gb", type=float, default=8.88, help="bytes each process copies, in GB")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--peer", action="store_true", help="also copy from the peer's buffer through CUDA IPC")
    p.add_argument("--json")
    args = p.parse_args()
    if args.peer and args.nproc % 2:
        p.error("--peer pairs rank r with rank r ^ 1: give an even --nproc")
    nbytes = int(args.gb * 1e9)
    ranks = run_world(_rank, args.nproc, nbytes, args.iters, args.peer, backend="gloo", timeout=240)
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
    for key in ("peer", "mixed") if args.peer else ():
        out[f"{key}_ms"] = med([max(xs) for xs in zip(*(r[key] for r in ranks))])
        print(f"  {key}: all at once {out[f'{key}_ms']:.2f} ms ({out[f'{key}_ms'] / floor:.3f}x the floor)")
    if args.peer:
        out["exact"] = out["exact"] and all(r["peer_exact"] for r in ranks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**out, "ranks": ranks}, f)


if __name__ == "__main__":
    main()
