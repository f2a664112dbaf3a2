"""Batched copies (``execute.batched``, ``execute.kernels.copy_runs``), on CPU.

Covers the pure tiling (``plan_tiles``: applied row by row to a byte buffer it moves
exactly what the copies would, every copy cut into tiles no larger than the tile, its
last remainder included; misaligned copies are refused), the rule for which copies
qualify (``batchable``: same dtype, dense, 16-byte aligned) and when a program batches
(``batch_from``: ``settings.batched_copy`` auto / all / none, auto only for programs of many
mid-sized copies, a bad value warned about), strided copies cut into rows
(``strided_runs``: the tiles of its runs, applied to the bytes, do what ``copy_`` does;
short, misaligned, transposed and overlapping rows refused), and that CPU tensors never
batch. The CUDA
kernel itself runs in ``tests/test_gpu_batched.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

from torchrefit import settings
from torchrefit.execute import batched
from torchrefit.execute.batched import (
    ALIGN,
    MIN_RUN_BYTES,
    batch_from,
    batchable,
    plan_tiles,
    strided_runs,
)
from torchrefit.execute.kernels import elementwise_copies
from torchrefit.execute.kernels.copy_runs import ByteRuns, TileTable, plan_owners

WORD = 4  # the buffers below are int32


def _layout(rng: random.Random, count: int, words: int) -> list[tuple[int, int, int]]:
    """Non-overlapping (dst, src, nbytes) word-aligned triples inside one buffer of
    ``words`` int32 words: sources in the first half, destinations in the second."""
    out, s, d = [], 0, words // 2
    for _ in range(count):
        n = rng.choice([4, 8, 12, rng.randrange(4, 400, 4)])  # words: multiples of 16 bytes
        s += rng.choice([0, 4, 8])
        d += rng.choice([0, 4, 12])
        out.append((d * WORD, s * WORD, n * WORD))
        s, d = s + n, d + n
    assert s < words // 2 and d < words
    return out


def _apply(table: torch.Tensor, buf: torch.Tensor, base: int) -> None:
    """The kernel's semantics, row by row: copy ``words`` 16-byte vectors from the source
    address to the destination address (addresses of ``buf``'s bytes from ``base``)."""
    for src, dst, n in table.tolist():
        s, d, k = (src - base) // WORD, (dst - base) // WORD, n * ALIGN // WORD
        buf[d: d + k] = buf[s: s + k].clone()


@pytest.mark.parametrize("tile", [16, 64, 256, 4096])
@pytest.mark.parametrize("seed", range(4))
def test_tiles_move_exactly_the_copies(tile: int, seed: int) -> None:
    rng = random.Random(seed)
    words = 40000
    base = rng.choice([0, 1 << 20, 0x7F0000000000])  # where the buffer lives: addresses, not offsets
    copies = [(base + d, base + s, n) for d, s, n in _layout(rng, 60, words)]
    table = plan_tiles(copies, tile_bytes=tile)
    buf = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32)
    want = buf.clone()
    for d, s, n in copies:  # the oracle: each copy directly
        want[(d - base) // WORD: (d - base + n) // WORD] = buf[(s - base) // WORD: (s - base + n) // WORD]
    _apply(table, buf, base)
    assert torch.equal(buf, want)
    # every tile within the tile size, and each copy's tiles sum to its size, last one too
    assert int(table[:, 2].max()) <= tile // ALIGN and int(table[:, 2].min()) > 0
    assert int(table[:, 2].sum()) * ALIGN == sum(n for _, _, n in copies)
    assert len(table) == sum(-(-n // tile) for _, _, n in copies)


def test_misaligned_copies_are_refused() -> None:
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        plan_tiles([(0, 8, 16)])
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        plan_tiles([(0, 16, 20)])
    with pytest.raises(ValueError, match="not a multiple"):
        plan_tiles([(0, 16, 16)], tile_bytes=24)
    assert plan_tiles([]).shape == (0, 3)


def test_which_copies_are_batchable() -> None:
    buf = torch.zeros(4096, dtype=torch.bfloat16)
    other = torch.zeros(4096, dtype=torch.bfloat16)
    assert batchable(buf[:1024], other[1024:2048])
    assert not batchable(buf[:1024], other[:1024].float())  # a cast
    assert not batchable(buf[:1024], other[1:1025])  # source 2 bytes off alignment
    assert not batchable(buf[:1001], other[:1001])  # 2002 bytes: not a multiple of 16
    assert not batchable(buf.view(64, 64)[:, :32], other.view(64, 64)[:, :32])  # strided
    assert not batchable(buf[:0], other[:0])
    big = 64 << 20  # no size bound: a large plain copy batches as well as a small one
    assert batchable(torch.empty(big, dtype=torch.bfloat16), torch.empty(big, dtype=torch.bfloat16))


def test_when_a_program_batches() -> None:
    MB = 1 << 20
    moe = [3 * MB] * 300  # many mid-sized copies: the MoE case
    dense = [100 * MB] * 300  # large ones: memcpy nodes are at the floor
    assert batch_from(moe, MB) == MB and batch_from(dense, MB) is None and batch_from(moe[:10], MB) is None
    least = batched.BATCH_MIN_COPIES  # fewer than per-copy kernels ask for (a 0.5 B dense model's 97)
    assert least < elementwise_copies.KERNEL_MIN_COPIES
    assert batch_from(moe[:least], MB) == MB and batch_from(moe[:least - 1], MB) is None
    settings.configure(batched_copy="all")
    assert batch_from(dense, MB) == 0 and batch_from([], MB) == 0
    settings.configure(batched_copy="none")
    assert batch_from(moe, MB) is None
    with pytest.raises(ValueError, match="batched_copy must be one of auto, all, none, not '1'"):
        settings.configure(batched_copy="1")
    assert batch_from(moe, MB) is None


def test_cpu_tensors_never_batch() -> None:
    assert not batched.kernel_available(torch.device("cpu"))


def _views(buf: torch.Tensor, dtype: torch.dtype, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A dense ``shape`` of ``dtype`` at byte ``offset`` of the byte buffer ``buf``."""
    n = torch.Size(shape).numel() * dtype.itemsize
    return buf[offset: offset + n].view(dtype).view(shape)


#: (name, make(buffer) -> (dst, src)) over one 1 MiB byte buffer: each a copy a layout
#: change makes (a TP half into or out of a full weight, an expert stack's column block)
STRIDED = {
    "into the second half": lambda b: (_views(b, torch.bfloat16, 0, (64, 2048))[:, 1024:],
                                       _views(b, torch.bfloat16, 1 << 19, (64, 1024))),
    "out of the first half": lambda b: (_views(b, torch.bfloat16, 0, (64, 1024)),
                                        _views(b, torch.bfloat16, 1 << 19, (64, 2048))[:, :1024]),
    "both strided, float32": lambda b: (_views(b, torch.float32, 0, (32, 3072))[:, 1024:2048],
                                        _views(b, torch.float32, 1 << 19, (32, 2048))[:, 512:1536]),
    "3-d expert block, unit dim": lambda b: (_views(b, torch.bfloat16, 16, (4, 1, 16, 2048))[..., :1536],
                                             _views(b, torch.bfloat16, 1 << 19, (4, 1, 16, 1536))),
    "rows of a row block": lambda b: (_views(b, torch.int8, 0, (8, 32, 2048))[:, 8:24],
                                      _views(b, torch.int8, 1 << 19, (8, 16, 2048))),
}


#: runs per case: one per index of the outer dims but the last (whose rows a pitch steps)
RUNS = {"into the second half": 1, "out of the first half": 1, "both strided, float32": 1,
        "3-d expert block, unit dim": 4, "rows of a row block": 1}


@pytest.mark.parametrize("case", sorted(STRIDED))
def test_strided_runs_copy_what_copy_does(case: str) -> None:
    torch.manual_seed(0)
    buf = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    dst, src = STRIDED[case](buf)
    want = buf.clone()
    dst_w, src_w = STRIDED[case](want)
    dst_w.copy_(src_w)  # the oracle: torch's own strided copy
    runs = strided_runs(dst, src)
    assert runs is not None and len(runs) == RUNS[case] and int(runs.rows.min()) > 1
    assert runs.total() == dst.nbytes and int(runs.nbytes.min()) >= MIN_RUN_BYTES
    words = buf.view(torch.int32)
    _apply(plan_tiles(runs), words, buf.data_ptr())
    assert torch.equal(buf, want)


def test_strided_runs_refused() -> None:
    b = torch.zeros(1 << 20, dtype=torch.uint8)
    full, half = _views(b, torch.bfloat16, 0, (64, 2048)), _views(b, torch.bfloat16, 1 << 19, (64, 1024))
    assert strided_runs(full[:, 1024:], half) is not None
    assert strided_runs(full[:, :512], half[:, :512]) is None  # 1 KB rows: below MIN_RUN_BYTES
    assert strided_runs(full[:, 4:1028], half) is None  # rows 8 bytes off alignment
    odd = _views(b, torch.bfloat16, 0, (64, 2052))  # rows 4104 bytes apart: every second one off
    assert strided_runs(odd[:, :1024], half) is None and strided_runs(half, odd[:, 4:1028]) is None
    assert strided_runs(full[:, 1024:], half.float()) is None  # a cast
    assert strided_runs(full[:32, :1024].t(), half[:32, :1024].t()) is None  # no row dense on both
    assert strided_runs(full[:, :1024], full[:, 1024:].contiguous()) is not None
    over = full[0, :1024].expand(64, 1024)  # every row the same memory
    assert strided_runs(over, half) is None
    assert strided_runs(half, over) is not None  # a broadcast source is read, never written
    dense = _views(b, torch.bfloat16, 1 << 18, (64, 1024))
    assert strided_runs(dense, half) is None  # dense: one run, batchable()'s case


def test_compile_batch_takes_the_runs_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile_batch`` plans the runs a caller already cut (``compile_copies`` cuts a
    strided copy's rows once, to decide) and cuts the others itself: the table is the
    tiles of both, in copy order (a CPU stand-in for the kernel's index builder)."""
    class Fake:
        tile_bytes = 4096

        def tiles(self, runs, device):
            return TileTable(*plan_owners(runs, self.tile_bytes))

    monkeypatch.setattr(batched, "copy_kernel", lambda device: Fake())
    b = torch.zeros(1 << 20, dtype=torch.uint8)
    strided = STRIDED["3-d expert block, unit dim"](b)  # 4 runs: the first alone is less
    dense = (_views(b, torch.bfloat16, 3 << 18, (4096,)), _views(b, torch.bfloat16, 7 << 17, (4096,)))
    copies = [(*dense, "dense"), (*strided, "strided")]
    rows = strided_runs(*strided)
    cpu = torch.device("cpu")
    want = plan_owners(batched.ByteRuns.cat([batched.byte_runs(*dense), rows]), 4096)
    for batch in (batched.compile_batch(copies, cpu), batched.compile_batch(copies, cpu, [None, rows])):
        assert torch.equal(batch.table.runs, want[0]) and torch.equal(batch.table.owner, want[1])
    first_row = rows.head(1)
    given = batched.compile_batch(copies, cpu, [None, first_row])  # used as given, not cut again
    assert given.runs == 2 and torch.equal(given.table.runs, plan_owners(batched.ByteRuns.cat(
        [batched.byte_runs(*dense), first_row]), 4096)[0])


@pytest.mark.parametrize("tile", [64, 4096])
@pytest.mark.parametrize("seed", range(3))
def test_pitched_runs_tile_as_their_rows(tile: int, seed: int) -> None:
    """A run of rows at a pitch tiles exactly as its rows listed one by one, in order:
    the oracle is each row written out as its own one-row run."""
    rng = random.Random(seed)
    runs, rows = [], []
    for _ in range(12):
        d, s, n, k = (rng.randrange(0, 1 << 30, 16), rng.randrange(0, 1 << 30, 16),
                      16 * rng.randrange(1, 700), rng.randrange(1, 9))
        dp, sp = 16 * rng.randrange(0, 900), 16 * rng.randrange(0, 900)
        runs.append((d, s, n, k, dp, sp))
        rows += [(d + i * dp, s + i * sp, n) for i in range(k)]
    pitched = ByteRuns(*(torch.tensor(c, dtype=torch.int64) for c in zip(*runs)))
    assert pitched.total() == sum(n for _, _, n in rows)
    assert torch.equal(plan_tiles(pitched, tile), plan_tiles(rows, tile))
    assert torch.equal(plan_tiles(ByteRuns.cat([ByteRuns.of(rows[:3]), pitched]), tile),
                       plan_tiles(rows[:3] + rows, tile))
    bad = ByteRuns(*(torch.tensor([c], dtype=torch.int64) for c in (0, 0, 16, 2, 8, 0)))
    with pytest.raises(ValueError, match="pitches 0 -> 8"):
        plan_tiles(bad)


@pytest.mark.parametrize("case", sorted(STRIDED))
def test_strided_tiles_are_the_rows_tiles(case: str) -> None:
    """A strided copy's pitched runs give the tile table its rows listed one by one gave
    before pitches (what the copy kernel replays is unchanged): the oracle lists every
    row by walking the tensors' own indices."""
    buf = torch.zeros(1 << 20, dtype=torch.uint8)
    dst, src = STRIDED[case](buf)
    inner = 2 if case == "rows of a row block" else 1  # dims of a row: dense on both sides
    row = dst[(0,) * (dst.dim() - inner)].nbytes
    outer = torch.cartesian_prod(*(torch.arange(n) for n in dst.shape[:-inner])).reshape(-1, dst.dim() - inner)
    rows = [(dst[tuple(i)].data_ptr(), src[tuple(i)].data_ptr(), row) for i in outer.tolist()]
    assert torch.equal(plan_tiles(strided_runs(dst, src)), plan_tiles(rows))
