"""FP8 destinations: which tensors, the rules their layouts follow, and the arithmetic.

A destination tensor of dtype ``float8_e4m3fn`` is an FP8 *target* when it has a
sibling scale tensor (float32) in the same model:

* ``<name>_scale_inv`` of block-grid shape ``[ceil(rows / br), ceil(cols / bc)]``
  (``fp8_block=(br, bc)``; the last two dims are blocked, leading dims such as
  stacked experts' ``E`` kept: ``w13_weight_scale_inv`` ``[E, 2I / br, H / bc]``):
  the DeepSeek-V3 / vLLM block convention, per block
  ``s = amax(|w|).clamp(min=1e-4) / 448``, ``q = (w / s).to(float8_e4m3fn)``,
  ``<name>_scale_inv = s``;
* ``<name>_scale`` with one element: per tensor, the same formula over the whole tensor.

Who calls what: the planner calls :func:`fp8_targets` and :func:`check_targets` on
every rank over the same rosters (bad grids raise :class:`PlanError` everywhere before
any byte moves) and decides per destination piece where it is quantized
(``Planner.fp8_at_source``): on the sender where whole blocks of one source piece fill
it (the wire carries FP8 and scales), else on the receiver from a shadow in the
source's dtype. ``execute.quantize`` runs the plan's ``Quantize`` steps with
:func:`quantize_blocks` / :func:`quantize_tensor` (on CPU, and as verify's witness) or
the Triton kernel of ``execute.kernels.fp8_blocks`` (on CUDA), which computes the same bits.

Bit-identical to quantizing the whole global tensor: every piece a rank holds must
start and end on block boundaries (or the tensor's end), and every step quantizes
whole blocks, so each block is quantized from all of its elements by the same
float32 arithmetic wherever that happens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..layout._types import Box

__all__ = ["FP8_DTYPE", "FP8_DTYPES", "FP8_MAX", "Target", "fp8_targets", "check_targets",
           "quantize_blocks", "quantize_tensor", "scale_cells", "whole_blocks"]

FP8_DTYPE = "float8_e4m3fn"
FP8_DTYPES = frozenset({FP8_DTYPE})
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
    destination ``Holdings``): grid shape, block-aligned pieces, scale pieces that
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
    if sinfo.dtype != "float32":
        return f"its scale {sinfo.name} is {sinfo.dtype}; FP8 scales are float32"
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
    if sinfo.dtype != "float32":
        return f"its scale {sinfo.name} is {sinfo.dtype}; FP8 scales are float32"
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


def whole_blocks(box: Box, shape, block) -> bool:
    """Whether ``box`` of a tensor of ``shape`` is made of whole blocks: over the last
    two dims it starts on block boundaries and ends on one or at the tensor's end."""
    return _aligned(box, shape, block)


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
    s = _scale_of(amax)
    full = s.repeat_interleave(br, -2).repeat_interleave(bc, -1)[..., :rows, :cols]
    return (x / full).to(torch.float8_e4m3fn), s


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    # divide by a tensor, not a Python number: CUDA turns division by a host scalar into
    # multiplication by its rounded reciprocal, which differs in the last bit
    return amax.clamp(min=_MIN_AMAX) / torch.full((), FP8_MAX, device=amax.device)


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, float32 scalar scale) of a whole tensor."""
    x = w.to(torch.float32)
    s = _scale_of(x.abs().amax())
    return (x / s).to(torch.float8_e4m3fn), s
