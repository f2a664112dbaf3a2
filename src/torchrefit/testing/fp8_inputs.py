"""Inputs that catch FP8 quantizers that are right only on typical weights.

Used by ``tests/test_fp8_gpu.py``, ``tests/test_fp8_blocks_interpreted.py`` and the FP8
benchmark to compare a block quantizer bit for bit with
``transforms.fp8.quantize_blocks``.
"""

from __future__ import annotations

import torch

__all__ = ["hard_blocks"]


def _bf16(bits: torch.Tensor) -> torch.Tensor:
    """bf16 values of 16-bit patterns held in int32 (two's complement into int16)."""
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.bfloat16)


def hard_blocks(device: torch.device | str = "cpu", block: int = 128, stride: int = 1) -> torch.Tensor:
    """bf16 ``[n * block, block]``, one ``block x block`` block after another: every finite
    bf16 bit pattern (the first blocks), then, for each biased exponent ``top`` from -6 to
    254 (every ``stride``-th), a block whose elements have exponents in ``[top - 20, top]``
    (clamped: subnormals and zeros at the bottom) with random mantissas and signs and
    eight ``-0``; last an all ``-0`` block (its amax is clamped to 1e-4)."""
    g = torch.Generator(device=device).manual_seed(1)
    every = torch.arange(1 << 16, device=device, dtype=torch.int32)
    every = torch.where(((every >> 7) & 0xFF) != 0xFF, every, torch.zeros_like(every))
    every = torch.cat([every, every.new_zeros(-every.numel() % (block * block))])
    blocks = [_bf16(every).view(-1, block, block)]
    shape = (block, block)
    for top in range(-6, 255, stride):
        e = (top - torch.randint(0, 21, shape, device=device, generator=g)).clamp(0, 254)
        m = torch.randint(0, 128, shape, device=device, generator=g)
        sign = torch.randint(0, 2, shape, device=device, generator=g) << 15
        bits = (sign | (e << 7) | m).to(torch.int32)
        bits[0, :8] = 1 << 15
        blocks.append(_bf16(bits)[None])
    blocks.append(torch.full((1, block, block), -0.0, device=device, dtype=torch.bfloat16))
    return torch.cat(blocks).reshape(-1, block)
