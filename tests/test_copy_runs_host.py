"""The batched copy's two CUDA kernels (``execute.kernels.copy_runs.SOURCE``), their own source text
compiled for the host with a C++ compiler, one host thread playing every (block,
thread) in turn: ``expand_tiles`` must build :func:`plan_owners`' tile index, and
``copy_tiles`` must move, over a host buffer, exactly the bytes of each copy (dense and
rows at pitches, a last partial tile, one-vector rows) and nothing else, checked against
the copies made by slicing. The CUDA side checked on a machine without a GPU
(``tests/test_gpu_batched.py`` runs it on one). Skipped where no C++ compiler is
installed."""

from __future__ import annotations

import ctypes
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from torchrefit.execute.kernels.copy_runs import (
    SOURCE,
    THREADS,
    UNROLL,
    VECTOR,
    ByteRuns,
    plan_owners,
    plan_runs,
    plan_tiles,
)

CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler (g++, c++ or clang++)")
TILE = THREADS * UNROLL * VECTOR

# what CUDA gives a kernel, for one host thread that plays every (block, thread) in turn
HARNESS = r"""
struct Dim { unsigned int x; };
struct uint4 { unsigned int x, y, z, w; };
static Dim blockIdx, blockDim, threadIdx;
#define __global__
#define __restrict__ __restrict
#define __launch_bounds__(n)
#define __ldg(p) (*(p))
%s
extern "C" void expand_all(const long long* runs, int count, long long tiles, int* owner) {
    blockDim.x = 256;
    for (long long t = 0; t < tiles + 300; t++) {  // past the end too: those threads return
        blockIdx.x = (unsigned int)(t / 256);
        threadIdx.x = (unsigned int)(t %% 256);
        expand_tiles(runs, count, tiles, owner);
    }
}
extern "C" void copy_all(const long long* runs, const int* owner, long long tiles) {
    blockDim.x = THREADS;
    for (long long b = 0; b < tiles; b++) {
        blockIdx.x = (unsigned int)b;
        for (unsigned int t = 0; t < THREADS; t++) {
            threadIdx.x = t;
            copy_tiles(runs, owner);
        }
    }
}
"""


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    d = tmp_path_factory.mktemp("copy_kernel")
    src, lib = Path(d, "kernels.cpp"), Path(d, "kernels.so")
    src.write_text(HARNESS % SOURCE)
    subprocess.run([CXX, "-O1", "-shared", "-fPIC", f"-DTHREADS={THREADS}", f"-DUNROLL={UNROLL}",
                    "-o", str(lib), str(src)], check=True, capture_output=True, timeout=120)
    return ctypes.CDLL(str(lib))


def _random_runs(rng: random.Random, count: int = 40) -> ByteRuns:
    cols = []
    for _ in range(count):
        rows = rng.choice([1, 1, rng.randrange(2, 50)])
        dp, sp = (16 * rng.randrange(0, 3 * TILE // 16) if rows > 1 else 0 for _ in range(2))
        n = 16 * rng.choice([1, TILE // 16, TILE // 16 + 1, rng.randrange(1, 5 * TILE // 16)])
        cols.append((rng.randrange(0, 1 << 40, 16), rng.randrange(0, 1 << 40, 16), n, rows, dp, sp))
    return ByteRuns(*(torch.tensor(c, dtype=torch.int64) for c in zip(*cols)))


def _device_owner(kernels: ctypes.CDLL, runs: ByteRuns) -> torch.Tensor:
    table, total = plan_runs(runs, TILE)
    table = table.contiguous()
    out = torch.full((total + 300,), -1, dtype=torch.int32)  # entries past the end stay untouched
    kernels.expand_all(ctypes.c_void_p(table.data_ptr()), ctypes.c_int(len(table)), ctypes.c_longlong(total),
                       ctypes.c_void_p(out.data_ptr()))
    assert bool((out[total:] == -1).all())
    return out[:total]


@pytest.mark.parametrize("seed", range(4))
def test_expand_tiles_builds_plan_owners_index(kernels: ctypes.CDLL, seed: int) -> None:
    runs = _random_runs(random.Random(seed))
    assert torch.equal(_device_owner(kernels, runs), plan_owners(runs, TILE)[1])
    plain = ByteRuns(runs.dst, runs.src, runs.nbytes)  # one row each: the dense copies
    assert torch.equal(_device_owner(kernels, plain), plan_owners(plain, TILE)[1])


def test_plan_owners_names_each_tiles_run() -> None:
    """Independent of the kernels: a tile's run, from :func:`plan_tiles`' addresses."""
    runs = _random_runs(random.Random(7))
    table, owner = plan_owners(runs, TILE)
    tiles = plan_tiles(runs, TILE)
    assert len(owner) == len(tiles) and owner.dtype == torch.int32
    o = owner.long()
    # each tile starts inside its run's rows: at or past the run's first byte, within
    # its last row's reach
    src, rows, sp, n = table[o, 0], table[o, 4], table[o, 5], table[o, 2] * VECTOR
    assert bool((tiles[:, 0] >= src).all()) and bool((tiles[:, 0] < src + (rows - 1) * sp + n).all())
    assert torch.equal(torch.bincount(o, minlength=len(table)), -(-table[:, 2] * VECTOR // TILE) * table[:, 4])


def _copies(rng: random.Random, words: int) -> list[tuple[int, int, int, int, int, int]]:
    """(dst, src, row bytes, rows, dst pitch, src pitch) byte offsets into one buffer of
    ``words`` int32 words: sources in the first half, destinations after them in the
    second, no destination byte written twice."""
    out, s, d = [], 0, 4 * words // 2
    for _ in range(30):
        n = 16 * rng.choice([1, TILE // 16, TILE // 16 + 1, rng.randrange(1, 3 * TILE // 16)])
        rows = rng.choice([1, 1, rng.randrange(2, 6)])
        dp = n + 16 * rng.randrange(0, 4) if rows > 1 else 0
        sp = n + 16 * rng.randrange(0, 4) if rows > 1 else 0
        out.append((d, s, n, rows, dp, sp))
        s += (rows - 1) * sp + n + 16 * rng.randrange(0, 3)
        d += (rows - 1) * dp + n + 16 * rng.randrange(1, 3)
    assert s < 4 * words // 2 and d < 4 * words
    return out


@pytest.mark.parametrize("seed", range(3))
def test_copy_tiles_moves_exactly_the_copies(kernels: ctypes.CDLL, seed: int) -> None:
    rng = random.Random(seed)
    words = 1 << 20
    buf = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32)
    base = buf.data_ptr()
    copies = _copies(rng, words)
    want = buf.clone().view(torch.uint8)  # the oracle: every row copied by slicing
    for d, s, n, rows, dp, sp in copies:
        for r in range(rows):
            want[d + r * dp: d + r * dp + n] = want[s + r * sp: s + r * sp + n].clone()
    runs = ByteRuns(*(torch.tensor(c, dtype=torch.int64) for c in zip(*[
        (base + d, base + s, n, rows, dp, sp) for d, s, n, rows, dp, sp in copies])))
    table, owner = plan_owners(runs, TILE)
    table, owner = table.contiguous(), owner.contiguous()
    kernels.copy_all(ctypes.c_void_p(table.data_ptr()), ctypes.c_void_p(owner.data_ptr()),
                     ctypes.c_longlong(len(owner)))
    assert torch.equal(buf.view(torch.uint8), want)
