"""One CUDA kernel that copies many byte runs in one launch, compiled at first use.

Why a kernel of our own: a plain CUDA copy kernel of 16-byte vectors, one block per
2-4 KB, streams at ``cudaMemcpyAsync``'s rate, where torch's elementwise copy and Triton
tiles run a few percent slower; cut into tiles, it copies thousands of separate
tensors at the rate of one memcpy of all their bytes. Copies are runs, one
row each in a run table (:func:`plan_runs`: source, destination, 16-byte words per row,
first tile, rows and both pitches), cut into tiles of ``TILE_BYTES``; block ``b`` copies
tile ``b``, of the run ``owner[b]`` names: a 4-byte index per tile, built on the device
by a second kernel from the run table (:meth:`CopyKernel.tiles`), from which the block
computes its tile's addresses. :func:`plan_owners` is the pure reference of that index,
:func:`plan_tiles` of what each tile copies.

Why an index and not the tile's addresses: the streamed data evicts such a table from
L2, so a block's first load is a DRAM round trip with none of its copy in flight; eight
indices share a 32-byte sector where one 24-byte row of addresses did not, and the run
rows (one per copy) stay cached (finding the run by a binary search over the runs in each
block instead was slower still: twelve dependent loads).

Compiled with NVRTC (the CUDA runtime compiler torch's CUDA wheels ship, loaded through
ctypes) for the device's own architecture, once per machine (``execute.kernels.image_cache``
keeps the image on disk for later processes), and loaded and launched through the driver
(``cuModuleLoadData``, ``cuLaunchKernel``): no compiled extension, no Triton, and a
launch on a capturing stream is captured into the program's CUDA graph like any other.
:func:`copy_kernel` returns None where NVRTC or the driver is missing or refuses (the
caller then copies one by one).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ... import settings
from ..._util.cuda_driver import driver_function
from . import image_cache

__all__ = ["ByteRuns", "VECTOR", "THREADS", "UNROLL", "TILE_BYTES", "MAX_TILES", "TileTable", "CopyKernel", "copy_kernel",
           "plan_runs", "plan_owners", "plan_tiles", "SOURCE"]

#: bytes each thread moves per access (one 16-byte vector load and store)
VECTOR = 16
#: threads per block and vectors per thread (all loaded before any store): 4 KB tiles.
#: Two 16-byte loads in flight per thread and small blocks keep enough bytes in flight per
#: SM; 256 threads with one or four vectors each streamed slower on many 3 MiB copies
THREADS, UNROLL = 128, 2
#: bytes per tile (block) of the default shape
TILE_BYTES = THREADS * UNROLL * VECTOR

SOURCE = r"""
#define TILE (THREADS * UNROLL)

// Block t copies tile t of run owner[t]. Run row (plan_runs): source, destination, 16-byte
// words per row, first tile, rows, source pitch, destination pitch, in bytes where not
// words. Two dependent loads before the copy, both mostly cache hits: the index (eight a
// 32-byte sector) and the run's row (one per copy).
extern "C" __global__ void __launch_bounds__(THREADS) copy_tiles(const long long* __restrict__ runs,
                                                                 const int* __restrict__ owner) {
    const long long t = blockIdx.x;
    const long long* r = runs + 7 * (long long)__ldg(owner + t);
    const long long words = r[2], k = t - r[3];
    long long row = 0, start = k * TILE;  // vectors into its row
    if (r[4] != 1) {  // rows at a pitch: which row, then where in it
        const long long per_row = (words + TILE - 1) / TILE;
        row = k / per_row;
        start = (k - row * per_row) * TILE;
    }
    const uint4* __restrict__ src = (const uint4*)(r[0] + row * r[5] + 16 * start);
    uint4* __restrict__ dst = (uint4*)(r[1] + row * r[6] + 16 * start);
    const long long left = words - start;
    const int n = left < TILE ? (int)left : TILE;
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {  // every load before any store: UNROLL in flight
        const int j = u * THREADS + threadIdx.x;
        if (j < n) v[u] = src[j];
    }
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const int j = u * THREADS + threadIdx.x;
        if (j < n) dst[j] = v[u];
    }
}

// Each tile's run (the last run whose first tile is at or before it), one thread per
// tile: once per compile, so the host uploads one row per copy, not one per tile.
extern "C" __global__ void expand_tiles(const long long* __restrict__ runs, int count, long long tiles,
                                        int* __restrict__ owner) {
    const long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (t >= tiles) return;
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (runs[7 * mid + 3] <= t) lo = mid; else hi = mid - 1;
    }
    owner[t] = lo;
}
"""


@dataclass(frozen=True)
class ByteRuns:
    """Byte runs to copy, as int64 columns, one element per run: destination address,
    source address, bytes per row, and the run's rows with each side's pitch (bytes from
    one row's start to the next). A dense copy is one run of one row; a strided copy
    (a TP half into ``full[:, :half]``) one run whose rows are its rows, however many
    (``rows`` None: one row each, no pitch)."""

    dst: torch.Tensor
    src: torch.Tensor
    nbytes: torch.Tensor
    rows: torch.Tensor | None = None
    dst_pitch: torch.Tensor | None = None
    src_pitch: torch.Tensor | None = None

    @staticmethod
    def of(copies: Sequence[tuple[int, int, int]]) -> ByteRuns:
        """From (destination address, source address, bytes) triples."""
        cols = torch.tensor(list(copies), dtype=torch.int64).reshape(-1, 3)
        return ByteRuns(*cols.unbind(1))

    @staticmethod
    def cat(parts: Sequence[ByteRuns]) -> ByteRuns:
        if not parts:
            return ByteRuns.of([])
        if all(p.rows is None for p in parts):
            return ByteRuns(*(torch.cat(cols) for cols in zip(*((p.dst, p.src, p.nbytes) for p in parts))))
        return ByteRuns(*(torch.cat(cols) for cols in zip(*(p.columns() for p in parts))))

    def columns(self) -> tuple[torch.Tensor, ...]:
        """Every column, the rows and pitches filled in where None (one row, no pitch)."""
        if self.rows is not None:
            return self.dst, self.src, self.nbytes, self.rows, self.dst_pitch, self.src_pitch
        zero = torch.zeros_like(self.nbytes)
        return self.dst, self.src, self.nbytes, torch.ones_like(self.nbytes), zero, zero

    def head(self, n: int) -> ByteRuns:
        """The first ``n`` runs."""
        return ByteRuns(*(c[:n] for c in self.columns()))

    def total(self) -> int:
        """Bytes the runs copy."""
        return int(self.nbytes.sum()) if self.rows is None else int((self.nbytes * self.rows).sum())

    def __len__(self) -> int:
        return self.dst.numel()


def plan_runs(copies: Sequence[tuple[int, int, int]] | ByteRuns,
              tile_bytes: int = TILE_BYTES) -> tuple[torch.Tensor, int]:
    """The run table of ``copies`` (:class:`ByteRuns`, or (destination address, source
    address, bytes) triples), each row, address and pitch a multiple of ``VECTOR``: one
    int64 row (source, destination, 16-byte words per row, first tile, rows, source
    pitch, destination pitch) per run, and the number of tiles of ``tile_bytes`` (each
    row its own tiles). Pure; vectorized, O(runs): a strided copy is one run."""
    if tile_bytes % VECTOR:
        raise ValueError(f"tile of {tile_bytes} bytes is not a multiple of {VECTOR}")
    runs = copies if isinstance(copies, ByteRuns) else ByteRuns.of(copies)
    dst, src, n, rows, dp, sp = runs.columns()
    bad = ((n <= 0) | (rows <= 0) | ((dst | src | n | dp | sp) % VECTOR != 0)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"copy {int(src[i]):#x} -> {int(dst[i]):#x} of {int(rows[i])} x {int(n[i])} bytes "
                         f"(pitches {int(sp[i])} -> {int(dp[i])}) is not {VECTOR}-byte aligned")
    tiles = (n + tile_bytes - 1) // tile_bytes * rows
    first = torch.cumsum(tiles, 0) - tiles
    return torch.stack([src, dst, n // VECTOR, first, rows, sp, dp], dim=1), int(tiles.sum())


def plan_owners(copies: Sequence[tuple[int, int, int]] | ByteRuns,
                tile_bytes: int = TILE_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`plan_runs`' run table of ``copies`` and each tile's run index (int32, one
    per tile, runs in order): what one launch of ``copy_tiles`` reads. Pure, on the CPU:
    the reference for the index :meth:`CopyKernel.tiles` builds on the device."""
    runs, total = plan_runs(copies, tile_bytes)
    counts = torch.diff(runs[:, 3], append=torch.tensor([total], dtype=torch.int64))
    return runs, torch.repeat_interleave(torch.arange(len(runs), dtype=torch.int32), counts)


def plan_tiles(copies: Sequence[tuple[int, int, int]] | ByteRuns, tile_bytes: int = TILE_BYTES) -> torch.Tensor:
    """What each tile of ``copies`` (as for :func:`plan_runs`) copies: one int64 row
    (source, destination, 16-byte words) per tile of ``tile_bytes``, each run's rows in
    order and each row's tiles in order, its last one the remainder. Pure, on the CPU:
    the reference for the addresses ``copy_tiles`` computes from a tile's run."""
    runs, total = plan_runs(copies, tile_bytes)
    if not total:
        return torch.zeros((0, 3), dtype=torch.int64)
    src, dst, words, first, rows, sp, dp = runs.unbind(1)
    per_row = (words * VECTOR + tile_bytes - 1) // tile_bytes
    owner = torch.repeat_interleave(torch.arange(len(runs)), per_row * rows)  # apart from plan_owners'
    k = torch.arange(total) - first[owner]
    row = k // per_row[owner]
    start = (k - row * per_row[owner]) * (tile_bytes // VECTOR)  # vectors into its row
    return torch.stack([src[owner] + row * sp[owner] + VECTOR * start, dst[owner] + row * dp[owner] + VECTOR * start,
                        torch.clamp(words[owner] - start, max=tile_bytes // VECTOR)], dim=1)


#: blocks one launch may have (the grid's x limit): tiles of one batch, 8 TB at 4 KB
MAX_TILES = (1 << 31) - 1


@dataclass(frozen=True)
class TileTable:
    """What one launch copies, on the device: ``runs`` (:func:`plan_runs`' rows) and
    ``owner``, each tile's run (int32): 4 bytes per tile of 4 KB and 56 per run."""

    runs: torch.Tensor
    owner: torch.Tensor

    @property
    def tiles(self) -> int:
        return self.owner.numel()


@dataclass(frozen=True)
class CopyKernel:
    """A loaded ``copy_tiles`` for one device: ``threads`` per block, ``unroll`` vectors
    per thread, so a tile is ``tile_bytes``."""

    function: int  # CUfunction of copy_tiles
    expand: int  # CUfunction of expand_tiles
    module: int  # CUmodule, kept loaded for the process's life
    threads: int
    unroll: int
    compile_s: float  # compiling (or reading the cached image) and loading it
    cached: bool = False  # the image came from ``execute.kernels.image_cache``

    @property
    def tile_bytes(self) -> int:
        return self.threads * self.unroll * VECTOR

    def tiles(self, copies: Sequence[tuple[int, int, int]] | ByteRuns, device: torch.device) -> TileTable:
        """:func:`plan_owners`' run table and tile index of ``copies``, the index built
        on ``device`` from the run table (on the current stream; no wait): the host
        plans and uploads one row per run, not one per tile (a qwen3-shaped preset's
        11 GB are 2.7 million tiles)."""
        runs, total = plan_runs(copies, self.tile_bytes)
        if total > MAX_TILES:
            raise ValueError(f"{total} tiles of {self.tile_bytes} bytes in one batch: more than one launch "
                             f"takes ({MAX_TILES})")
        runs = runs.to(device)
        owner = torch.empty(total, dtype=torch.int32, device=device)
        if total:
            _call(self.expand, -(-total // 256), 256, torch.cuda.current_stream(device),
                  ctypes.c_uint64(runs.data_ptr()), ctypes.c_int(len(runs)), ctypes.c_int64(total),
                  ctypes.c_uint64(owner.data_ptr()))
        return TileTable(runs, owner)

    def launch(self, table: TileTable, stream: torch.cuda.Stream) -> None:
        """Queue the copies of ``table`` on ``stream``, one block per tile. Capturable."""
        _call(self.function, table.tiles, self.threads, stream, ctypes.c_uint64(table.runs.data_ptr()),
              ctypes.c_uint64(table.owner.data_ptr()))


def _call(function: int, blocks: int, threads: int, stream: torch.cuda.Stream, *args) -> None:
    params = (ctypes.c_void_p * len(args))(*(ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args))
    # the function belongs to the module loaded in its device's primary context: make that
    # context current (a process may hold models on a device other than its current one)
    with torch.cuda.device(stream.device):
        rc = _launch()(ctypes.c_void_p(function), blocks, 1, 1, threads, 1, 1, 0,
                       ctypes.c_void_p(stream.cuda_stream), params, None)
    if rc:
        raise RuntimeError(f"cuLaunchKernel of the batched copy failed (CUresult {rc})")


def copy_kernel(device: torch.device, threads: int = THREADS, unroll: int = UNROLL) -> CopyKernel | None:
    """The kernel compiled and loaded for ``device`` (once per process and device), or
    None where it cannot be (no NVRTC, a driver or architecture it does not know)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _compiled(index, threads, unroll)


@functools.cache
def _compiled(index: int, threads: int, unroll: int) -> CopyKernel | None:
    t0 = time.perf_counter()
    major, minor = torch.cuda.get_device_capability(index)
    arch, defines = f"sm_{major}{minor}", (f"-DTHREADS={threads}", f"-DUNROLL={unroll}")
    key = "\n".join([SOURCE, arch, *defines, torch.version.cuda or ""])
    try:
        image, hit = image_cache.cached("copy_tiles", key, lambda: _nvrtc_cubin(SOURCE, arch, defines))
        with torch.cuda.device(index):
            torch.cuda.current_stream(index)  # the device's primary context is current
            try:
                module = _load(image)
            except RuntimeError:
                if not hit:
                    raise
                image_cache.forget("copy_tiles", key)  # a cached image the driver refuses: compile
                image, hit = _nvrtc_cubin(SOURCE, arch, defines), False
                module = _load(image)
            copy, expand = (_function(module, name) for name in (b"copy_tiles", b"expand_tiles"))
    except (RuntimeError, OSError):
        return None
    return CopyKernel(copy, expand, module.value, threads, unroll, time.perf_counter() - t0, hit)


def _load(image: bytes) -> ctypes.c_void_p:
    module = ctypes.c_void_p()
    load = driver_function("cuModuleLoadData", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p])
    rc = load(ctypes.byref(module), image)
    if rc:
        raise RuntimeError(f"cuModuleLoadData failed (CUresult {rc})")
    return module


def _function(module: ctypes.c_void_p, name: bytes) -> int:
    get = driver_function("cuModuleGetFunction", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p])
    function = ctypes.c_void_p()
    rc = get(ctypes.byref(function), module, name)
    if rc:
        raise RuntimeError(f"cuModuleGetFunction({name.decode()}) failed (CUresult {rc})")
    return function.value


@functools.cache
def _launch():
    return driver_function("cuLaunchKernel", [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p])


def _nvrtc_cubin(source: str, arch: str, defines: tuple[str, ...]) -> bytes:
    """``source`` compiled by NVRTC to machine code for ``arch`` (e.g. sm_90)."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"copy_tiles.cu", 0, None, None))
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"-default-device", *(d.encode() for d in defines)]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if rc:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile the batched copy for {arch}: {log.value.decode()}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        image = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, image))
        return image.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _check(lib: ctypes.CDLL, rc: int) -> None:
    if rc:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NVRTC: {lib.nvrtcGetErrorString(rc).decode()}")


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    """NVRTC of the CUDA torch was built with (torch's wheels depend on it and load it)."""
    major = (torch.version.cuda or "").split(".")[0]
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"] if major else ["libnvrtc.so"]
    override = settings.current().nvrtc  # environment: TORCHREFIT_NVRTC
    # torch's CUDA wheels keep it in site-packages/nvidia/.../lib, found by its soname once
    # torch loaded it, else by path
    wheels = sorted(p for d in sys.path for p in glob.glob(os.path.join(d, "nvidia", "*", "lib", "libnvrtc.so.*"))
                    if "builtins" not in p)
    for name in ([override] if override else []) + names + wheels:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError(f"no NVRTC library found (tried {', '.join(names)})")
