"""Block FP8 quantization of many regions in one device launch (Triton, CUDA only).

A refit quantizes thousands of regions (a q_proj fed from Megatron's fused QKV is 32
strips of 128 rows, one per query group): one launch each would cost more than the
bytes. :class:`BlockTable` holds, for every ``br x bc`` block of every region, where
its source values, FP8 values and scale live (an int64 table on the device, built
once when a refit compiles); :func:`launch` quantizes them all with one kernel per
source dtype, reading each source element once and writing each FP8 value once.

The arithmetic is that of :func:`torchrefit.transforms.fp8.quantize_blocks` bit for
bit: ``amax`` of the float32 values, ``s = max(amax, 1e-4) / 448`` and ``x / s``
with IEEE division (``div_rn``, not Triton's approximate ``/``), then round to
nearest even into ``float8_e4m3fn`` (``|x / s| <= 448``, so saturation never
applies). ``tests/test_fp8_gpu.py`` checks it against the torch reference.

Who calls it: ``transforms.fp8.Quantizer`` on the rank that quantizes, while compiling
(``BlockTable.build``) and on every refit (``launch``); never on CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["available", "BlockTable", "launch"]

_FIELDS = 7  # src, src row stride, dst, dst row stride, scale, rows, cols (per block)


@lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_blocks_kernel(table, BR: tl.constexpr, BC: tl.constexpr, SRC: tl.constexpr):
        row = table + tl.program_id(0).to(tl.int64) * 7
        src = tl.load(row).to(tl.pointer_type(SRC))
        src_stride = tl.load(row + 1)
        dst = tl.load(row + 2).to(tl.pointer_type(tl.float8e4nv))
        dst_stride = tl.load(row + 3)
        scale = tl.load(row + 4).to(tl.pointer_type(tl.float32))
        rows = tl.load(row + 5)
        cols = tl.load(row + 6)
        r = tl.arange(0, BR)[:, None].to(tl.int64)
        c = tl.arange(0, BC)[None, :].to(tl.int64)
        mask = (r < rows) & (c < cols)
        x = tl.load(src + r * src_stride + c, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        s = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
        q = tl.math.div_rn(x, s).to(tl.float8e4nv)
        tl.store(dst + r * dst_stride + c, q, mask=mask)
        tl.store(scale, s)

    return quantize_blocks_kernel


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether Triton can run here (CUDA present and the package importable)."""
    if not torch.cuda.is_available():
        return False
    try:
        _kernel()
    except Exception:  # no triton, or one too old for pointer casts and div_rn
        return False
    return True


@dataclass(frozen=True)
class BlockTable:
    """Every block of a set of regions of one source dtype, as the kernel reads them.

    ``keep`` holds the tensors whose addresses the table names (the kernel would read
    freed memory otherwise)."""

    table: torch.Tensor  # int64 [blocks, 7] on the device
    src_dtype: torch.dtype
    block: tuple[int, int]
    keep: tuple[torch.Tensor, ...]

    @property
    def blocks(self) -> int:
        return self.table.shape[0]

    @staticmethod
    def build(items, block: tuple[int, int]) -> list[BlockTable]:
        """Tables (one per source dtype) for ``items``: ``(src, dst, scale)`` with ``src``
        and ``dst`` of shape ``[..., rows, cols]`` whose last dim is dense, ``dst``
        float8_e4m3fn, and ``scale`` float32 of the block grid ``[..., gr, gc]``."""
        by_dtype: dict[torch.dtype, tuple[list, list]] = {}
        for src, dst, scale in items:
            parts, keep = by_dtype.setdefault(src.dtype, ([], []))
            keep.extend((src, dst, scale))
            for lead in _leading(src.shape[:-2]):
                parts.append(_rows(src[lead], dst[lead], scale[lead], block))
        out = []
        for dtype, (parts, keep) in by_dtype.items():
            table = torch.cat(parts).to(keep[0].device)
            out.append(BlockTable(table, dtype, block, tuple(keep)))
        return out


def _rows(s: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, block) -> torch.Tensor:
    """The table rows of one 2-D region, block (i, j) at row ``i * gc + j``."""
    if s.stride(1) != 1 or d.stride(1) != 1:
        raise ValueError("block quantization needs a dense last dim on both sides")
    br, bc = block
    rows, cols = s.shape
    gr, gc = sc.shape
    i = torch.arange(gr, dtype=torch.int64).repeat_interleave(gc)
    j = torch.arange(gc, dtype=torch.int64).repeat(gr)
    return torch.stack([
        s.data_ptr() + (i * br * s.stride(0) + j * bc) * s.element_size(),
        torch.full_like(i, s.stride(0)),
        d.data_ptr() + (i * br * d.stride(0) + j * bc) * d.element_size(),
        torch.full_like(i, d.stride(0)),
        sc.data_ptr() + (i * sc.stride(0) + j * sc.stride(1)) * sc.element_size(),
        (rows - i * br).clamp(max=br),
        (cols - j * bc).clamp(max=bc),
    ], dim=1)


def _leading(shape) -> list[tuple[int, ...]]:
    """Every index of the leading dims (stacked experts' ``E``): ``[()]`` for none."""
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [i + (k,) for i in out for k in range(n)]
    return out


def launch(table: BlockTable) -> None:
    """Quantize every block of ``table`` on the current stream (one kernel launch)."""
    import triton.language as tl
    if not table.blocks:
        return
    src = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
           torch.float32: tl.float32}[table.src_dtype]
    br, bc = table.block
    _kernel()[(table.blocks,)](table.table, BR=_pow2(br), BC=_pow2(bc), SRC=src, num_warps=8)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
