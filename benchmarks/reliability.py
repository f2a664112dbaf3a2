"""Reliability on one GPU: what ``verify()`` costs against one refit, and
memory over 1000 refits in a row.

One process, one GPU, the ``gpt-4b`` toy (, bf16, 4.44 B parameters) TP1 ->
TP1 collocated (every byte a local copy), NCCL world of one::

    python benchmarks/reliability.py [--model gpt-4b] [--refits 1000] [--json out.json]

Prints (and writes) the median refit time, the median ``verify()`` time and their
ratio (with the bytes verify reads, both models once, over its time; and how its fused
checksum launches were cut, or "eager reference" where Triton is missing), then
allocated / reserved device memory and host RSS after refit 10 and after the last, and
whether the destination equals the source at the end (checked with
``torch.equal``, not with verify).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

import torchrefit as tr
from torchrefit.bench.config import spec_from_preset
from torchrefit.bench.timing import time_calls
from torchrefit.bench.world import one_gpu_world
from torchrefit.testing import Mesh, build_toy


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _timed(fn, iters: int) -> list[float]:
    return [1e3 * s for s in time_calls(fn, 0, iters, torch.device("cuda", 0))]


def _flip_caught(r: tr.Refitter, dst: torch.nn.Module) -> bool:
    """Flip one bit of the last destination tensor, verify, restore."""
    w = list(dst.state_dict().values())[-1].view(-1).view(torch.uint8)
    w[w.numel() // 3] ^= 4
    try:
        r.verify()
        return False
    except tr.VerificationError:
        return True
    finally:
        w[w.numel() // 3] ^= 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-4b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--refits", type=int, default=1000)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = one_gpu_world(29531)
    spec = spec_from_preset(args.model, layers=args.layers)
    mesh = Mesh(1, ranks=1)
    src = build_toy(spec, mesh, 0, seed=1, device=device, random_init=True)
    dst = build_toy(spec, mesh, 0, seed=2, device=device, random_init=True)
    params = sum(p.numel() for p in src.parameters())
    r = tr.Refitter(src, dst)
    r.refit()
    r.verify()  # warm-up (and a first check)
    refit_ms = _timed(r.refit, args.iters)
    verify_ms = _timed(r.verify, args.iters)
    row = {"device": torch.cuda.get_device_name(device), "model": args.model, "params": params,
           "refit_ms_median": statistics.median(refit_ms),
           "verify_ms_median": statistics.median(verify_ms)}
    row["verify_over_refit"] = row["verify_ms_median"] / row["refit_ms_median"]
    read = sum(t.nbytes for m in (src, dst) for t in m.state_dict().values())
    row["verify_read_bytes"] = read
    row["verify_tb_per_s"] = read / row["verify_ms_median"] / 1e9
    fused = r._witness._fused if r._witness is not None else None
    row["verify_launches"] = ([[g.word, g.tile, g.vector, int(g.table.shape[0])] for g in fused._static]
                              if fused is not None else "eager reference")
    print(f"verify reads {read / 1e9:.2f} GB: {row['verify_tb_per_s']:.2f} TB/s; launches "
          f"(word bytes, tile, vector loads, segments): {row['verify_launches']}")
    row["flipped_bit_caught"] = _flip_caught(r, dst)
    print(f"a flipped destination bit makes verify raise: {row['flipped_bit_caught']}")
    print(f"{row['device']}: {args.model} {params / 1e9:.2f} B params; refit {row['refit_ms_median']:.2f} ms, "
          f"verify {row['verify_ms_median']:.2f} ms ({row['verify_over_refit']:.2f}x a refit)")
    marks = {}
    for i in range(args.refits):
        r.refit()
        if i + 1 in (10, args.refits):
            torch.cuda.synchronize()
            marks[i + 1] = {"allocated": torch.cuda.memory_allocated(device),
                            "reserved": torch.cuda.memory_reserved(device), "rss": _rss()}
    torch.cuda.synchronize()
    equal = all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))
    row.update({"refits": args.refits, "memory": marks, "equal_at_end": equal})
    first, last = marks[10], marks[args.refits]
    print(f"{args.refits} refits: allocated {first['allocated']} -> {last['allocated']} B, reserved "
          f"{first['reserved']} -> {last['reserved']} B, host RSS {first['rss'] / 2**20:.1f} -> "
          f"{last['rss'] / 2**20:.1f} MiB; destination equals source: {equal}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
