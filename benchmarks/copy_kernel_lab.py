"""Issue 16 on one GPU: can an SM copy kernel match the copy engine's memcpy?

Every copy kernel tried before (torch's elementwise copy on integer views, Triton tiles
of 64 KB - 2 MB with cache hints) ran 2.5-4% slower than ``cudaMemcpyAsync`` even on
large copies (BENCHMARKS.md, "Mid-sized copies"), and mid-sized memcpy nodes run 10-15%
slow, so qwen3-shaped refits (thousands of 3 MiB expert tensors) sat at 1.04x. Timed
against memcpy of the same bytes:

- *flat*: one 4 GiB copy by a plain CUDA C kernel (16-byte vectors, ``u`` of them in
  flight per thread before any store, optional streaming cache hints; compiled here
  through CuPy's NVRTC), by torch's elementwise copy, and by ``execute.copy_kernel``;
- *fragmented*: 3072 separate 3 MiB tensors (qwen3-30b-a3b's expert matrices, 8 layers)
  copied by one launch of ``execute.copy_kernel`` at several shapes (threads x vectors per
  thread; a tile is their product x 16 bytes), eagerly and captured in a CUDA graph, and
  as memcpy graph nodes.

Device time from CUDA events around each launch, median of ``--reps``; every result is
checked against its source. Needs CuPy (on the H200 image). (A per-tile kernel of the lab's
own, unused by the run of BENCHMARKS.md's "Tenth session", was removed after it.)

    PYTHONPATH=src python benchmarks/copy_kernel_lab.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import cupy as cp
import torch

from torchrefit.execute.copy_kernel import copy_kernel

SOURCE = r"""
#define LOAD_plain(p) (*(p))
#define LOAD_ldg(p) __ldg(p)
#define LOAD_ldcs(p) __ldcs(p)
#define STORE_plain(p, v) (*(p) = (v))
#define STORE_stcs(p, v) __stcs((p), (v))
#define STORE_stcg(p, v) __stcg((p), (v))

extern "C" __global__ void flat(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                unsigned long long n) {
    unsigned long long step = (unsigned long long)blockDim.x * UNROLL;
    for (unsigned long long base = blockIdx.x * step; base < n; base += gridDim.x * step) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            unsigned long long j = base + u * blockDim.x + threadIdx.x;
            if (j < n) v[u] = LOAD(src + j);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            unsigned long long j = base + u * blockDim.x + threadIdx.x;
            if (j < n) STORE(dst + j, v[u]);
        }
    }
}
"""

FLAT_BYTES = 4 << 30
PIECE_BYTES = 2048 * 768 * 2  # one qwen3 expert matrix, bf16
PIECES = 3072  # 8 layers x 128 experts x 3 matrices


def module(unroll: int, load: str, store: str) -> cp.RawModule:
    opts = ("-std=c++17", f"-DUNROLL={unroll}", f"-DLOAD=LOAD_{load}", f"-DSTORE=STORE_{store}")
    return cp.RawModule(code=SOURCE, options=opts)


def timed(fn, *args, reps: int = 20) -> float:
    """Median device ms of ``fn(*args)`` (queued on torch's current stream, which CuPy shares)."""
    fn(*args)
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def launch(f, blocks: int, threads: int, *args) -> None:
    f((blocks,), (threads,), tuple(cp.uint64(a) if type(a) is int else a for a in args))


def flat_lab(sms: int, reps: int) -> dict:
    src = torch.randint(0, 1 << 30, (FLAT_BYTES // 8,), dtype=torch.int64, device="cuda")
    dst = torch.empty_like(src)
    floor = timed(dst.copy_, src, reps=reps)
    out = {"memcpy_ms": floor, "torch_kernel": timed(lambda a: torch.bitwise_or(a, 0, out=dst), src, reps=reps) / floor}
    n16 = FLAT_BYTES // 16
    for unroll in (1,):
        for load, store in (("plain", "plain"), ("ldcs", "stcs")):
            f = module(unroll, load, store).get_function("flat")
            for threads in (128, 256):
                for grid in (None,):
                    blocks = grid or -(-n16 // (threads * unroll))
                    dst.zero_()
                    ms = timed(launch, f, blocks, threads, src.data_ptr(), dst.data_ptr(), n16, reps=reps)
                    assert torch.equal(dst, src), (unroll, load, store, threads, grid)
                    out[f"u{unroll} {load}/{store} t{threads} g{grid or 'all'}"] = ms / floor
    for threads, unroll in ((256, 1), (128, 4), (256, 4)):
        k = copy_kernel(torch.device("cuda"), threads, unroll)
        table = k.tiles([(dst.data_ptr(), src.data_ptr(), FLAT_BYTES)], torch.device("cuda"))
        dst.zero_()
        ms = timed(k.launch, table, torch.cuda.current_stream(), reps=reps)
        assert torch.equal(dst, src), (threads, unroll)
        out[f"copy_tiles t{threads} u{unroll}"] = ms / floor
    best = sorted((v, k) for k, v in out.items() if k != "memcpy_ms")[:8]
    print("flat 4 GiB, memcpy", round(floor, 3), "ms; best x memcpy:", [(k, round(v, 4)) for v, k in best])
    return out


def fragmented_lab(sms: int, reps: int) -> dict:
    srcs = [torch.randint(0, 1 << 30, (PIECE_BYTES // 8,), dtype=torch.int64, device="cuda") for _ in range(PIECES)]
    dsts = [torch.empty_like(s) for s in srcs]
    pairs = list(zip(dsts, srcs))
    one = torch.empty(2, PIECES * PIECE_BYTES // 8, dtype=torch.int64, device="cuda")
    floor = timed(one[1].copy_, one[0], reps=reps)
    one = None  # noqa: F841 (frees the 19 GB before the tiles' tables)
    out = {"memcpy_ms (one copy of the same bytes)": floor}
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for d, s in pairs:
            d.copy_(s)
    out["memcpy nodes, one stream"] = timed(g.replay, reps=reps) / floor
    stream = torch.cuda.current_stream()
    for threads, unroll in ((128, 1), (128, 2), (128, 4), (128, 8), (256, 1), (256, 2), (256, 4), (512, 1),
                            (512, 2), (64, 4), (64, 8)):
        k = copy_kernel(torch.device("cuda"), threads, unroll)
        table = k.tiles([(d.data_ptr(), s.data_ptr(), d.nbytes) for d, s in pairs], torch.device("cuda"))
        for d in dsts:
            d.zero_()
        ms = timed(k.launch, table, stream, reps=reps)
        assert all(torch.equal(d, s) for d, s in pairs), (threads, unroll)
        out[f"copy_tiles t{threads} u{unroll} ({k.tile_bytes >> 10} KB tiles)"] = ms / floor
        out[f"compile s t{threads} u{unroll}"] = k.compile_s
        # captured in a CUDA graph, as the executor runs it
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            k.launch(table, torch.cuda.current_stream())
        for d in dsts:
            d.zero_()
        out[f"copy_tiles t{threads} u{unroll} as a graph"] = timed(g.replay, reps=reps) / floor
        assert all(torch.equal(d, s) for d, s in pairs), ("graph", threads, unroll)
    best = sorted((v, k) for k, v in out.items() if not k.startswith(("memcpy_ms", "compile")))[:8]
    print("fragmented, one memcpy", round(floor, 3), "ms; memcpy nodes x", round(out["memcpy nodes, one stream"], 4),
          "; best x memcpy:", [(k, round(v, 4)) for v, k in best])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream).use()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {"device": torch.cuda.get_device_name(), "sms": sms,
               "flat 4 GiB (x memcpy)": flat_lab(sms, args.reps)}
    torch.cuda.empty_cache()
    results["fragmented 3072 x 3 MiB (x one memcpy)"] = fragmented_lab(sms, args.reps)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
