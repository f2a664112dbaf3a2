"""Where the time goes above the copy floor for model shapes other than the seed's
(issue 16): dense Llama-8B, a 0.5 B dense model, Qwen3-30B-A3B- and DeepSeek-V3-like
MoE stacks (hundreds to thousands of 3-60 MB expert tensors), on one GPU.

For each shape (toy models, TP1 -> TP1, one process) it measures against the floor
measured here:

- the executor's refit as it is (wall clock with the device idle before, and device
  time alone), with 2 (the default), 4 and 8 branches for the large copies;
- the copies by size bucket, and each large copy's bandwidth grouped by shape;
- hand-captured graphs of the same copies: large copies on 1-8 branches; with runs
  that are contiguous on both sides merged into one copy each (how many merge is
  printed: that depends on where the allocator put the tensors); with mid-sized
  copies (< 16 MB) in one ``_foreach_copy_`` per dtype pair instead; one flat copy of
  all bytes (what the floor assumes);
- host time of the storage-move check: the ``map(data_ptr)`` pass and torch's C++
  comparison ``torch._C._tensors_data_ptrs_at_indices_equal`` (CUDA builds).

``--megatron SHAPE`` adds megatron-core GPTModels of that shape (adjacency differs).

Run (GPU machine): ``python benchmarks/diagnose_moe_copies.py --json OUT.json``
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

import torchrefit as tr
from torchrefit.bench.config import spec_from_preset
from torchrefit.bench.timing import copy_bandwidth, median_host_ms, time_calls
from torchrefit.bench.world import one_gpu_world
from torchrefit.execute import program
from torchrefit.testing import Mesh, build_toy

sys.path.insert(0, os.path.dirname(__file__))
from diagnose_megatron_copies import capture, device_ms, per_copy  # noqa: E402

DEV = torch.device("cuda", 0)
MB = 1 << 20
#: (label, preset, layer override, extra ModelSpec fields)
SHAPES = [
    ("gpt-4b", "gpt-4b", None, {}),
    ("llama-8b", "llama-8b", None, {}),
    ("dense-0.5b", "dense-0.5b", None, {}),
    ("moe-issue16 (8 layers, 16x1408)", "qwen3-30b-a3b", 8,
     {"hidden": 2048, "heads": 16, "groups": 16, "ffn": 5632, "experts": 16, "expert_ffn": 1408,
      "vocab": 50304}),
    ("qwen3-30b-a3b 24 layers", "qwen3-30b-a3b", 24, {}),
    ("deepseek-v3-moe 2 layers", "deepseek-v3-moe", 2, {}),
]


class _Raw:
    """A device byte range as a tensor (``__cuda_array_interface__``), for a merged run
    that spans two allocations; the caller keeps both allocations alive."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3}


def merge_runs(pairs):
    """Copies whose destinations and sources are both back to back (same dtype, dense)
    merged into one byte copy each; returns (merged pairs, number of runs merged)."""
    dense = [(d, s) for d, s in pairs if d.is_contiguous() and s.is_contiguous() and d.dtype == s.dtype]
    rest = [(d, s) for d, s in pairs if not (d.is_contiguous() and s.is_contiguous() and d.dtype == s.dtype)]
    dense.sort(key=lambda p: p[0].data_ptr())
    # a copy may not span two cudaMalloc allocations (the graph's memcpy node rejects
    # it): merge only within one of the caching allocator's segments on each side
    segments = sorted((s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot())

    starts = [a for a, _ in segments]

    def segment(ptr: int) -> int:
        i = bisect.bisect_right(starts, ptr) - 1
        return i if i >= 0 and ptr < segments[i][1] else -1

    runs: list[list] = []
    for d, s in dense:
        if runs:
            ld, ls = runs[-1][-1]
            if (ld.data_ptr() + ld.nbytes == d.data_ptr() and ls.data_ptr() + ls.nbytes == s.data_ptr()
                    and segment(ld.data_ptr()) == segment(d.data_ptr() + d.nbytes - 1)
                    and segment(ls.data_ptr()) == segment(s.data_ptr() + s.nbytes - 1)):
                runs[-1].append((d, s))
                continue
        runs.append([(d, s)])
    out = []
    for run in runs:
        if len(run) == 1:
            out.append(run[0])
            continue
        n = sum(d.nbytes for d, _ in run)
        out.append((torch.as_tensor(_Raw(run[0][0].data_ptr(), n), device=DEV),
                    torch.as_tensor(_Raw(run[0][1].data_ptr(), n), device=DEV)))
    return out + rest, sum(len(r) > 1 for r in runs)


def buckets(pairs) -> dict:
    edges = [(0, 1), (1, 4), (4, 16), (16, 64), (64, 1 << 40)]
    out = {}
    for lo, hi in edges:
        sel = [d.nbytes for d, _ in pairs if lo * MB <= d.nbytes < hi * MB]
        out[f"{lo}-{hi if hi < 1 << 30 else 'inf'} MiB"] = {"count": len(sel), "bytes": sum(sel)}
    return out


def exec_variant(src, dst, branches: int, bw: float) -> dict:
    program._BRANCHES, program._SMALL_LANE = branches, branches
    r = tr.Refitter(src, dst, transport="nccl")
    r.refit()
    floor = 2 * r.plan.bytes_local / bw * 1e3
    wall = 1e3 * statistics.median(time_calls(r.refit, 3, 20, DEV))
    out = {"wall_ms": wall, "x_floor": wall / floor, "device_ms": device_ms(r.refit, 20),
           "host_ms": median_host_ms(r.refit, 20, DEV)}
    return out, r


def storage_check_host(p) -> dict:
    ts, ptrs = p.compiled.watched, p.compiled.pointers
    idx = list(range(len(ts)))
    fast = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)

    def per_call(fn, n=200):
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e3

    out = {"watched": len(ts), "map_ms": per_call(lambda: list(map(torch.Tensor.data_ptr, ts)) != ptrs)}
    if fast is not None:
        assert fast(ts, ptrs, idx)
        out["cxx_ms"] = per_call(lambda: fast(ts, ptrs, idx))
    return out


def study(label: str, src, dst, bw: float) -> dict:
    row = {"label": label}
    for b in (2, 4, 8):
        row[f"exec {b}br"], r = exec_variant(src, dst, b, bw)
        if b != 8:
            r.close()
    p = r._program
    floor = 2 * r.plan.bytes_local / bw * 1e3
    big = [(d, s) for d, s, _ in p.local.big]
    grouped = [(g.dst, g.src) for g in p.local.small]
    small_pairs = [(d, s) for g in p.local.small for d, s in zip(g.dst, g.src)]
    row.update({"floor_ms": floor, "copy_gbs": bw / 1e9, "local_copies": len(r.plan.local),
                "large": len(big), "small": len(small_pairs), "buckets": buckets(big + small_pairs),
                "host_check": storage_check_host(p)})
    graphs = {}
    for b in (1, 2, 4, 8):
        graphs[f"{b}br"] = device_ms(capture(big, grouped, b, "own").replay, 20)
    merged, nmerged = merge_runs(big)
    row["merge"] = {"before": len(big), "after": len(merged), "runs_merged": nmerged}
    for b in (2, 4):
        graphs[f"merged {b}br"] = device_ms(capture(merged, grouped, b, "own").replay, 20)
    mid = [(d, s) for d, s in big if d.nbytes < 16 * MB]
    large = [(d, s) for d, s in big if d.nbytes >= 16 * MB]
    groups = defaultdict(lambda: ([], []))
    for d, s in mid:
        g = groups[(d.dtype, s.dtype, d.is_contiguous() and s.is_contiguous())]
        g[0].append(d)
        g[1].append(s)
    for b in (2, 4):
        graphs[f"mid foreach, large {b}br"] = device_ms(
            capture(large, grouped + list(groups.values()), b, "own").replay, 20)
    total = sum(d.nbytes for d, _ in big + small_pairs)
    if total <= 20 << 30:  # two more copies of the model must fit next to the two models
        a = torch.empty(total, dtype=torch.uint8, device=DEV)
        c = torch.empty_like(a)
        graphs["one flat copy"] = device_ms(lambda: c.copy_(a), 20)
        del a, c
    row["graphs_device_ms"] = graphs
    row["graphs_x_floor"] = {k: v / floor for k, v in graphs.items()}
    row["per_copy"] = per_copy(p.local.big[:600], reps=5)
    r.close()
    return row


def show(row: dict) -> None:
    print(f"\n== {row['label']}: {row['local_copies']} copies ({row['large']} large, {row['small']} "
          f"small); floor {row['floor_ms']:.3f} ms at {row['copy_gbs']:.0f} GB/s; merge {row['merge']}")
    print("  buckets", {k: (v["count"], round(v["bytes"] / 1e9, 3)) for k, v in row["buckets"].items()})
    for b in (2, 4, 8):
        e = row[f"exec {b}br"]
        print(f"  exec {b}br: wall {e['wall_ms']:.3f} ms = {e['x_floor']:.3f}x, device {e['device_ms']:.3f}, "
              f"host {e['host_ms'][0]:.3f} warm / {e['host_ms'][1]:.3f} cold")
    print("  host check", row["host_check"])
    for k, v in row["graphs_device_ms"].items():
        print(f"  graph {k:28s} {v:8.3f} ms  {row['graphs_x_floor'][k]:.3f}x")
    for g in row["per_copy"][:8]:
        print(f"  copy {str(g['shape']):18s} x{g['count']:4d} {g['mbytes']:7.1f} MB "
              f"{g['gbs_min']:5.0f}/{g['gbs_median']:5.0f}/{g['gbs_max']:5.0f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--only", help="comma list of shape labels' first words")
    ap.add_argument("--megatron", action="append", default=[], help="also megatron-core models of this label")
    args = ap.parse_args()
    one_gpu_world(29578)
    bw = copy_bandwidth(DEV)
    rows = []
    only = set(args.only.split(",")) if args.only else None
    for label, name, layers, extra in SHAPES:
        if only and label.split()[0] not in only:
            continue
        spec = spec_from_preset(name, layers=layers, **extra)
        for kind in ("toy", "megatron-core") if label.split()[0] in args.megatron else ("toy",):
            t0 = time.perf_counter()
            if kind == "toy":
                pair = [build_toy(spec, Mesh(), 0, seed=s, device=DEV, random_init=True) for s in (1, 2)]
            else:
                from torchrefit.bench.megatron_models import build_megatron_gpt
                pair = [build_megatron_gpt(spec, seed=s) for s in (1, 2)]
            torch.cuda.synchronize()
            print(f"\nbuilt {kind} {label} in {time.perf_counter() - t0:.1f} s", flush=True)
            row = study(f"{label} [{kind}]", *pair, bw)
            show(row)
            rows.append(row)
            del pair
            gc.collect()
            torch.cuda.empty_cache()
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
