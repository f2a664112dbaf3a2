"""Issue 16 on one GPU: where a warm refit's wall time goes above the device time, phase
by phase, and three leads for the rest, each measured, none assumed.

For toy models of each shape (TP1 -> TP1, one process, torchrefit's defaults):

- *phases*: host time of each step of ``Refitter.refit()`` as it runs it (the failed
  check, the binding check, the storage check, the graph launch, the rest), each
  measured *cold* (the device idle before, as every timed refit of the matrix starts)
  and *warm* (the device busy with 20 ms of sleep, as after a queued optimizer step);
  wall of ``refit()`` and of the graph launch alone (sync, call, sync) against the
  graph's device time alone;
- *storage check*: ``map(Tensor.data_ptr)`` against torch's C++
  ``torch._C._tensors_data_ptrs_at_indices_equal`` (CUDA builds), cold and warm, and
  the binding and storage checks fused into one pass (the pointers of what the model's
  dicts hold now);
- *branches and copy kind*: the program's own large copies (runs already merged)
  captured by hand on 8 (the executor's), 16 and 32 branches, and on 8 branches as
  SM kernels (``torch.bitwise_or(src, 0, out=dst)`` on an integer view: the same
  bytes, a kernel instead of a memcpy node), device time of a replay.

    python benchmarks/diagnose_refit_phases.py --json OUT.json [--only qwen3,dense]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
import torch.distributed as dist

import torchrefit as tr
from torchrefit.bench.config import spec_from_preset
from torchrefit.bench.timing import copy_bandwidth, device_times, sleep_cycles_per_ms
from torchrefit.bench.world import one_gpu_world
from torchrefit.execute.local import balance_by_bytes
from torchrefit.testing import Mesh, build_toy

DEV = torch.device("cuda", 0)
SHAPES = [("qwen3-30b-a3b", 8), ("deepseek-v3-moe", 2), ("dense-0.5b", None)]


def phase_times(r, busy_cycles: int, iters: int = 30) -> dict:
    """Median host ms of each step of a refit; ``busy_cycles`` 0: device idle before."""
    p = r._program
    graph = p.local.graph
    steps = {"raise_if_failed": r._raise_if_failed, "rebind": r._rebind,
             "check_storage": p.check_storage, "graph launch": graph.replay, "refit()": r.refit}
    out: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(iters):
        for name, fn in steps.items():
            torch.cuda.synchronize()
            if busy_cycles:
                torch.cuda._sleep(busy_cycles)
            t0 = time.perf_counter_ns()
            fn()
            out[name].append((time.perf_counter_ns() - t0) / 1e6)
    torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in out.items()}


def wall_ms(fn, iters: int = 30) -> float:
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter_ns() - t0) / 1e6)
    return statistics.median(out)


def device_ms(fn, busy_cycles: int, iters: int = 20) -> float:
    """Device time of ``fn``'s work queued behind GPU sleep (host time left out)."""
    # device_times takes the sleep as ms x cycles per ms: one "ms" of busy_cycles cycles
    return statistics.median(device_times(fn, iters, DEV, busy_ms=1.0, cycles_per_ms=busy_cycles)) * 1e3


def checks(r, busy_cycles: int) -> dict:
    p = r._program
    ts, ptrs = list(p.compiled.watched), p.compiled.pointers  # the C++ function takes lists
    idx = list(range(len(ts)))
    dp = torch.Tensor.data_ptr
    fns = {"map data_ptr": lambda: list(map(dp, ts)) != ptrs}
    fast = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if fast is not None:
        fns["C++ _tensors_data_ptrs_at_indices_equal"] = lambda: fast(ts, ptrs, idx)
    for side, b in r._bindings.items():
        was = [t.data_ptr() for t in b._held]
        fns[f"binding {side} (today)"] = b.changed
        fns[f"fused {side}: map(data_ptr, map(dict.get))"] = (
            lambda b=b, was=was: list(map(dp, map(dict.get, b._dicts, b._names))) != was)
    out = {"watched": len(ts), "cxx_available": fast is not None,
           "bound": {s: len(b) for s, b in r._bindings.items()}}
    for label, busy in (("cold", 0), ("warm", busy_cycles)):
        for name, fn in fns.items():
            try:
                fn()
            except Exception as e:  # one failed probe must not lose the others
                out[f"{label} {name}"] = repr(e)[:200]
                continue
            v = []
            for _ in range(30):
                torch.cuda.synchronize()
                if busy:
                    torch.cuda._sleep(busy)
                t0 = time.perf_counter_ns()
                fn()
                v.append((time.perf_counter_ns() - t0) / 1e6)
            out[f"{label} {name}"] = statistics.median(v)
    torch.cuda.synchronize()
    return out


def capture(pairs, branches: int, sm: bool, foreach: bool = False) -> torch.cuda.CUDAGraph:
    """``pairs`` spread by bytes over ``branches`` graph branches: memcpy nodes, SM
    kernels (``sm``), or one ``torch._foreach_copy_`` per branch (``foreach``)."""
    streams = [torch.cuda.Stream() for _ in range(branches)]
    lanes: list[list] = [[] for _ in range(branches)]
    for pair, b in zip(pairs, balance_by_bytes([d.nbytes for d, _ in pairs], branches)):
        lanes[b].append(pair)
    graph = torch.cuda.CUDAGraph()
    cap = torch.cuda.Stream()
    cap.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(cap):
        graph.capture_begin(capture_error_mode="thread_local")
        for st in streams:
            st.wait_stream(cap)
        for st, lane in zip(streams, lanes):
            with torch.cuda.stream(st):
                if foreach and lane:
                    torch._foreach_copy_([d for d, _ in lane], [s for _, s in lane])
                    continue
                for d, s in lane:
                    if sm:
                        torch.bitwise_or(s, 0, out=d)
                    else:
                        d.copy_(s)
        for st in streams:
            cap.wait_stream(st)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(cap)
    return graph


def int_view(t: torch.Tensor) -> torch.Tensor | None:
    flat = t.reshape(-1).view(torch.uint8) if t.is_contiguous() else None
    if flat is None:
        return None
    for dt, n in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if flat.numel() % n == 0 and flat.data_ptr() % n == 0:
            return flat.view(dt)
    return flat


def copy_variants(r, busy_cycles: int, floor_ms: float) -> dict:
    p = r._program
    big = [(d, s) for d, s, _ in p.local.big if d.dtype == s.dtype]
    out = {"large copies": len(p.local.big), "same dtype": len(big),
           "program graph (device)": device_ms(p.local.graph.replay, busy_cycles)}
    for b in (8, 16, 32):
        out[f"memcpy {b} branches"] = device_ms(capture(big, b, False).replay, busy_cycles)
    views = [(int_view(d), int_view(s)) for d, s in big]
    if all(d is not None and s is not None and d.dtype == s.dtype for d, s in views):
        g = capture(views, 8, True)
        out["SM kernels 8 branches"] = device_ms(g.replay, busy_cycles)
        for d, _ in big[:3]:
            d.zero_()
        g.replay()
        torch.cuda.synchronize()
        out["SM kernels exact"] = all(torch.equal(d, s) for d, s in big)
    out["x floor"] = {k: v / floor_ms for k, v in out.items() if isinstance(v, float)}
    return out


def toy_refit(name: str, layers: int | None, bw: float, refits: int):
    """Toy models of preset ``name`` (source and destination, random values) on the GPU,
    their TP1 -> TP1 Refitter after ``refits`` refits, and its copy floor in ms at ``bw``."""
    spec = spec_from_preset(name, layers=layers)
    src = build_toy(spec, Mesh(), 0, seed=1, device=DEV, random_init=True)
    dst = build_toy(spec, Mesh(), 0, seed=2, device=DEV, random_init=True)
    r = tr.Refitter(src, dst, transport="nccl")
    for _ in range(refits):
        r.refit()
    return src, dst, r, 2 * r.plan.bytes_local / bw * 1e3


def study(name: str, layers: int | None, bw: float, cycles: int) -> dict:
    src, dst, r, floor = toy_refit(name, layers, bw, 5)
    row = {"shape": name, "layers": layers, "floor_ms": floor,
           "watched": len(r._program.compiled.watched), "large copies": len(r._program.local.big)}
    row["cold"] = phase_times(r, 0)
    row["warm"] = phase_times(r, cycles)
    row["wall refit()"] = wall_ms(r.refit)
    row["wall graph launch"] = wall_ms(r._program.local.graph.replay)
    row["device graph"] = device_ms(r._program.local.graph.replay, cycles)
    for k in ("wall refit()", "wall graph launch", "device graph"):
        row[f"{k} x floor"] = row[k] / floor
    for part in ("checks", "copies"):
        try:
            row[part] = checks(r, cycles) if part == "checks" else copy_variants(r, cycles, floor)
        except Exception as e:  # one failed probe must not lose the others
            row[part] = {"error": repr(e)}
    r.close()
    del src, dst, r
    gc.collect()
    torch.cuda.empty_cache()
    return row


def show(row: dict) -> None:
    print(f"\n== {row['shape']} ({row['layers']} layers): floor {row['floor_ms']:.3f} ms, "
          f"{row['watched']} watched tensors, {row['large copies']} large copies")
    for k in ("raise_if_failed", "rebind", "check_storage", "graph launch", "refit()"):
        print(f"  host ms {k:18s} cold {row['cold'][k]:.3f}  warm {row['warm'][k]:.3f}")
    for k in ("wall refit()", "wall graph launch", "device graph"):
        print(f"  {k:20s} {row[k]:.3f} ms = {row[k + ' x floor']:.3f}x")
    print("  checks", json.dumps(row["checks"], default=str))
    print("  copies", json.dumps(row["copies"], default=str))


def run_shapes(port: int, shapes, study, show, add_args=None, meta: dict | None = None) -> None:
    """A shape lab's main (this script's, ``mid_copy_lab``'s, ``tile_kernel_lab``'s): parse
    ``--json`` and ``--only`` (and what ``add_args`` adds), join a one-GPU world on ``port``,
    measure the copy floor and the GPU sleep rate once, then ``study(name, layers, bw,
    cycles, args)`` each shape, ``show`` its row and write every row so far to ``--json``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--only", help="comma list of preset names' first words")
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args()
    one_gpu_world(port)
    bw = copy_bandwidth(DEV)
    cycles = int(20 * sleep_cycles_per_ms(DEV))
    head = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, **(meta or {})}
    print(", ".join([head["device"], *(f"{k} {v}" for k, v in head.items() if k != "device"),
                     f"copy {bw / 1e9:.0f} GB/s"]), flush=True)
    only = set(args.only.split(",")) if args.only else None
    rows = []
    for name, layers in shapes:
        if only and name.split("-")[0] not in only:
            continue
        rows.append(study(name, layers, bw, cycles, args))
        show(rows[-1])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**head, "copy_gbs": bw / 1e9, "rows": rows}, f, indent=1, default=str)
    dist.destroy_process_group()


def main() -> None:
    run_shapes(29581, SHAPES, lambda name, layers, bw, cycles, _: study(name, layers, bw, cycles), show)


if __name__ == "__main__":
    main()
