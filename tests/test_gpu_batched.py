"""Batched copies (``execute.batched``, ``execute.kernels.copy_runs``) on a real GPU, in this process.

What the CPU suite cannot reach: the CUDA kernel (compiled by NVRTC, launched through
the driver) on device memory, launched eagerly and captured in the program's CUDA
graph, moving copies spread over several allocations (runs merged across tensors by
``execute.runs`` included, sizes below, at and past a 4 KB tile, and one of 16 MB),
next to copies that must stay per-copy (casts, strided views, misaligned views).
Every destination is compared with an oracle made by plain per-tensor copies; a
replay after the sources changed copies the new values; the tile index the device
builds equals the CPU planner's; the default rule
batches a MoE-shaped program's copies and not a dense one's; and large strided copies
(TP halves into and out of full weights) batch row by row in any program.
"""

from __future__ import annotations

import random

import pytest
import torch

from torchrefit import settings
from torchrefit.execute.batched import byte_runs, kernel_available
from torchrefit.execute.kernels.copy_runs import ByteRuns, plan_owners
from torchrefit.execute.local import LANES, Copy, compile_copies
from torchrefit.execute.streams import SideStreams

pytestmark = pytest.mark.gpu


def _copies(rng: random.Random) -> list[Copy]:
    dev = torch.device("cuda")
    out = []
    for i in range(300):  # back to back in shared allocator segments, some with gaps
        n = rng.choice([8, 1024, 4096 * 3, 1 << 20, (3 << 20) + 8, rng.randrange(8, 1 << 16, 8)])
        s, d = torch.randn(n, device=dev).to(torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16, device=dev)
        if rng.random() < 0.2:
            torch.empty(rng.choice([8, 24, 512]), dtype=torch.bfloat16, device=dev)  # a gap on one side
        out.append(Copy(d, s, f"t{i}"))
    a, b = torch.randn(4096, device=dev), torch.zeros(4096, dtype=torch.bfloat16, device=dev)
    out.append(Copy(b, a, "cast"))  # fp32 -> bf16
    m, w = torch.randn(256, 256, device=dev), torch.zeros(256, 128, device=dev)
    out.append(Copy(w, m[:, :128], "strided"))
    u, v = torch.randn(4099, device=dev), torch.zeros(4099, device=dev)
    out.append(Copy(v[1:], u[1:], "misaligned"))
    big = (8 << 20) + 4096
    out.append(Copy(torch.zeros(big, dtype=torch.bfloat16, device=dev),
                    torch.randn(big, device=dev).to(torch.bfloat16), "large"))
    return out


def _exact(copies: list[Copy]) -> bool:
    return all(torch.equal(c.dst, c.src.to(c.dst.dtype)) for c in copies)


@pytest.mark.parametrize("graph", [False, True])
def test_batched_copies_exact(graph: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    settings.configure(batched_copy="all")  # every batchable copy
    if not kernel_available(torch.device("cuda")):
        pytest.skip("the batched copy kernel could not be built here (NVRTC)")
    copies = _copies(random.Random(int(graph)))
    side = SideStreams(torch.device("cuda"), LANES)
    local = compile_copies(copies, side, cuda_graph=graph)
    assert local.batch is not None and local.batch.tiles > len(local.batch.dst)
    # the tile index built on the device is the pure planner's, tile for tile
    runs, owner = plan_owners([(d.data_ptr(), s.data_ptr(), d.nbytes) for d, s in zip(local.batch.dst, local.batch.src)],
                              local.batch.kernel.tile_bytes)
    assert torch.equal(local.batch.table.runs.cpu(), runs) and torch.equal(local.batch.table.owner.cpu(), owner)
    per_copy = {n for _, _, n in local.big} | {n for g in local.small for n in g.names}
    assert {"cast", "strided", "misaligned"} <= per_copy and "large" not in per_copy
    assert (local.graph is not None) == graph
    assert not _exact(copies)
    local.run_on_caller(side)
    torch.cuda.synchronize()
    assert _exact(copies), [c.name for c in copies if not torch.equal(c.dst, c.src.to(c.dst.dtype))][:5]
    with torch.no_grad():
        for c in copies:
            c.src.add_(1.0)
    local.run_on_caller(side)  # the replay reads the new values
    torch.cuda.synchronize()
    assert _exact(copies)


def test_default_batches_moe_shaped_programs_only(monkeypatch: pytest.MonkeyPatch) -> None:
    settings.configure(batched_copy="auto")
    if not kernel_available(torch.device("cuda")):
        pytest.skip("the batched copy kernel could not be built here (NVRTC)")
    dev = torch.device("cuda")
    side = SideStreams(dev, LANES)

    def pairs(n: int, elems: int) -> list[Copy]:
        return [Copy(torch.zeros(elems, dtype=torch.bfloat16, device=dev),
                     torch.randn(elems, device=dev).to(torch.bfloat16), f"e{i}") for i in range(n)]

    moe = pairs(300, 3 << 19)  # 300 experts of 3 MiB
    local = compile_copies(moe, side, cuda_graph=True)
    assert local.batch is not None and not local.big
    local.run_on_caller(side)
    torch.cuda.synchronize()
    assert _exact(moe)
    dense = pairs(4, 32 << 20)  # four 64 MiB copies: memcpy nodes
    assert compile_copies(dense, side, cuda_graph=True).batch is None


@pytest.mark.parametrize("graph", [False, True])
def test_strided_copies_batch_by_default(graph: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dense model's program (a few large copies, not batched as a MoE's) still batches
    its large strided copies, row by row: TP halves into and out of full weights, both
    sides strided, rows of 2, 4 and 6 KB and 16 KB; short rows stay per copy."""
    settings.configure(batched_copy="auto")
    if not kernel_available(torch.device("cuda")):
        pytest.skip("the batched copy kernel could not be built here (NVRTC)")
    dev = torch.device("cuda")
    side = SideStreams(dev, LANES)
    bf = torch.bfloat16

    def rand(*shape: int, dtype: torch.dtype = bf) -> torch.Tensor:
        return torch.randn(*shape, device=dev).to(dtype)

    full = [torch.zeros(1024, 2 * c, dtype=bf, device=dev) for c in (1024, 2048, 3072, 8192)]
    copies = [Copy(f[:, f.shape[1] // 2:], rand(1024, f.shape[1] // 2), f"into{i}") for i, f in enumerate(full)]
    whole = rand(2048, 4096)
    copies.append(Copy(torch.zeros(2048, 2048, dtype=bf, device=dev), whole[:, 2048:], "out of"))
    wide = torch.zeros(512, 6144, dtype=torch.float32, device=dev)
    copies.append(Copy(wide[:, 1024:3072], rand(512, 4096, dtype=torch.float32)[:, 2048:], "both"))
    short = torch.zeros(4096, 512, dtype=bf, device=dev)
    copies.append(Copy(short[:, :256], rand(4096, 256), "short rows"))  # 512 B rows, 2 MiB
    copies.append(Copy(torch.zeros(32 << 20, dtype=bf, device=dev), rand(32 << 20), "dense"))
    local = compile_copies(copies, side, cuda_graph=graph)
    assert local.batch is not None
    assert set(local.batch.names) == {"into0", "into1", "into2", "into3", "out of", "both"}
    assert {c.name for c in local.big} == {"short rows", "dense"}
    runs = ByteRuns.cat([byte_runs(d, s) for d, s in zip(local.batch.dst, local.batch.src)])
    # pitched runs: each 2-D strided copy is one run, its rows the kernel's to tile
    assert local.batch.runs == len(runs) == 6
    assert int(runs.rows.sum()) == 4 * 1024 + 2048 + 512
    want = plan_owners(runs, local.batch.kernel.tile_bytes)
    assert torch.equal(local.batch.table.runs.cpu(), want[0]) and torch.equal(local.batch.table.owner.cpu(), want[1])
    assert not _exact(copies)
    local.run_on_caller(side)
    torch.cuda.synchronize()
    assert _exact(copies), [c.name for c in copies if not torch.equal(c.dst, c.src.to(c.dst.dtype))]
    assert int(full[0][:, :1024].abs().sum()) == 0  # the other halves untouched
    with torch.no_grad():
        for c in copies:
            c.src.add_(1.0)
    local.run_on_caller(side)
    torch.cuda.synchronize()
    assert _exact(copies)
