"""The block-FP8 Triton kernel (``execute.kernels.fp8_blocks``) on CPU, through Triton's interpreter.

Covers what does not need a GPU to go wrong: which blocks the table calls *even*
(whole, aligned: the unmasked kernel) and which not (partial edges, odd strides, a
source 2 bytes off alignment), that every variant writes every FP8 value and scale
of every block exactly once in the right place (destinations poisoned first), the
masked edges, row strips of a wider tensor, stacked experts, fp32 / fp16 sources, the
sign of ``-0`` and the blocks of ``testing.fp8_inputs.hard_blocks``, against the torch
reference ``quantize_blocks``. Scales must be bit-identical, and so must the sign of
every FP8 value. The values themselves only as far as the interpreter can say: its
float32 -> FP8 conversion is not the GPU's (it drops the carry when rounding up
crosses a power of two: 31.8 -> 16 instead of 32; it gets subnormals wrong and rounds
some ties away from even), and it computes ``fma`` unfused; so each value must be the
reference's, its neighbour code, the reference with the carry lost, or below 2^-5
where the reference's is (subnormals, the smallest binades), and at least
90% exactly the reference's. Last-bit exactness is the GPU test's to prove
(``test_fp8_gpu.py``, every variant against the torch reference).
"""

from __future__ import annotations

import textwrap

import torch
from interpreted import run_interpreted

from torchrefit.execute.kernels.fp8_blocks import BlockTable

BLOCK = (128, 128)


def test_even_blocks_are_whole_and_aligned() -> None:
    w = torch.zeros(300, 272, dtype=torch.bfloat16)  # 3 x 3 blocks: 2 x 2 whole ones
    grid = torch.zeros(3, 3)
    tables = BlockTable.build([(w, w.to(torch.float8_e4m3fn), grid)], BLOCK)
    assert [(t.even, t.blocks) for t in tables] == [(True, 4), (False, 5)]
    odd = torch.zeros(256, 264, dtype=torch.bfloat16)[:, :256]  # row stride 264: not 16 elements
    fp8 = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    assert [t.even for t in BlockTable.build([(odd, fp8, torch.zeros(2, 2))], BLOCK)] == [False]
    shifted = torch.zeros(256 * 256 + 1, dtype=torch.bfloat16)[1:].view(256, 256)  # 2 bytes off
    assert [t.even for t in BlockTable.build([(shifted, fp8, torch.zeros(2, 2))], BLOCK)] == [False]
    assert [t.even for t in BlockTable.build([(w[:256, :256], fp8, torch.zeros(2, 2))], (96, 128))] \
        == [False]  # blocks of 96 rows: the kernel's tile is padded to 128, so masked


_INTERPRETED = textwrap.dedent("""
    import torch
    from torchrefit.testing.fp8_inputs import hard_blocks
    from torchrefit.execute.kernels import fp8_blocks
    from torchrefit.transforms.fp8 import quantize_blocks

    B = (128, 128)
    g = torch.Generator().manual_seed(0)

    def close(got, want):  # the interpreter's float32 -> FP8 conversion, see the docstring
        sign = (got & 0x80) == (want & 0x80)
        step = ((got & 0x7F) - (want & 0x7F)).abs() <= 1
        lost_carry = ((want & 7) == 0) & ((got & 0x7F) == (want & 0x7F) - 8)
        tiny = ((want & 0x7F) <= 0x10) & ((got & 0x7F) <= 0x10)  # below 2^-5
        return sign & (step | lost_carry | tiny)

    def case(src, name):
        lead, (rows, cols) = src.shape[:-2], src.shape[-2:]
        dst = torch.full(src.shape, float("nan")).to(torch.float8_e4m3fn)
        scale = torch.full(tuple(lead) + (-(-rows // 128), -(-cols // 128)), -1.0)
        for t in fp8_blocks.BlockTable.build([(src, dst, scale)], B):
            fp8_blocks.launch(t, name)
        q, s = quantize_blocks(src, B)
        got, want = dst.view(torch.uint8).int(), q.view(torch.uint8).int()
        values = bool(close(got, want).all())
        return values and torch.equal(scale, s) and bool((got == want).float().mean() > 0.9)

    w = torch.randn(300, 272, generator=g).to(torch.bfloat16)
    w[:128, :128] = 0
    w[5, :9] = -0.0
    fused = torch.randn(768, 256, generator=g).to(torch.bfloat16) * 1e-3
    cases = {"edges": w, "strip": fused[256:384], "stacked fp32": torch.randn(2, 130, 256, generator=g),
             "fp16": (w[:256, :256].half() * 7), "hard": hard_blocks(stride=24)}
    bad = [(n, v) for v in fp8_blocks.VARIANTS for n, t in cases.items() if not case(t, v)]
    print("EXACT" if not bad else f"DIFFERS {bad}")
""")


def test_every_variant_under_triton_interpreter() -> None:
    out = run_interpreted(_INTERPRETED, timeout=600)
    assert out.strip().endswith("EXACT"), out
