"""The nvshmem transport on one GPU: its puts through the symmetric inbox on one PE,
and whether two PEs can share the GPU.

``--puts``: one process, one PE putting to itself through ``NvshmemTransport``
(start/finish, the transport's own path: put with signal, wait, copy out of the
inbox, acknowledgement), ``--gb`` of messages of ``--message-mb``, timed with CUDA
events after warm-up, against the floor of the same bytes moved twice device to
device (the put into the inbox and the copy out of it; bytes read + written over
the copy bandwidth measured in the same run).

``--probe``: two processes on the one GPU (``TORCHREFIT_NVSHMEM_SHARED_GPU=1``: NVSHMEM
without CUDA MPS may refuse or hang), a toy TP1 -> TP1 non-collocated refit through
nvshmem, checked against the toy's values. Prints one line either way.

    python benchmarks/nvshmem_one_gpu.py --puts [--gb 8 --message-mb 512]
    TORCHREFIT_NVSHMEM_SHARED_GPU=1 timeout 90 python benchmarks/nvshmem_one_gpu.py --probe
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import torchrefit as tr
from torchrefit.bench.timing import copy_bandwidth
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local, run_world


def _puts(rank: int, world: int, gb: float, message_mb: int) -> dict:
    from torchrefit.transport.nvshmem import NvshmemTransport, plan_inbox

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    bandwidth = copy_bandwidth(device)
    nbytes = message_mb << 20
    count = max(2, int(gb * 1e9) // nbytes)
    t = NvshmemTransport(torch.distributed.group.WORLD, device)
    t.set_inbox(plan_inbox([(0,)], [nbytes]))
    src = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device) for _ in range(2)]
    dst = [torch.empty_like(s) for s in src]

    def once() -> None:
        for k in range(count):
            t.finish(t.start([(0, src[k % 2])], [(0, dst[k % 2])]))

    once()
    torch.cuda.synchronize()
    ok = all(torch.equal(s, d) for s, d in zip(src, dst))
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        once()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    moved = count * nbytes
    floor_ms = 2 * 2 * moved / bandwidth * 1e3  # put into the inbox + copy out: each read + write
    median = statistics.median(times)
    return {"exact": ok, "bytes": moved, "messages": count, "message_bytes": nbytes, "median_ms": median,
            "floor_ms": floor_ms, "ratio_to_floor": median / floor_ms, "copy_bandwidth_gbs": bandwidth / 1e9,
            "times_ms": times}


SPEC = ModelSpec(layers=2, hidden=256, heads=8, groups=4, ffn=1024, vocab=4096)


def _probe(rank: int, world: int) -> str:
    torch.cuda.set_device(0)
    src_mesh, dst_mesh = Mesh(1, ranks=1), Mesh(1, ranks=1, offset=1)
    src, dst = build_toy(SPEC, src_mesh, rank, seed=1), build_toy(SPEC, dst_mesh, rank, seed=2)
    src, dst = (m.cuda() if m is not None else None for m in (src, dst))
    r = tr.Refitter(src, dst, transport="nvshmem")
    r.refit()
    r.refit()
    torch.cuda.synchronize()
    if dst is None:
        return "sender ok"
    want = expected_local(SPEC, dst_mesh, rank, seed=1)
    wrong = [k for k, v in dst.state_dict().items() if not torch.equal(v.cpu(), want[k])]
    return f"receiver: {len(wrong)} wrong of {len(want)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--puts", action="store_true")
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--gb", type=float, default=8.0)
    ap.add_argument("--message-mb", type=int, default=512)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.puts:
        (row,) = run_world(_puts, 1, args.gb, args.message_mb, backend="gloo", timeout=300)
        print(f"nvshmem 1 PE puts: {row['bytes'] / 1e9:.2f} GB in {row['messages']} messages of "
              f"{row['message_bytes'] >> 20} MiB, exact {row['exact']}: median {row['median_ms']:.3f} ms, "
              f"floor {row['floor_ms']:.3f} ms (2 copies at {row['copy_bandwidth_gbs']:.0f} GB/s), "
              f"{row['ratio_to_floor']:.3f}x")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(row, f, indent=1)
    if args.probe:
        try:
            print("nvshmem 2 PEs on one GPU:", run_world(_probe, 2, backend="gloo", timeout=40))
        except Exception as e:
            print(f"nvshmem 2 PEs on one GPU failed: {type(e).__name__}: {str(e)[:600]}")


if __name__ == "__main__":
    main()
