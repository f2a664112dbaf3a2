"""Batched copies (``execute.batched``), on CPU.

Covers the pure tiling (``plan_tiles``: applied row by row to a byte buffer it
moves exactly what the copies would, every copy cut into tiles no larger than the
tile, its last remainder included, offsets from the anchor that may be negative;
misaligned copies are refused), the rule for which copies qualify (``batchable``:
same dtype, dense, 16-byte aligned, below the size bound), and the Triton kernel
itself run by Triton's interpreter on CPU tensors (skipped where Triton is not
installed), against copies made directly; and that the kernel is opt-in.
"""

from __future__ import annotations

import random
import textwrap

import pytest
import torch
from interpreted import run_interpreted

from torchrefit.execute.batched import ALIGN, BATCH_MAX_BYTES, WORD, batchable, plan_tiles


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


def _apply(table: torch.Tensor, buf: torch.Tensor, anchor_word: int) -> None:
    """The kernel's semantics, row by row: copy ``words`` from src to dst (word offsets
    from the anchor, which sits at ``anchor_word`` of ``buf``)."""
    for src, dst, n in table.tolist():
        buf[anchor_word + dst: anchor_word + dst + n] = buf[anchor_word + src: anchor_word + src + n].clone()


@pytest.mark.parametrize("tile", [16, 64, 256, 4096])
@pytest.mark.parametrize("seed", range(4))
def test_tiles_move_exactly_the_copies(tile: int, seed: int) -> None:
    rng = random.Random(seed)
    words = 40000
    copies = _layout(rng, 60, words)
    anchor_word = rng.choice([0, words // 3 // 4 * 4, words - 8])  # copies before and after it
    table = plan_tiles(copies, anchor_word * WORD, tile_bytes=tile)
    buf = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32)
    want = buf.clone()
    for d, s, n in copies:  # the oracle: each copy directly
        want[d // WORD: (d + n) // WORD] = buf[s // WORD: (s + n) // WORD]
    _apply(table, buf, anchor_word)
    assert torch.equal(buf, want)
    # every tile within the tile size, and each copy's tiles sum to its size, last one too
    assert int(table[:, 2].max()) <= tile // WORD and int(table[:, 2].min()) > 0
    assert int(table[:, 2].sum()) * WORD == sum(n for _, _, n in copies)
    assert len(table) == sum(-(-n // tile) for _, _, n in copies)


def test_misaligned_copies_are_refused() -> None:
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        plan_tiles([(0, 8, 16)], 0)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        plan_tiles([(0, 16, 20)], 0)
    with pytest.raises(ValueError, match="not a multiple"):
        plan_tiles([(0, 16, 16)], 0, tile_bytes=24)
    assert plan_tiles([], 0).shape == (0, 3)


def test_which_copies_are_batchable() -> None:
    buf = torch.zeros(4096, dtype=torch.bfloat16)
    other = torch.zeros(4096, dtype=torch.bfloat16)
    assert batchable(buf[:1024], other[1024:2048])
    assert not batchable(buf[:1024], other[:1024].float())  # a cast
    assert not batchable(buf[:1024], other[1:1025])  # source 2 bytes off alignment
    assert not batchable(buf[:1001], other[:1001])  # 2002 bytes: not a multiple of 16
    assert not batchable(buf.view(64, 64)[:, :32], other.view(64, 64)[:, :32])  # strided
    assert not batchable(buf[:0], other[:0])
    big = BATCH_MAX_BYTES // 2
    assert not batchable(torch.empty(big, dtype=torch.bfloat16), torch.empty(big, dtype=torch.bfloat16))
    assert ALIGN % WORD == 0


_INTERPRETED = textwrap.dedent("""
    import random, torch
    from torchrefit.execute import batched as b
    rng = random.Random(3)
    buf = torch.randint(-2**31, 2**31 - 1, (60000,), dtype=torch.int32)
    anchor = buf[20000:20008]  # copies on both sides of the anchor: negative offsets too
    copies, s, d = [], 0, 30000
    for n in (4, 8, 1020, 1024, 1028, 3000, 40, 2048):  # words: below, at and past a tile
        copies.append((buf[d:].data_ptr(), buf[s:].data_ptr(), n * 4))
        s, d = s + n + rng.choice([0, 4]), d + n + rng.choice([0, 8])
    want = buf.clone()
    for dp, sp, n in copies:
        dw, sw = (dp - buf.data_ptr()) // 4, (sp - buf.data_ptr()) // 4
        want[dw:dw + n // 4] = buf[sw:sw + n // 4]
    table = b.plan_tiles(copies, anchor.data_ptr(), tile_bytes=4096)
    b._kernel()[(table.shape[0],)](anchor, table, BLOCK=256, STEPS=4)
    print("EXACT" if torch.equal(buf, want) else "DIFFERS")
""")


def test_kernel_under_triton_interpreter() -> None:
    out = run_interpreted(_INTERPRETED, timeout=300)
    assert out.strip().endswith("EXACT"), out


def test_batched_kernel_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off unless TORCHREFIT_BATCHED_COPY=1 (slower than the per-copy graph on an H200 so
    far: BENCHMARKS.md), and never for CPU tensors."""
    from torchrefit.execute.batched import kernel_available

    cuda = torch.device("cuda")
    monkeypatch.delenv("TORCHREFIT_BATCHED_COPY", raising=False)
    assert not kernel_available(cuda)
    monkeypatch.setenv("TORCHREFIT_BATCHED_COPY", "1")
    assert not kernel_available(torch.device("cpu"))
    try:
        import triton  # noqa: F401
    except ImportError:
        return
    assert kernel_available(cuda)
