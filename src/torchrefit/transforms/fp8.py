"""FP8 destinations: quantize what a refit delivers, block by block, on the receiver.

A destination tensor of dtype ``float8_e4m3fn`` is an FP8 *target* when it has a
sibling scale tensor in the same model:

* ``<name>_scale_inv`` of block-grid shape ``[ceil(rows / br), ceil(cols / bc)]``
  (``fp8_block=(br, bc)``; the last two dims are blocked, leading dims such as
  stacked experts' ``E`` kept: ``w13_weight_scale_inv`` ``[E, 2I / br, H / bc]``): the DeepSeek-V3 / vLLM block convention, per block
  ``s = amax(|w|).clamp(min=1e-4) / 448``, ``q = (w / s).to(float8_e4m3fn)``,
  ``<name>_scale_inv = s``;
* ``<name>_scale`` with one element: per tensor, the same formula over the whole tensor.

Who calls what: the planner calls :func:`fp8_targets` and :func:`check_targets`
on every rank over the same rosters (bad grids raise :class:`PlanError` everywhere
before any byte moves) and gives an FP8 target's transfers the source's dtype; the
``Refitter`` builds one :class:`Quantizer` per rank after planning, hands the
executor ``quantizer.tensors(dst_tensors)`` (a high-precision shadow in place of
each FP8 tensor it holds) and calls ``quantizer.finish()`` after every exchange,
which writes the FP8 tensors and their scales from the shadows.

Bit-identical to quantizing the whole global tensor: every piece a rank holds must
start and end on block boundaries (or the tensor's end), so each block is quantized
from all of its elements by the same float32 arithmetic. Quantization happens on
the receiver: the wire carries the source's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..layout._types import Box, ModelLayout

__all__ = ["FP8_DTYPES", "FP8_MAX", "fp8_targets", "check_targets", "quantize_blocks",
           "quantize_tensor", "Quantizer", "scale_cells"]

FP8_DTYPES = frozenset({"float8_e4m3fn"})
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_MIN_AMAX = 1e-4


@dataclass(frozen=True)
class Target:
    """An FP8 destination tensor and its scale sibling (``per_tensor``: ``_scale``)."""

    name: str
    scale: str
    per_tensor: bool


def fp8_targets(dst_tensors: Mapping) -> dict[str, Target]:
    """FP8 targets among the destination's global tensors (``{name: info with .dtype}``),
    by weight name; their scale tensors need no source."""
    out = {}
    for name, info in dst_tensors.items():
        if info.dtype not in FP8_DTYPES:
            continue
        if name + "_scale_inv" in dst_tensors:
            out[name] = Target(name, name + "_scale_inv", False)
        elif name + "_scale" in dst_tensors:
            out[name] = Target(name, name + "_scale", True)
    return out


def scale_cells(box: Box, block: tuple[int, int]) -> Box:
    """The block-grid cells of a block-aligned box (blocks over the last two dims)."""
    (r0, c0), (r1, c1) = box.offset[-2:], box.end[-2:]
    br, bc = block
    return Box(box.offset[:-2] + (r0 // br, c0 // bc),
               box.size[:-2] + (-(-r1 // br) - r0 // br, -(-c1 // bc) - c0 // bc))


def check_targets(targets: Mapping[str, Target], dst, block: tuple[int, int]) -> list[str]:
    """Problems with FP8 targets over every destination rank (``dst``: the planner's
    destination ``RoleIndex``): grid shape, block-aligned pieces, scale pieces that
    follow the weight's, whole tensors for per-tensor scales."""
    problems = []
    for name, t in sorted(targets.items()):
        info, sinfo = dst.tensors[name], dst.tensors[t.scale]
        problem = (_per_tensor_problem(info, sinfo) if t.per_tensor else
                   _block_problem(info, sinfo, block, dst))
        if problem:
            problems.append(f"{name}: {problem}")
    return problems


def _per_tensor_problem(info, sinfo) -> str | None:
    if sinfo.shape not in ((), (1,)):
        return f"a per-tensor scale {sinfo.name} holds one element, not {list(sinfo.shape)}"
    whole = Box.whole(info.shape)
    if any(box != whole for box in info.boxes):
        return ("a per-tensor FP8 scale needs the whole tensor on every rank that holds it "
                f"(ranks hold {[str(b) for b in info.boxes][:4]})")
    return None


def _block_problem(info, sinfo, block, dst) -> str | None:
    if len(info.shape) < 2:
        return f"block FP8 quantizes weights of 2 or more dims, not {list(info.shape)}"
    br, bc = block
    rows, cols = info.shape[-2:]
    grid = tuple(info.shape[:-2]) + (-(-rows // br), -(-cols // bc))
    if tuple(sinfo.shape) != grid:
        return (f"{sinfo.name} {list(sinfo.shape)} is not the block grid {list(grid)} of "
                f"{list(info.shape)} in blocks of {list(block)} (fp8_block=)")
    for box in info.boxes:
        if not _aligned(box, info.shape, block):
            return (f"a rank holds {box}, which cuts a {br}x{bc} block; every piece must start "
                    "and end on block boundaries so that each block is quantized whole")
    by_class: dict[int, list[Box]] = {}
    for box, cids in info.boxes.items():
        for c in cids:
            by_class.setdefault(c, []).append(scale_cells(box, block))
    scales: dict[int, list[Box]] = {}
    for box, cids in sinfo.boxes.items():
        for c in cids:
            scales.setdefault(c, []).append(box)
    for c, cells in by_class.items():
        if sorted(cells, key=_key) != sorted(scales.get(c, []), key=_key):
            return (f"{sinfo.name}'s pieces must be the block cells of the weight's pieces on "
                    f"each rank (dst ranks {list(dst.ranks([c]))[:8]}: weight cells {[str(b) for b in cells][:4]}, scale "
                    f"pieces {[str(b) for b in scales.get(c, [])][:4]})")
    return None


def _key(b: Box):
    return (b.offset, b.size)


def _aligned(box: Box, shape, block) -> bool:
    return all(o % k == 0 and (e % k == 0 or e == n)
               for o, e, k, n in zip(box.offset[-2:], box.end[-2:], block, shape[-2:]))


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, float32 ``scale_inv`` grid) of a block-aligned tensor,
    blocked over its last two dims."""
    *lead, rows, cols = w.shape
    br, bc = block
    gr, gc = -(-rows // br), -(-cols // bc)
    x = w.to(torch.float32)
    padded = x.new_zeros(*lead, gr * br, gc * bc)  # |0| never raises an amax
    padded[..., :rows, :cols] = x
    amax = padded.view(*lead, gr, br, gc, bc).abs().amax(dim=(-3, -1))
    s = amax.clamp(min=_MIN_AMAX) / FP8_MAX
    full = s.repeat_interleave(br, -2).repeat_interleave(bc, -1)[..., :rows, :cols]
    return (x / full).to(torch.float8_e4m3fn), s


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, float32 scalar scale) of a whole tensor."""
    x = w.to(torch.float32)
    s = x.abs().amax().clamp(min=_MIN_AMAX) / FP8_MAX
    return (x / s).to(torch.float8_e4m3fn), s


class Quantizer:
    """One rank's FP8 targets: shadows the executor fills, quantized by :meth:`finish`."""

    def __init__(self, targets: Mapping[str, Target], layout: ModelLayout | None,
                 tensors: Mapping[str, torch.Tensor], shadow_dtypes: Mapping[str, str],
                 block: tuple[int, int]) -> None:
        from ..layout._types import dtype_from_name
        self.block = block
        self.shadows: dict[str, torch.Tensor] = {}
        self._work: list[tuple] = []
        if layout is None:
            return
        keys = {t.name: (k, t) for k, t in layout}
        for name, target in sorted(targets.items()):
            if name not in keys:
                continue
            key, tl = keys[name]
            scale_key, sl = keys[target.scale]
            dst = tensors[key].detach()
            shadow = torch.empty(dst.shape, dtype=dtype_from_name(shadow_dtypes[name]),
                                 device=dst.device)
            self.shadows[key] = shadow
            scale = tensors[scale_key].detach()
            for piece in tl.pieces:
                lb = piece.local_box.slices()
                if target.per_tensor:
                    self._work.append((shadow[lb], dst[lb], scale, None))
                    continue
                cells = scale_cells(piece.box, block)
                sp = next(p for p in sl.pieces if p.box == cells)
                self._work.append((shadow[lb], dst[lb], scale, sp.local_box.slices()))

    @property
    def count(self) -> int:
        return len(self.shadows)

    def tensors(self, dst_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The destination tensors the executor writes: shadows in place of FP8 targets."""
        return {**dst_tensors, **self.shadows}

    @torch.no_grad()
    def finish(self) -> None:
        """Quantize every shadow into its FP8 tensor and scale (after the exchange, on
        the caller's stream, which the exchange's copies are ordered before)."""
        for shadow, dst, scale, cells in self._work:
            if cells is None:
                q, s = quantize_tensor(shadow)
                scale.copy_(s.reshape(scale.shape))
            else:
                q, s = quantize_blocks(shadow, self.block)
                scale[cells].copy_(s)
            dst.copy_(q)
