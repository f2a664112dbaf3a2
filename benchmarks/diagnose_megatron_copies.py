"""Why megatron-core GPTModels of the seed's shape refit further from the copy floor
than the toy GPT of the same shape (issue 5), on one GPU.

For each model pair (megatron-core, toy) it measures, in one process and against the
floor measured here:

- the refit as ``torchrefit bench`` times it (wall clock, device idle before) and its
  device time alone (events around the call);
- where the host time goes (``_check_storage``, graph launch, the whole ``refit()``);
- hand-captured graphs of the same copies: large copies on 1-4 branches, with the small
  copies (one ``_foreach_copy_`` per dtype pair, as the executor groups them, or one
  for all of them, which falls back to a kernel per tensor when dtypes are mixed) on
  branch 0 after the large ones or on a branch of their own, and each part alone;
- each large copy's bandwidth, grouped by shape, with its addresses modulo 2 MiB;
- the megatron-core pair again after its parameters are re-allocated in name order
  (does placement matter?).

Run (GPU machine, megatron-core importable):
``python benchmarks/diagnose_megatron_copies.py --json OUT.json``
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch

import torchrefit as tr
from torchrefit.bench.config import spec_from_preset
from torchrefit.bench.megatron_models import build_megatron_gpt
from torchrefit.bench.timing import copy_bandwidth, median_host_ms, median_ms
from torchrefit.bench.world import one_gpu_world
from torchrefit.execute.local import balance_by_bytes
from torchrefit.testing import Mesh, build_toy

DEV = torch.device("cuda", 0)
MiB2 = 2 << 20


def device_ms(fn, iters: int = 30) -> float:
    """Median device time of ``fn``'s work (events on the current stream), idle before."""
    fn()
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out)


def wall_ms(fn, iters: int = 30) -> float:
    return median_ms(fn, iters, DEV)


def host_ms(fn, iters: int = 30) -> tuple[float, float]:
    """Median (warm, cold) host ms while the GPU is busy (``timing.host_times``)."""
    return median_host_ms(fn, iters, DEV)


def capture(big, groups, branches: int, small: str) -> torch.cuda.CUDAGraph:
    """Graph of the copies: large ones balanced by bytes over ``branches`` streams; the
    small ``groups`` (lists of (dst, src) lists, one foreach each) on branch 0 after the
    large ones (``small="after"``), on a stream of their own (``"own"``) or left out."""
    streams = [torch.cuda.Stream() for _ in range(branches + 1)]
    lanes: list[list] = [[] for _ in range(branches)]
    for (d, s), b in zip(big, balance_by_bytes([d.nbytes for d, _ in big], branches)):
        lanes[b].append((d, s))  # the executor's balancing
    graph = torch.cuda.CUDAGraph()
    cap = torch.cuda.Stream()
    cap.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cap):
        graph.capture_begin(capture_error_mode="thread_local")
        for st in streams:
            st.wait_stream(cap)
        for b, lane in enumerate(lanes):
            with torch.cuda.stream(streams[b]):
                for d, s in lane:
                    d.copy_(s)
        with torch.cuda.stream(streams[0 if small == "after" else -1]):
            for dst, src in groups if small != "none" else ():
                torch._foreach_copy_(dst, src)
        for st in streams:
            cap.wait_stream(st)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(cap)
    return graph


def per_copy(big, reps: int = 10) -> list[dict]:
    """Each large copy alone, ``reps`` back to back (launches hidden), grouped by shape."""
    groups: dict = defaultdict(list)
    for d, s, name in big:
        d.copy_(s)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            d.copy_(s)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / reps
        groups[(tuple(d.shape), str(d.dtype))].append(
            (2 * d.nbytes / ms / 1e6, d.data_ptr() % MiB2, s.data_ptr() % MiB2, name, d.nbytes))
    out = []
    for (shape, dtype), rows in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        rates = sorted(r[0] for r in rows)
        out.append({"shape": shape, "dtype": dtype, "count": len(rows),
                    "mbytes": round(rows[0][4] / 1e6, 1),
                    "gbs_min": rates[0], "gbs_median": statistics.median(rates), "gbs_max": rates[-1],
                    "dst_mod_2MiB": sorted({r[1] for r in rows})[:6],
                    "src_mod_2MiB": sorted({r[2] for r in rows})[:6],
                    "slowest": min(rows)[3]})
    return out


def study(label: str, src, dst, bandwidth: float) -> dict:
    r = tr.Refitter(src, dst, transport="nccl")
    r.refit()
    p = r._program
    floor_ms = 2 * r.plan.bytes_local / bandwidth * 1e3
    big = [(d, s) for d, s, _ in p.local.big]
    grouped = [(g.dst, g.src) for g in p.local.small]
    mixed = [([d for g in p.local.small for d in g.dst], [s for g in p.local.small for s in g.src])]
    row = {
        "label": label, "floor_ms": floor_ms, "copy_gbs": bandwidth / 1e9,
        "local_copies": len(r.plan.local), "large": len(p.local.big), "small": len(mixed[0][0]),
        "small_groups": len(grouped), "large_bytes": sum(d.nbytes for d, _ in big),
        "small_bytes": sum(d.nbytes for d in mixed[0][0]), "watched": len(p.compiled.watched),
        "refit_wall_ms": wall_ms(r.refit), "refit_device_ms": device_ms(r.refit),
        "refit_host_ms": host_ms(r.refit), "check_storage_host_ms": host_ms(p.check_storage),
        "replay_host_ms": host_ms(p.local.graph.replay) if p.local.graph is not None else None,
        "host_note": "(warm, cold) medians, see torchrefit.bench.timing.host_times",
    }
    graphs = {}
    for branches in (1, 2, 4):
        for small in ("after", "own"):
            for kind, groups in (("grouped", grouped), ("one foreach", mixed)):
                g = capture(big, groups, branches, small)
                graphs[f"{branches}br small {small} {kind}"] = device_ms(g.replay)
                del g
    graphs["2br large only"] = device_ms(capture(big, [], 2, "none").replay)
    graphs["small only, grouped"] = device_ms(lambda: [torch._foreach_copy_(d, s) for d, s in grouped])
    graphs["small only, one foreach"] = device_ms(lambda: torch._foreach_copy_(*mixed[0]))
    row["graphs_device_ms"] = graphs
    row["graphs_x_floor"] = {k: v / floor_ms for k, v in graphs.items()}
    row["refit_wall_x_floor"] = row["refit_wall_ms"] / floor_ms
    row["per_copy"] = per_copy(p.local.big)
    r.close()
    return row


def reallocate(model) -> None:
    """Give every parameter fresh storage, in name order (placement experiment)."""
    with torch.no_grad():
        for _, prm in model.named_parameters():
            prm.data = prm.data.clone()


def show(row: dict) -> None:
    print(f"\n== {row['label']}: {row['local_copies']} copies ({row['large']} large "
          f"{row['large_bytes'] / 1e9:.2f} GB, {row['small']} small {row['small_bytes'] / 1e6:.1f} MB "
          f"in {row['small_groups']} groups); floor {row['floor_ms']:.3f} ms")
    def pair(v) -> str:
        return "-" if v is None else f"{v[0]:.3f} warm / {v[1]:.3f} cold"

    print(f"refit wall {row['refit_wall_ms']:.3f} ms = {row['refit_wall_x_floor']:.3f}x floor; device "
          f"{row['refit_device_ms']:.3f} ms; host ms {pair(row['refit_host_ms'])} (check_storage "
          f"{pair(row['check_storage_host_ms'])}, replay {pair(row['replay_host_ms'])})")
    for k, v in row["graphs_device_ms"].items():
        print(f"  graph {k:30s} {v:7.3f} ms  {row['graphs_x_floor'][k]:.3f}x")
    for g in row["per_copy"]:
        print(f"  copy {str(g['shape']):18s} x{g['count']:3d} {g['mbytes']:8.1f} MB  "
              f"{g['gbs_min']:5.0f}/{g['gbs_median']:5.0f}/{g['gbs_max']:5.0f} GB/s  "
              f"dst%2MiB {g['dst_mod_2MiB']} src%2MiB {g['src_mod_2MiB']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--skip-megatron", action="store_true")
    args = ap.parse_args()
    one_gpu_world(29577)
    spec = spec_from_preset("gpt-4b")
    bw = copy_bandwidth(DEV)
    rows = []

    def run(label, src, dst):
        row = study(label, src, dst, bw)
        show(row)
        rows.append(row)

    toy = [build_toy(spec, Mesh(), 0, seed=s, device=DEV, random_init=True) for s in (1, 2)]
    run("toy", *toy)
    del toy
    if not args.skip_megatron:
        src, dst = build_megatron_gpt(spec, seed=1), build_megatron_gpt(spec, seed=2)
        run("megatron-core", src, dst)
        for m in (src, dst):
            reallocate(m)
        torch.cuda.synchronize()
        run("megatron-core, parameters re-allocated", src, dst)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                      f, indent=1, default=str)


if __name__ == "__main__":
    main()
