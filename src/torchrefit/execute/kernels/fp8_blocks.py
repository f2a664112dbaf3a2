"""Block FP8 quantization of many regions in one device launch (Triton, CUDA only).

A refit quantizes thousands of regions (a q_proj fed from Megatron's fused QKV is 32
strips of 128 rows, one per query group): one launch each would cost more than the
bytes. :class:`BlockTable` holds, for every ``br x bc`` block of every region, where
its source values, FP8 values and scale live (an int64 table on the device, built
once when a refit compiles); :func:`launch` quantizes them all with one kernel launch,
reading each source element once from device memory and writing each FP8 value once.
Blocks are split into two tables: *even* blocks (whole, power-of-two sized, every
address and row stride a multiple of 16 bytes: every block of real weights) go
through a kernel without masks whose loads and stores are 16 bytes wide; the rest
(partial edge blocks, odd strides) through the same arithmetic with masks.

The arithmetic is that of :func:`torchrefit.transforms.fp8.quantize_blocks` bit for
bit: ``amax`` of the float32 values, ``s = max(amax, 1e-4) / 448`` with IEEE
division (``div_rn``, not Triton's approximate ``/``), then ``x / s`` rounded to
nearest, to nearest even into ``float8_e4m3fn`` (``|x / s| <= 448``, so saturation
never applies). The per-element quotient is not a division: with ``inv`` the
correctly rounded ``1 / s`` (once per block), ``q0 = x * inv`` and the FMA residual
``x - q0 * s``, ``q0 + residual * inv`` is the correctly rounded ``x / s`` (Markstein's
theorem; the fast path of the hardware's own ``div.rn``, whose reciprocal it hoists
out of the element loop). It needs no underflow, which holds wherever the result is
not far below FP8's smallest subnormal (there, both round to a zero of ``x``'s sign,
which the sign copy keeps: the residual step would turn ``-0`` into ``+0``).
``tests/test_fp8_gpu.py`` checks every variant bit for bit against the torch
reference, also on every bf16 bit pattern at scales over the whole exponent range.

Who calls it: ``execute.quantize`` on the rank that quantizes, while compiling
(``BlockTable.build``) and on every refit (``launch``); never on CPU tensors (the
tests run it on CPU through Triton's interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["available", "BlockTable", "launch", "Variant", "VARIANTS", "variant"]

_FIELDS = 7  # src, src row stride, dst, dst row stride, scale, rows, cols (per block)
_ALIGN = 16  # bytes: the width of one vector load or store


@dataclass(frozen=True)
class Variant:
    """How even blocks are processed: ``chunk`` rows at a time (the whole block: one
    pass with the block in registers; fewer: two passes over row chunks, the second
    re-reading the block from cache, fewer registers so more blocks in flight) by
    programs of ``warps`` warps."""

    chunk: int
    warps: int


VARIANTS = {
    "onepass_w8": Variant(128, 8),
    "onepass_w16": Variant(128, 16),
    "twopass_c64_w8": Variant(64, 8),
    "twopass_c32_w4": Variant(32, 4),
    "twopass_c32_w8": Variant(32, 8),
}
# the fastest of VARIANTS on large projections: 64-row chunks keep ~40 registers a
# thread, so six programs an SM keep loads in flight, and the second pass finds the
# block in cache; a whole block in registers leaves room for fewer programs
_DEFAULT = "twopass_c64_w8"
_EDGE = Variant(32, 4)  # masked blocks: few, and a masked whole block needs ~250 registers


def variant() -> str:
    """The variant even blocks use unless ``launch`` is given another (a key of
    ``VARIANTS``; ``benchmarks/`` times them all)."""
    return _DEFAULT


@lru_cache(maxsize=1)
def _kernel():
    from ._fp8_blocks_triton import (
        quantize_blocks_kernel,  # Triton is optional: imported on first use
    )
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
    """Blocks of a set of regions of one source dtype, as the kernel reads them, all
    even or all not (see the module's docstring).

    ``keep`` holds the tensors whose addresses the table names (the kernel would read
    freed memory otherwise)."""

    table: torch.Tensor  # int64 [blocks, 7] on the device
    src_dtype: torch.dtype
    block: tuple[int, int]
    keep: tuple[torch.Tensor, ...]
    even: bool = False

    @property
    def blocks(self) -> int:
        return self.table.shape[0]

    @staticmethod
    def build(items, block: tuple[int, int]) -> list[BlockTable]:
        """Tables (per source dtype, even blocks apart from the rest) for ``items``:
        ``(src, dst, scale)`` with ``src`` and ``dst`` of shape ``[..., rows, cols]``
        whose last dim is dense, ``dst`` float8_e4m3fn, and ``scale`` float32 of the
        block grid ``[..., gr, gc]``."""
        by_dtype: dict[torch.dtype, tuple[list, list]] = {}
        for src, dst, scale in items:
            parts, keep = by_dtype.setdefault(src.dtype, ([], []))
            keep.extend((src, dst, scale))
            for lead in _leading(src.shape[:-2]):
                parts.append(_rows(src[lead], dst[lead], scale[lead], block))
        out = []
        for dtype, (parts, keep) in by_dtype.items():
            table = torch.cat(parts)
            even = _even(table, block)
            for flag in (True, False):
                if bool((even == flag).any()):
                    out.append(BlockTable(table[even == flag].to(keep[0].device), dtype, block,
                                          tuple(keep), flag))
        return out


def _rows(s: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, block) -> torch.Tensor:
    """The table rows of one 2-D region, block (i, j) at row ``i * gc + j``."""
    if s.stride(1) != 1 or d.stride(1) != 1:
        raise ValueError("block quantization needs a dense last dim on both sides")
    br, bc = block
    if max(s.stride(0), d.stride(0)) * br >= 2**31:
        raise ValueError(f"a row stride of {max(s.stride(0), d.stride(0))} elements is too large "
                         "for the kernel's 32-bit offsets inside a block")
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


def _even(table: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Rows of ``table`` the unmasked kernel may take: whole power-of-two blocks whose
    source and FP8 addresses are 16-byte aligned and whose row strides are multiples of
    16 elements (so every row of the block starts aligned too)."""
    br, bc = block
    if br != _pow2(br) or bc != _pow2(bc):
        return torch.zeros(table.shape[0], dtype=torch.bool)
    return ((table[:, 0] % _ALIGN == 0) & (table[:, 1] % 16 == 0) & (table[:, 2] % _ALIGN == 0)
            & (table[:, 3] % 16 == 0) & (table[:, 5] == br) & (table[:, 6] == bc))


def _leading(shape) -> list[tuple[int, ...]]:
    """Every index of the leading dims (stacked experts' ``E``): ``[()]`` for none."""
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [i + (k,) for i in out for k in range(n)]
    return out


def launch(table: BlockTable, name: str | None = None) -> None:
    """Quantize every block of ``table`` on the current stream (one kernel launch);
    even tables with variant ``name`` (default :func:`variant`)."""
    import triton.language as tl
    if not table.blocks:
        return
    src = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
           torch.float32: tl.float32}[table.src_dtype]
    br, bc = _pow2(table.block[0]), _pow2(table.block[1])
    v = VARIANTS[name or variant()] if table.even else _EDGE
    _kernel()[(table.blocks,)](table.table, BR=br, BC=bc, SRC=src, EVEN=table.even,
                               CHUNK=min(v.chunk, br), num_warps=v.warps)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
