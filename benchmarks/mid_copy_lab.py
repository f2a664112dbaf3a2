"""Issue 16 on one GPU: why a refit of many mid-sized copies (qwen3-30b-a3b-shaped MoE:
thousands of 3-20 MB expert tensors) runs 1.10-1.15x the copy floor on the device while
one flat copy of the same bytes runs at it. Each hypothesis gets its own arrangement of
the same bytes, device time of a CUDA-graph replay (queued behind GPU sleep, so host
time is left out), against the floor measured in the same run:

- *program*: the executor's own graph (default compile);
- *memcpy / kernels, N branches*: the program's large copies (runs already merged)
  captured by hand as memcpy nodes or as SM kernels (``torch.bitwise_or`` on integer
  views), spread over N branches as the executor spreads them;
- *packed*: copies of the same sizes, in the same order, between two flat buffers
  (consecutive sub-ranges): same sizes, no scatter over the address space. If packed
  runs at the floor and the program does not, placement costs; if packed runs as the
  program does, the per-copy size does;
- *foreach, N branches*: one ``torch._foreach_copy_`` per branch on integer views (torch's
  multi-tensor kernel: a launch covers several copies' chunks);
- *batched T x U*: every copy cut into tiles, one block of T threads moving U 16-byte
  vectors each per tile, one launch (``execute.copy_kernel``'s kernel and tile table at
  other shapes; a Triton kernel before the tenth session, whose figures BENCHMARKS.md keeps);
- *flat*: one copy of all the bytes;
- *executor*: fresh Refitters on the same models, compiled under each switch
  (``TORCHREFIT_SM_COPY_BELOW``, ``TORCHREFIT_BATCHED_COPY``): wall of ``refit()`` with
  the device idle before (as the matrix times it), device time of its graph, and how
  many large copies took each path.

    PYTHONPATH=src python benchmarks/mid_copy_lab.py --json OUT.json [--only qwen3,dense]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch
from diagnose_refit_phases import DEV, device_ms, int_view, run_shapes, toy_refit
from diagnose_refit_phases import capture as capture_branches

import torchrefit as tr
from torchrefit.bench.timing import median_ms
from torchrefit.execute.copy_kernel import copy_kernel

SHAPES = [("qwen3-30b-a3b", 8), ("dense-0.5b", None), ("deepseek-v3-moe", 2)]
#: (threads, 16-byte vectors per thread) of the batched kernel
TILINGS = [(128, 2), (256, 1), (256, 4), (64, 4)]
#: compile switches of the executor variants (unset: the defaults)
SWITCHES = {"defaults": {}, "memcpy": {"TORCHREFIT_BATCHED_COPY": "0", "TORCHREFIT_SM_COPY_BELOW": "0"},
            "SM below 16 MB": {"TORCHREFIT_BATCHED_COPY": "0", "TORCHREFIT_SM_COPY_BELOW": str(16 << 20)},
            "SM all": {"TORCHREFIT_BATCHED_COPY": "0", "TORCHREFIT_SM_COPY_BELOW": str(1 << 50)},
            "batched all": {"TORCHREFIT_BATCHED_COPY": "1"}}


def capture(pairs, branches: int, kernel: bool, foreach: bool = False) -> torch.cuda.CUDAGraph:
    """``pairs`` on ``branches`` graph branches, as memcpy nodes, or as SM kernels or
    foreach copies on integer views of the same bytes (``diagnose_refit_phases.capture``)."""
    if kernel or foreach:
        pairs = [(int_view(d), int_view(s)) for d, s in pairs]
    return capture_branches(pairs, branches, kernel, foreach)


def graph_of(fn) -> torch.cuda.CUDAGraph:
    """``fn``'s work (run once first, to compile and load) captured in a graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    cap = torch.cuda.Stream()
    cap.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cap):
        g.capture_begin(capture_error_mode="thread_local")
        fn()
        g.capture_end()
    torch.cuda.current_stream().wait_stream(cap)
    return g


def batched_launch(pairs, threads: int, unroll: int):
    kernel = copy_kernel(DEV, threads, unroll)
    table = kernel.tiles([(d.data_ptr(), s.data_ptr(), d.nbytes) for d, s in pairs], DEV)
    return graph_of(lambda: kernel.launch(table, torch.cuda.current_stream())), table.tiles


def exact(pairs) -> bool:
    return all(torch.equal(d.view(torch.uint8), s.view(torch.uint8)) for d, s in pairs)


def replays_exact(g: torch.cuda.CUDAGraph, pairs) -> bool:
    """Whether a replay of ``g`` copies ``pairs`` exactly (a few destinations zeroed first)."""
    for d, _ in pairs[:4]:
        d.zero_()
    g.replay()
    torch.cuda.synchronize()
    return exact(pairs)


def histogram(sizes: list[int]) -> dict[str, tuple[int, float]]:
    edges = [(0, 1), (1, 4), (4, 8), (8, 16), (16, 32), (32, 64), (64, 1 << 20)]
    out = {}
    for lo, hi in edges:
        hit = [s for s in sizes if lo << 20 <= s < hi << 20]
        out[f"{lo}-{hi} MiB"] = (len(hit), round(sum(hit) / 1e9, 3))
    return out


def executor(src, dst, floor: float, cycles: int) -> dict:
    out = {}
    for label, env in SWITCHES.items():
        os.environ.update(env)
        try:
            r = tr.Refitter(src, dst, transport="nccl")
            r.refit()
            loc = r._program.local
            wall = median_ms(r.refit, 20, DEV)
            out[label] = {"wall ms": wall, "wall x floor": wall / floor,
                          "device x floor": device_ms(loc.graph.replay, cycles) / floor,
                          "memcpy": sum(w is None for w in loc.words), "SM kernels": sum(w is not None for w in loc.words),
                          "batched": 0 if loc.batch is None else len(loc.batch.dst), "small groups": len(loc.small)}
            r.close()
        finally:
            for k in env:
                del os.environ[k]
        print(f"  executor {label:16s} {json.dumps(out[label])}", flush=True)
    return out


def foreach_captured(big, t: dict, row: dict, cycles: int) -> None:
    """The program's copies as foreach copies on 1, 8 and 16 branches (and SM kernels on 8
    beside them), each checked for an exact copy."""
    t["kernels 8 br"] = device_ms(capture(big, 8, True).replay, cycles)
    for b in (1, 8, 16):
        g = capture(big, b, False, foreach=True)
        t[f"foreach {b} br"] = device_ms(g.replay, cycles)
        row[f"foreach {b} br exact"] = replays_exact(g, big)


def capture_seconds(big, row: dict, src, dst) -> None:
    """Host seconds of a fresh Refitter's construction and first refit on the same models,
    and to capture (and instantiate) the program's large copies as a graph, per arrangement
    (part of a first refit: ``execute.local._capture``); medians of three."""
    parts: dict[str, list[float]] = {"construct": [], "first refit": []}
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = tr.Refitter(src, dst, transport="nccl")
        t1 = time.perf_counter()
        r.refit()
        torch.cuda.synchronize()
        parts["construct"].append(t1 - t0)
        parts["first refit"].append(time.perf_counter() - t1)
        r.close()
    for k, v in parts.items():
        row[f"capture s, {k}"] = statistics.median(v)
    for label, branches, kernel in (("memcpy 8 br", 8, False), ("kernels 8 br", 8, True),
                                    ("kernels 1 br", 1, True)):
        secs = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            g = capture(big, branches, kernel)
            secs.append(time.perf_counter() - t0)
            del g
        row[f"capture s, {label}"] = statistics.median(secs)


def study(name: str, layers: int | None, bw: float, cycles: int, hand: bool = True,
          foreach_only: bool = False, capture_only: bool = False) -> dict:
    src, dst, r, floor = toy_refit(name, layers, bw, 3)
    p = r._program
    big = [(d, s) for d, s, _ in p.local.big if d.dtype == s.dtype and d.is_contiguous() and s.is_contiguous()]
    sizes = [d.nbytes for d, _ in big]
    row: dict = {"shape": name, "layers": layers, "floor_ms": floor, "large copies": len(p.local.big),
                 "plain large copies": len(big), "bytes of them": sum(sizes), "sizes": histogram(sizes)}
    t: dict[str, float] = {"program": device_ms(p.local.graph.replay, cycles)}
    if capture_only:
        capture_seconds(big, row, src, dst)
        print("  " + json.dumps({k: v for k, v in row.items() if k.startswith("capture s")}), flush=True)
    elif foreach_only:
        foreach_captured(big, t, row, cycles)
    elif hand:
        hand_captured(big, sizes, t, row, cycles)
    row["device ms"] = t
    row["x floor"] = {k: v / floor for k, v in t.items()}
    r.close()
    if not (foreach_only or capture_only):
        row["executor"] = executor(src, dst, floor, cycles)
    del src, dst, r, p, big
    gc.collect()
    torch.cuda.empty_cache()
    return row


def hand_captured(big, sizes: list[int], t: dict, row: dict, cycles: int) -> None:
    """The program's copies captured by hand in each arrangement (module docstring)."""
    for b in (8, 16):
        t[f"memcpy {b} br"] = device_ms(capture(big, b, False).replay, cycles)
        t[f"kernels {b} br"] = device_ms(capture(big, b, True).replay, cycles)
    total = sum(sizes)
    try:
        a = torch.empty(total, dtype=torch.uint8, device=DEV)
        b_ = torch.empty(total, dtype=torch.uint8, device=DEV)
        offs = [0]
        for s in sizes:
            offs.append(offs[-1] + s)
        packed = [(b_[o:o + s], a[o:o + s]) for o, s in zip(offs, sizes)]
        for br in (8, 16):
            t[f"packed memcpy {br} br"] = device_ms(capture(packed, br, False).replay, cycles)
        t["packed kernels 8 br"] = device_ms(capture(packed, 8, True).replay, cycles)
        t["flat"] = device_ms(lambda a=a, b_=b_: b_.copy_(a), cycles)
        del a, b_, packed
    except torch.OutOfMemoryError:
        row["packed"] = "no memory for two flat buffers"
    torch.cuda.empty_cache()
    aligned = [(d, s) for d, s in big if (d.data_ptr() | s.data_ptr() | d.nbytes) % 16 == 0]
    row["batched copies"] = len(aligned)
    for threads, unroll in TILINGS:
        key = f"batched {threads} x {unroll}"
        g, tiles = batched_launch(aligned, threads, unroll)
        t[key] = device_ms(g.replay, cycles)
        row[f"{key} tiles"] = tiles
        row[f"{key} exact"] = replays_exact(g, aligned)


def show(row: dict) -> None:
    print(f"\n== {row['shape']} ({row['layers']} layers): floor {row['floor_ms']:.3f} ms, "
          f"{row['large copies']} large copies ({row['plain large copies']} plain), {row['sizes']}")
    for k, v in row["device ms"].items():
        print(f"  {k:28s} {v:8.3f} ms  {row['x floor'][k]:.3f}x")
    print("  " + json.dumps({k: v for k, v in row.items() if "tiles" in k or "exact" in k}), flush=True)


def main() -> None:
    def add_args(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--executor-only", action="store_true", help="only the executor variants")
        ap.add_argument("--foreach-only", action="store_true", help="only foreach copies, SM kernels beside")
        ap.add_argument("--capture-only", action="store_true", help="only the host seconds of capturing")

    run_shapes(29583, SHAPES, lambda name, layers, bw, cycles, args: study(
        name, layers, bw, cycles, hand=not args.executor_only, foreach_only=args.foreach_only,
        capture_only=args.capture_only), show, add_args)


if __name__ == "__main__":
    main()
