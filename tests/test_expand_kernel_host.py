"""The device's tile-table builder (``copy_kernel.SOURCE``'s ``expand_tiles``), its own
source text compiled for the host with a C++ compiler and run once per tile, against
:func:`plan_tiles`, the pure reference: the CUDA side of the run table checked on a
machine without a GPU (``tests/test_gpu_batched.py`` checks it on one). Skipped where no
C++ compiler is installed."""

from __future__ import annotations

import ctypes
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from torchrefit.execute.copy_kernel import (
    SOURCE,
    THREADS,
    UNROLL,
    VECTOR,
    ByteRuns,
    plan_runs,
    plan_tiles,
)

CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler (g++, c++ or clang++)")

# what CUDA gives a kernel, for one host thread that plays every (block, thread) in turn
HARNESS = r"""
struct Dim { unsigned int x; };
static Dim blockIdx, blockDim, threadIdx;
#define __global__
#define __restrict__ __restrict
%s
extern "C" void expand_all(const long long* runs, int count, long long tiles, long long* table) {
    blockDim.x = 256;
    for (long long t = 0; t < tiles + 300; t++) {  // past the end too: those threads return
        blockIdx.x = (unsigned int)(t / 256);
        threadIdx.x = (unsigned int)(t %% 256);
        expand_tiles(runs, count, tiles, table);
    }
}
"""


@pytest.fixture(scope="module")
def expand_all(tmp_path_factory: pytest.TempPathFactory):
    kernel = SOURCE[SOURCE.index('extern "C" __global__ void expand_tiles'):]
    d = tmp_path_factory.mktemp("expand")
    src, lib = Path(d, "expand.cpp"), Path(d, "expand.so")
    src.write_text(HARNESS % kernel)
    subprocess.run([CXX, "-O1", "-shared", "-fPIC", f"-DTHREADS={THREADS}", f"-DUNROLL={UNROLL}",
                    "-o", str(lib), str(src)], check=True, capture_output=True, timeout=120)
    return ctypes.CDLL(str(lib)).expand_all


def _device_table(expand_all, runs: ByteRuns) -> torch.Tensor:
    table, total = plan_runs(runs, THREADS * UNROLL * VECTOR)
    table = table.contiguous()
    out = torch.full((total + 300, 3), -1, dtype=torch.int64)  # rows past the end stay untouched
    expand_all(ctypes.c_void_p(table.data_ptr()), ctypes.c_int(len(table)), ctypes.c_longlong(total),
               ctypes.c_void_p(out.data_ptr()))
    assert bool((out[total:] == -1).all())
    return out[:total]


@pytest.mark.parametrize("seed", range(4))
def test_expand_tiles_builds_plan_tiles_table(expand_all, seed: int) -> None:
    rng = random.Random(seed)
    tile = THREADS * UNROLL * VECTOR
    cols = []
    for _ in range(40):
        rows = rng.choice([1, 1, rng.randrange(2, 50)])
        dp, sp = (16 * rng.randrange(0, 3 * tile // 16) if rows > 1 else 0 for _ in range(2))
        n = 16 * rng.choice([1, tile // 16, tile // 16 + 1, rng.randrange(1, 5 * tile // 16)])
        cols.append((rng.randrange(0, 1 << 40, 16), rng.randrange(0, 1 << 40, 16), n, rows, dp, sp))
    runs = ByteRuns(*(torch.tensor(c, dtype=torch.int64) for c in zip(*cols)))
    assert torch.equal(_device_table(expand_all, runs), plan_tiles(runs, tile))
    plain = ByteRuns.of([(d, s, n) for d, s, n, *_ in cols])  # one row each: the dense copies
    assert torch.equal(_device_table(expand_all, plain), plan_tiles(plain, tile))
