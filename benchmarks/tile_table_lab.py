"""Issue 16 on one GPU: does the batched copy lose its last 1-2% to its tile table?

``execute.copy_kernel``'s ``copy_tiles`` reads one 24-byte table row per 4 KB tile before
its copy: 0.6% more bytes, and, since the streamed data evicts the table from L2, about
one DRAM round trip per block with nothing of the block's in flight. On an H200 the
qwen3-shaped preset's batched program ran 1.018-1.020x the floor on the device where one
flat copy of its bytes ran 0.996x (BENCHMARKS.md, twenty-sixth session); on an H100
1.010x. Variants, each one launch over the same runs, captured in a CUDA graph, device
time queued behind GPU sleep, over the copy floor of the same run:

- *table 128x2*: the executor's kernel and table as they are (24-byte tile rows up to
  e9820a4; from the twenty-seventh session the executor's kernel is the owner kernel);
- *owner TxU*: a kernel of this lab whose blocks read a 4-byte run index per tile
  (eight tiles a 32-byte sector, so one block in eight misses) and then the run's own row
  (runs: hundreds, cached), and compute their tile from the run; ``cs``: loads and stores
  with streaming hints (evict first), so the data leaves L2 to the indices;
- *flat kernel*: one block per 4 KB tile of one flat copy of all the bytes, no table at
  all (the most a block-per-tile kernel can do here), and *flat memcpy* of the same bytes;
- *memcpy 8 br*: the copies as memcpy nodes on 8 branches (the executor's other path).

Shapes: the presets' toy models, every plain large copy batched
(``TORCHREFIT_BATCHED_COPY=1``; qwen3 and dense-0.5b batch by default, deepseek-v3-moe
does not); every variant's result is checked exact against its source.

    PYTHONPATH=src python benchmarks/tile_table_lab.py --json OUT.json [--only qwen3,dense]
"""

from __future__ import annotations

import ctypes
import gc
import os

import torch
from diagnose_refit_phases import DEV, device_ms, run_shapes, toy_refit
from diagnose_refit_phases import capture as capture_branches
from mid_copy_lab import graph_of, replays_exact

from torchrefit.execute.batched import byte_runs
from torchrefit.execute.copy_kernel import (
    VECTOR,
    ByteRuns,
    _call,
    _function,
    _load,
    _nvrtc_cubin,
    copy_kernel,
    plan_runs,
)

#: deepseek at 1 layer fits an H100 (two toy models and the references); the shape
#: matrix's 2 layers need an H200 (``LAB_DEEPSEEK_LAYERS=2``)
SHAPES = [("qwen3-30b-a3b", 8), ("dense-0.5b", None), ("deepseek-v3-moe", int(os.environ.get("LAB_DEEPSEEK_LAYERS", 1)))]
#: (threads, vectors per thread, streaming hints) of the owner kernel
OWNER_SHAPES = [(128, 2, False), (128, 2, True), (64, 4, False), (256, 1, False), (128, 4, False), (256, 2, False)]

SOURCE = r"""
struct __align__(16) Vec { unsigned int x, y, z, w; };
#define TILE (THREADS * UNROLL)
#ifdef HINT
#define LOAD(p) __ldcs((const uint4*)(p))
#define STORE(p, v) __stcs((uint4*)(p), (v))
#else
#define LOAD(p) (*(const uint4*)(p))
#define STORE(p, v) (*(uint4*)(p) = (v))
#endif

// block t copies tile t of run owner[t]; run row: source, destination, 16-byte words per
// row, first tile, rows, source pitch, destination pitch (execute.copy_kernel.plan_runs)
extern "C" __global__ void __launch_bounds__(THREADS) copy_owned(const long long* __restrict__ runs,
                                                                 const int* __restrict__ owner) {
    const long long t = blockIdx.x;
    const long long* r = runs + 7 * (long long)__ldg(owner + t);
    const long long words = r[2], k = t - r[3];
    long long row = 0, start = k * TILE;
    if (r[4] != 1) {
        const long long per = (words + TILE - 1) / TILE;
        row = k / per;
        start = (k - row * per) * TILE;
    }
    const char* src = (const char*)(r[0] + row * r[5]) + 16 * start;
    char* dst = (char*)(r[1] + row * r[6]) + 16 * start;
    const long long left = words - start;
    const int n = left < TILE ? (int)left : TILE;
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const int j = u * THREADS + threadIdx.x;
        if (j < n) v[u] = LOAD(src + 16 * (long long)j);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const int j = u * THREADS + threadIdx.x;
        if (j < n) STORE(dst + 16 * (long long)j, v[u]);
    }
}

// one flat copy, one block per tile, no table
extern "C" __global__ void __launch_bounds__(THREADS) copy_flat(const uint4* __restrict__ src,
                                                                uint4* __restrict__ dst, long long words) {
    const long long base = (long long)blockIdx.x * TILE;
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const long long j = base + u * THREADS + threadIdx.x;
        if (j < words) v[u] = src[j];
    }
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const long long j = base + u * THREADS + threadIdx.x;
        if (j < words) dst[j] = v[u];
    }
}
"""


def kernels(threads: int, unroll: int, hint: bool) -> tuple[int, int]:
    """(copy_owned, copy_flat) compiled by NVRTC for this device at this shape."""
    major, minor = torch.cuda.get_device_capability(DEV)
    defines = (f"-DTHREADS={threads}", f"-DUNROLL={unroll}", *(("-DHINT",) if hint else ()))
    module = _load(_nvrtc_cubin(SOURCE, f"sm_{major}{minor}", defines))
    return _function(module, b"copy_owned"), _function(module, b"copy_flat")


def owners(runs: torch.Tensor, total: int) -> torch.Tensor:
    """Each tile's run index (int32), from ``plan_runs``' run table. Pure. The same as
    ``copy_kernel.plan_owners`` (27a598a), kept here because the lab also runs on the tree
    before it (``benchmarks/patches/tile_index.patch`` reverted), which has none."""
    first = runs[:, 3]
    counts = torch.diff(torch.cat([first, torch.tensor([total])]))
    return torch.repeat_interleave(torch.arange(len(runs), dtype=torch.int32), counts)


def study(name: str, layers: int | None, bw: float, cycles: int, _args) -> dict:
    os.environ["TORCHREFIT_BATCHED_COPY"] = "1"
    try:
        src, dst, r, floor = toy_refit(name, layers, bw, 2)
    finally:
        del os.environ["TORCHREFIT_BATCHED_COPY"]
    batch = r._program.local.batch
    pairs = list(zip(batch.dst, batch.src))
    every = ByteRuns.cat([byte_runs(d, s) for d, s in pairs])
    nbytes = every.total()
    floor = 2 * nbytes / bw * 1e3  # of the batched bytes alone
    row = {"shape": name, "layers": layers, "floor_ms": floor, "copies": len(pairs), "runs": len(every),
           "batched_gb": nbytes / 1e9, "device ms": {}}
    t = row["device ms"]
    t["program graph"] = device_ms(r._program.local.graph.replay, cycles)
    kernel = copy_kernel(DEV)
    stream = torch.cuda.current_stream
    table = kernel.tiles(every, DEV)
    g = graph_of(lambda table=table: kernel.launch(table, stream()))
    t["table 128x2"] = device_ms(g.replay, cycles)
    row["table 128x2 exact"] = replays_exact(g, pairs)
    del g, table
    t["memcpy 8 br"] = device_ms(capture_branches(pairs, 8, False).replay, cycles)
    for threads, unroll, hint in OWNER_SHAPES:
        key = f"owner {threads}x{unroll}{' cs' if hint else ''}"
        owned, _ = kernels(threads, unroll, hint)
        runs, total = plan_runs(every, threads * unroll * VECTOR)
        runs_d, own_d = runs.to(DEV), owners(runs, total).to(DEV)

        def launch(owned=owned, runs_d=runs_d, own_d=own_d, total=total, threads=threads) -> None:
            _call(owned, total, threads, stream(), ctypes.c_uint64(runs_d.data_ptr()),
                  ctypes.c_uint64(own_d.data_ptr()))

        g = graph_of(launch)
        t[key] = device_ms(g.replay, cycles)
        row[f"{key} exact"] = replays_exact(g, pairs)
        del g
    flat_refs(nbytes, cycles, t, row)
    row["x floor"] = {k: v / floor for k, v in t.items()}
    r.close()
    del src, dst, r, batch, pairs
    gc.collect()
    torch.cuda.empty_cache()
    return row


def flat_refs(nbytes: int, cycles: int, t: dict, row: dict) -> None:
    """One flat copy of ``nbytes``: memcpy, and the table-free kernel at 128 x 2."""
    try:
        a = torch.empty(nbytes, dtype=torch.uint8, device=DEV).random_()
        b = torch.empty_like(a)
    except torch.OutOfMemoryError:
        row["flat"] = "no memory for two flat buffers"
        return
    t["flat memcpy"] = device_ms(lambda a=a, b=b: b.copy_(a), cycles)
    _, flat = kernels(128, 2, False)
    words = nbytes // VECTOR
    blocks = -(-words // 256)
    t["flat kernel 128x2"] = device_ms(lambda a=a, b=b: _call(
        flat, blocks, 128, torch.cuda.current_stream(), ctypes.c_uint64(a.data_ptr()),
        ctypes.c_uint64(b.data_ptr()), ctypes.c_int64(words)), cycles)
    torch.cuda.synchronize()
    row["flat kernel exact"] = torch.equal(a[: words * VECTOR], b[: words * VECTOR])
    del a, b
    torch.cuda.empty_cache()


def show(row: dict) -> None:
    print(f"\n== {row['shape']} ({row['layers']} layers): {row['copies']} copies, {row['runs']} runs, "
          f"{row['batched_gb']:.2f} GB, floor {row['floor_ms']:.3f} ms")
    for k, v in row["device ms"].items():
        print(f"  {k:24s} {v:8.3f} ms  {row['x floor'][k]:.4f}x")
    print("  exact: " + ", ".join(f"{k[:-6]}={v}" for k, v in row.items() if k.endswith("exact")), flush=True)


def main() -> None:
    run_shapes(29585, SHAPES, study, show)


if __name__ == "__main__":
    main()
