"""What ``watch="every"`` costs per refit, and what cheaper forms of the same check cost:
one process, a preset's toy model (TP1 -> TP1), the check's parts timed alone (host
microseconds, min over repeats; nothing else runs).

* ``bindings``: ``Binding.changed`` on both sides (is each described tensor still the one
  its module holds: ``dict.get`` and ``is`` per tensor);
* ``views``: ``Program.storage_moved`` as ``refit()`` runs it: the data
  pointers below, then ``is_set_to`` per watched tensor against an alias taken when
  compiling (same storage, offset, sizes and strides);
* ``pointers_map``: the data pointers alone (``data_ptr`` per watched tensor in a ``map``,
  a list compared: cheaper, but it misses a tensor re-viewed in place);
* ``pointers_c``: the same answer from ``torch._C._tensors_data_ptrs_at_indices_equal``
  (one C++ loop; in CUDA builds only), when present;
* ``pointers_strides_numel``: a cheaper candidate for ``views``: the pointers, then ``stride()``
  and ``numel()`` per tensor against lists taken when compiling. With the pointer
  unchanged these catch a transposed or re-strided view and a narrower one.
* ``native_views`` and ``native_bindings``: the same two answers from the optional C++
  loops (``torchrefit._native.watch``), where ``torchrefit native build`` built them;
  ``bindings`` and ``views`` above are then the Python forms, timed with it off.
* ``every_refit_host_us``: a whole refit's host time with ``watch="every"`` as it runs
  (native where built).
* ``every_refit_host_matrix_warm_us`` / ``..._cold_us`` (GPU only): the same refit's host
  time as the shape matrix's *host ms* columns measure it (``bench.timing.host_times``:
  calls queued behind 20 ms of GPU sleep; cold = the first call after the host waited).
* ``built_s``: the Refitter's construction and first refit, seconds (the huge pages,
  which the second refit's check starts on a thread of its own, are then made here
  before anything is timed; ``collapse_ms``: how long that took);
* ``metadata_objects``, ``metadata_pages_4k``, ``metadata_regions_2m``: the watched
  tensors' TensorImpls and StorageImpls (torch's ``_cdata`` addresses), and how many pages
  of 4 KiB and regions of 2 MiB hold them;
* ``huge_pages`` and ``anon_huge_kib``: whether the native views check made that memory
  huge pages (``_native.watch.views_check``, from ``COLLAPSE_MIN`` watched views on), and
  this process's memory in huge pages at the end (Linux).
* ``..._after_wait_us``: the same, each call made right after the host waited for the
  device (a GPU sleep of ``--wait-ms``, then ``torch.cuda.synchronize``), as the
  benchmarks time a refit; median of 15. On a CPU, right after writing 256 MiB instead.
  ``native_holders_watched``: whether the native holders check sees its dicts' changes
  without looking them up (a dict watcher on Python 3.12+, version tags before): then it
  looks only after a dict changed.

    python benchmarks/watch_cost.py --preset qwen3-30b-a3b --layers 8 [--full-size] [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit
from dataclasses import replace

import torch

import torchrefit as tr
import torchrefit.bench.timing
from torchrefit.bench.world import report_and_leave, tiny_toy_pair


def best_us(fn, number: int = 50, repeat: int = 9) -> float:
    return round(min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6, 2)


def after_wait_us(fn, device: torch.device, wait_ms: float, calls: int = 15) -> float:
    """Median host microseconds of ``fn`` called right after the host waited for the
    device (see the module's docstring)."""
    return median_us_after(fn, host_waits(device, wait_ms), calls)


def host_waits(device: torch.device, wait_ms: float, flush_mib: int = 256):
    """A wait that leaves the host as a timed refit finds it: on a GPU, ``wait_ms`` of
    GPU sleep then ``synchronize``; on a CPU, ``flush_mib`` MiB written (caches evicted)."""
    if device.type == "cuda":
        cycles = int(wait_ms * tr.bench.timing.sleep_cycles_per_ms(device))

        def wait() -> None:
            torch.cuda._sleep(cycles)
            torch.cuda.synchronize(device)
        return wait
    flush = torch.zeros(flush_mib << 20, dtype=torch.uint8)
    return lambda: flush.add_(1)


def median_us_after(fn, wait, calls: int) -> float:
    """Median microseconds of ``fn``, each call made right after ``wait()``."""
    out = []
    for _ in range(calls):
        wait()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return round(statistics.median(out) * 1e6, 2)


def _anon_huge_kib() -> int | None:
    try:
        with open("/proc/self/smaps_rollup") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("AnonHugePages:"))
    except (OSError, StopIteration):
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json")
    ap.add_argument("--wait-ms", type=float, default=7.0)
    ap.add_argument("--full-size", action="store_true",
                    help="the preset's own sizes (as the shape matrix's toy rows), not tiny ones")
    args = ap.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    src, dst = tiny_toy_pair(args.preset, args.layers, 29633, device, full_size=args.full_size)
    t0 = time.perf_counter()
    r = tr.Refitter(src, dst)
    r.refit()
    built_s = time.perf_counter() - t0  # construction and first refit
    program = r._program
    collapse_ms = None
    if program.compiled.native is not None and program.compiled.native.collapse_pending:
        # timed below: the steady state, with the huge pages its first check would ask for
        t0 = time.perf_counter()
        program.compiled.native.collapse()
        collapse_ms = round((time.perf_counter() - t0) * 1e3, 2)
        program.compiled.native.unchanged()
    fast_views, fast_bindings = program.compiled.native, [b._native for b in r._bindings.values()]
    if fast_views is not None:
        def holders() -> list[bool]:
            return [f.unchanged() for f in fast_bindings if f]

        out_native = {"native_views_us": best_us(fast_views.unchanged), "native_bindings_us": best_us(holders),
                      "native_holders_watched": [f.watched for f in fast_bindings if f]}
        out_native["native_views_after_wait_us"] = after_wait_us(fast_views.unchanged, device, args.wait_ms)
        out_native["native_bindings_after_wait_us"] = after_wait_us(holders, device, args.wait_ms)
    else:
        out_native = {"native": "not built (torchrefit native build)"}
    program.compiled = replace(program.compiled, native=None)  # the Python forms below
    for b in r._bindings.values():
        b._native = None
    watched = list(program.compiled.watched)
    pointers = list(program.compiled.pointers)
    out = {"preset": args.preset, "layers": args.layers, "device": str(device), "watched": len(watched),
           "bound": sum(len(b) for b in r._bindings.values()),
           "bindings_us": best_us(r._rebind), "views_us": best_us(program.storage_moved),
           "pointers_map_us": best_us(lambda: list(map(torch.Tensor.data_ptr, watched)) != pointers)}
    c_check = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if c_check is not None:
        every = list(range(len(watched)))
        assert c_check(watched, pointers, every)
        out["pointers_c_us"] = best_us(lambda: c_check(watched, pointers, every))
    strides, numels = list(map(torch.Tensor.stride, watched)), list(map(torch.Tensor.numel, watched))
    out["pointers_strides_numel_us"] = best_us(
        lambda: list(map(torch.Tensor.data_ptr, watched)) != pointers
        or list(map(torch.Tensor.stride, watched)) != strides or list(map(torch.Tensor.numel, watched)) != numels)
    out["manual_refit_host_us"] = best_us(lambda: program.run(False), number=20)
    out["manual_refit_host_after_wait_us"] = after_wait_us(lambda: program.run(False), device, args.wait_ms)
    out.update(out_native)
    objects = [t._cdata for t in watched] + [t.untyped_storage()._cdata for t in watched]
    out["built_s"] = round(built_s, 4)
    out["collapse_ms"] = collapse_ms  # asking for the huge pages (a thread's work in a refit)
    out["metadata_objects"] = len(objects)  # the watched TensorImpls and their StorageImpls
    out["metadata_pages_4k"] = len({a >> 12 for a in objects})
    out["metadata_regions_2m"] = len({a >> 21 for a in objects})
    out["huge_pages"] = collapse_ms is not None  # the native views check asked for them
    out["anon_huge_kib"] = _anon_huge_kib()  # this process's memory in huge pages (Linux)
    every = tr.Refitter(src, dst)  # a fresh one: native where built
    every.refit()
    out["every_refit_host_us"] = best_us(every.refit, number=20)
    out["every_refit_host_after_wait_us"] = after_wait_us(every.refit, device, args.wait_ms)
    if device.type == "cuda":  # as the shape matrix's host columns measure it
        warm, cold = tr.bench.timing.median_host_ms(every.refit, 15, device)
        out["every_refit_host_matrix_warm_us"], out["every_refit_host_matrix_cold_us"] = \
            round(warm * 1e3, 2), round(cold * 1e3, 2)
    report_and_leave(out, args.json)


if __name__ == "__main__":
    main()
