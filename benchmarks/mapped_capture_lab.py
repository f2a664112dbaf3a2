"""Does ending a CUDA graph capture cost more for copies out of IPC-mapped memory than
for local ones? Two processes on one GPU: rank 0 allocates ``--n`` buffers of ``--mib``
MiB and exports them (CUDA IPC, as ``transport="ipc"`` does per allocation segment);
rank 1 maps them and captures ``--n`` copies into its own buffers, once from local
buffers and once from the mapped ones, timing on the host the capture (queuing the
copies), its end (``capture_end``: instantiation) and the first replay, synchronised.

    python benchmarks/mapped_capture_lab.py [--n 42 --mib 100]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from torchrefit.testing import run_world


def timed_capture(op) -> dict:
    """Seconds to queue ``op`` into a new CUDA graph (capture), to end the capture
    (instantiation), and for its first and second replay, each synchronised. Also
    ``lazy_loading_probe.py``'s graph case."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    torch.cuda.synchronize()
    stream.wait_stream(torch.cuda.current_stream())
    marks = []
    with torch.cuda.stream(stream):
        marks.append(time.perf_counter())
        graph.capture_begin()
        op()
        marks.append(time.perf_counter())
        graph.capture_end()
        marks.append(time.perf_counter())
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
    names = ("capture_s", "capture_end_s", "first_replay_s", "second_replay_s")
    return {k: b - a for k, a, b in zip(names, marks, marks[1:])}


def _captured(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> dict:
    got = timed_capture(lambda: [d.copy_(s) for d, s in zip(dsts, srcs)])
    names = {"capture_s": "queue_ms", "capture_end_s": "capture_end_ms", "first_replay_s": "first_replay_ms",
             "second_replay_s": "second_replay_ms"}
    return {names[k]: round(v * 1e3, 3) for k, v in got.items()}


def _rank(rank: int, world: int, n: int, mib: int) -> dict:
    torch.cuda.set_device(0)
    nbytes = mib << 20
    mine = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(n)]
    shares = [x.untyped_storage()._share_cuda_() for x in mine]
    got: list = [None] * world
    dist.all_gather_object(got, shares)
    out: dict = {}
    if rank == 1:
        t = time.perf_counter()
        storages = [torch.UntypedStorage._new_shared_cuda(*s) for s in got[0]]
        out["open_ms"] = round((time.perf_counter() - t) * 1e3, 3)
        mapped = [torch.empty(0, dtype=torch.uint8, device="cuda").set_(s, 0, (nbytes,), (1,)) for s in storages]
        local = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(n)]
        for round_ in range(2):  # the second round: nothing left to load or map lazily
            out[f"local_{round_}"] = _captured(mine, local)
            out[f"mapped_{round_}"] = _captured(mine, mapped)
        torch.cuda.synchronize()
        del mapped, storages
    dist.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=42)
    ap.add_argument("--mib", type=int, default=100)
    ap.add_argument("--json")
    args = ap.parse_args()
    result = {"n": args.n, "mib": args.mib, **run_world(_rank, 2, args.n, args.mib, backend="gloo", timeout=300)[1]}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
