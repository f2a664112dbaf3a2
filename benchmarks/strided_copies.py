"""Strided destination copies on one GPU: the lead for ipc's collocated TP2 -> TP1 refit
at 1.8x the floor (issue 10, BENCHMARKS.md "Transports run 6" and 7).

In TP2 -> TP1 a rank's half of a row-parallel weight (the seed's ``linear_fc2``
[4096, 8192] of [4096, 16384], ``linear_proj`` [4096, 2048] of [4096, 4096]) lands
in a strided view of the destination (``full[:, :half]``), about 38% of a rank's
bytes; TP1 -> TP1 copies are all contiguous. Times, with the device idle before each
call (``bench.timing.median_ms``), every layer's two halves copied into strided views
as torch copies of (1) bf16 elements, (2) int64 views of the same bytes, (3) complex128
views (16-byte elements), (4) the same bytes as contiguous copies; (5) as 2-D memcpys
(``cuMemcpy2DAsync``: rows of contiguous bytes at a pitch), (6) as a Triton kernel
copying rows in 16-byte vectors, (7) torchrefit's batched copy kernel, one launch for
every row of every half (``execute.batched.strided_runs``), and (8) the same kernel on
the contiguous copies; each against the copy floor (bytes read + written at
this run's 4 GiB copy bandwidth), each checked bit for bit.

    python benchmarks/strided_copies.py [--layers 20] [--iters 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json

import torch

from torchrefit._cuda_driver import driver_function
from torchrefit.bench.timing import copy_bandwidth, median_ms


def _pairs(layers: int, hidden: int, ffn: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(layers):
        for cols in (ffn, hidden):  # linear_fc2 and linear_proj: split along their columns
            full = torch.empty(hidden, cols, dtype=torch.bfloat16, device="cuda")
            # every bit pattern, NaN payloads included: the wider views must move bits, not values
            half = torch.randint(-(1 << 15), 1 << 15, (hidden, cols // 2), dtype=torch.int16,
                                 device="cuda").view(torch.bfloat16)
            out.append((full[:, : cols // 2], half))
    return out


class _Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D, field for field (memory type 2: device)."""

    _fields_ = [(n, t) for side in ("src", "dst") for n, t in (
        (f"{side}XInBytes", ctypes.c_size_t), (f"{side}Y", ctypes.c_size_t), (f"{side}MemoryType", ctypes.c_int),
        (f"{side}Host", ctypes.c_void_p), (f"{side}Device", ctypes.c_uint64), (f"{side}Array", ctypes.c_void_p),
        (f"{side}Pitch", ctypes.c_size_t))] + [("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


def _memcpy2d(pairs):
    """One ``cuMemcpy2DAsync`` per pair on the current stream."""
    call = driver_function("cuMemcpy2DAsync", [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p])
    params = [_Memcpy2D(srcMemoryType=2, srcDevice=s.data_ptr(), srcPitch=s.stride(0) * s.element_size(),
                        dstMemoryType=2, dstDevice=d.data_ptr(), dstPitch=d.stride(0) * d.element_size(),
                        WidthInBytes=d.shape[1] * d.element_size(), Height=d.shape[0]) for d, s in pairs]

    def run() -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        for p in params:
            assert call(ctypes.byref(p), stream) == 0
    return run


def _triton_rows(pairs):
    """A Triton kernel per pair: one program per (row, 8 KB of it), int32 words that
    Triton loads as 16-byte vectors (pitches and widths divisible by 16)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rows(dst, src, dst_pitch, src_pitch, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        tl.store(dst + row * dst_pitch + cols, tl.load(src + row * src_pitch + cols, mask=mask), mask=mask)

    block = 2048
    words = [(d.view(torch.int32), s.view(torch.int32)) for d, s in pairs]

    def run() -> None:
        for d, s in words:
            grid = (d.shape[0], triton.cdiv(d.shape[1], block))
            rows[grid](d, s, d.stride(0), s.stride(0), d.shape[1], BLOCK=block)
    return run


def _batched(pairs):
    from torchrefit.execute.batched import compile_batch

    batch = compile_batch([(d, s, str(i)) for i, (d, s) in enumerate(pairs)], pairs[0][0].device)
    return batch.launch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json")
    args = p.parse_args()
    device = torch.device("cuda", 0)
    bandwidth = copy_bandwidth(device)
    pairs = _pairs(args.layers, args.hidden, args.ffn)
    flat = [(torch.empty_like(s), s) for _, s in pairs]
    nbytes = sum(s.nbytes for _, s in pairs)
    floor = 2 * nbytes / bandwidth * 1e3

    def copies(dtype):
        group = pairs if dtype is None else [(d.view(dtype), s.view(dtype)) for d, s in pairs]
        return lambda: [d.copy_(s) for d, s in group]

    variants = {"strided bf16": copies(None), "strided int64 views": copies(torch.int64),
                "strided complex128 views": copies(torch.complex128),
                "contiguous": lambda: [d.copy_(s) for d, s in flat],
                "strided 2-D memcpy": _memcpy2d(pairs), "strided triton rows": _triton_rows(pairs),
                "strided batched rows": _batched(pairs), "contiguous batched": _batched(flat)}
    rows, exact = {}, {}
    for name, fn in variants.items():
        for d, _ in pairs + flat:
            d.zero_()
        ms = median_ms(fn, args.iters, device)
        rows[name] = {"ms": ms, "x_floor": ms / floor}
        group = flat if name.startswith("contiguous") else pairs
        exact[name] = all(torch.equal(d.view(torch.int16), s.view(torch.int16)) for d, s in group)
    print(f"{len(pairs)} copies, {nbytes / 1e9:.2f} GB, floor {floor:.3f} ms at {bandwidth / 1e9:.0f} GB/s")
    for name, r in rows.items():
        print(f"  {name:<26} {r['ms']:8.3f} ms  {r['x_floor']:.3f}x  exact: {exact[name]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "floor_ms": floor, "rows": rows, "exact": exact,
                       "device": torch.cuda.get_device_name(0)}, f)


if __name__ == "__main__":
    main()
