"""A rank's FP8 ``Quantize`` steps compiled against its tensors, run around the exchange.

The plan says which regions of FP8 destinations this rank quantizes (see
``plan.types.Quantize``); this module allocates what they need once per refitter
(:func:`fp8_buffers`: shadows that the exchange fills in the source's dtype, buffers
that sends carry as FP8 and scales), compiles the steps into views
(:func:`compile_quantize`) and runs them: ``before`` the exchange from the source
(into the destination or into FP8 buffers), ``after`` it from the shadows. On CUDA with
Triton every block of a phase goes through one kernel launch per source dtype
(``execute.kernels.fp8_blocks``); elsewhere, and for per-tensor scales, the torch
reference of ``transforms.fp8`` runs per step.

Who calls what: ``Refitter`` calls :func:`fp8_buffers` once and hands the buffers to
every ``Program`` it compiles (the refit's and verify's share them: verify compares
against the shadows the last refit filled); ``Program`` compiles the steps and calls
``before`` / ``after`` on the caller's stream around its exchange, so the side
streams and the exchange, which wait for that stream, see the FP8 buffers filled, and the
caller sees the FP8 values written. Verify runs ``mismatches`` with the torch
reference only (a witness independent of the kernel).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..layout._types import dtype_from_name
from ..plan.types import Quantize, RankPlan
from ..transforms.fp8 import quantize_blocks, quantize_tensor
from .kernels import fp8_blocks
from .views import Views

__all__ = ["Step", "Quantizes", "fp8_buffers", "compile_quantize"]


def fp8_buffers(plan: RankPlan, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(shadows, sent)`` of this rank's plan: the destination-side shadow of each
    FP8 tensor some piece of which is quantized on receipt (the source's dtype, the
    destination tensor's shape), and the source-side FP8 values and float32 scales of
    each region quantized before sending."""
    shadows: dict[str, torch.Tensor] = {}
    sent: dict[str, torch.Tensor] = {}
    for q in plan.quantize:
        if q.received and q.src_key not in shadows:
            like = dst[q.dst_key]
            shadows[q.src_key] = torch.empty(like.shape, dtype=dtype_from_name(q.src_dtype),
                                             device=like.device)
        elif q.staged:
            device = src[q.src_key].device
            sent[q.dst_key] = torch.empty(q.dst_box.size, dtype=torch.float8_e4m3fn, device=device)
            sent[q.scale_key] = torch.empty(q.scale_box.size, dtype=torch.float32, device=device)
    return shadows, sent


@dataclass(frozen=True, eq=False)
class Step:
    """One compiled step: views of its source values, FP8 values and scales."""

    src: torch.Tensor
    dst: torch.Tensor
    scale: torch.Tensor
    per_tensor: bool
    block: tuple[int, int]
    name: str
    staged: bool  # into FP8 buffers that sends carry (verify refills it, compares nothing)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 values and scales by the torch reference of ``transforms.fp8``."""
        if self.per_tensor:
            q, s = quantize_tensor(self.src)
            return q, s.reshape(self.scale.shape)
        return quantize_blocks(self.src, self.block)

    def run(self) -> None:
        q, s = self.reference()
        self.dst.copy_(q)
        self.scale.copy_(s)

    def differs(self) -> bool:
        q, s = self.reference()
        return not (torch.equal(q.view(torch.uint8), self.dst.view(torch.uint8))
                    and torch.equal(s, self.scale))


@dataclass(frozen=True)
class Phase:
    """The steps of one side of the exchange: block tables for the kernel, the rest
    stepped with the torch reference."""

    steps: tuple[Step, ...]
    tables: tuple[fp8_blocks.BlockTable, ...]
    rest: tuple[Step, ...]

    def run(self) -> None:
        for t in self.tables:
            fp8_blocks.launch(t)
        for s in self.rest:
            s.run()


@dataclass(frozen=True)
class Quantizes:
    """This rank's compiled steps: ``before`` the exchange (from the source, into the
    destination or FP8 buffers) and ``after`` it (from the shadows)."""

    before: Phase
    after: Phase

    def __bool__(self) -> bool:
        return bool(self.before.steps or self.after.steps)

    def stage(self) -> None:
        """Verify: fill the FP8 buffers the sends carry, with the torch reference."""
        for s in self.before.steps:
            if s.staged:
                s.run()

    def mismatches(self) -> list[str]:
        """Verify: steps whose FP8 values or scales in the destination differ from the
        torch reference's quantization of their source (or of the shadow, which the
        exchange's comparison checks against the source)."""
        return [f"{s.name} (FP8 quantized {where})"
                for phase, where in ((self.before, "from source"), (self.after, "on receipt"))
                for s in phase.steps if not s.staged and s.differs()]


def compile_quantize(steps: Sequence[Quantize], views: Views, block: tuple[int, int],
                     kernel: bool = True) -> Quantizes:
    """Views of every step (looked up once), grouped into the two phases; with
    ``kernel``, blocks on CUDA go into one table per phase and source dtype."""
    before, after = [], []
    for q in steps:
        src = views.view("dst" if q.received else "src", q.src_key, q.src_box)
        side = "src" if q.staged else "dst"
        dst = views.view(side, q.dst_key, q.dst_box)
        scale = views.view(side, q.scale_key, q.scale_box)
        if src.dim() != dst.dim():  # one expert of stacked experts: unit dims differ
            src = src.view(dst.shape)
        step = Step(src, dst, scale, q.per_tensor, block, f"{q.name}{q.region}", q.staged)
        (after if q.received else before).append(step)
    return Quantizes(_phase(before, block, kernel), _phase(after, block, kernel))


def _phase(steps: list[Step], block: tuple[int, int], kernel: bool) -> Phase:
    fast = [s for s in steps if kernel and _kernel_fits(s)]
    rest = [s for s in steps if not (kernel and _kernel_fits(s))]
    tables = fp8_blocks.BlockTable.build([(s.src, s.dst, s.scale) for s in fast], block) if fast else []
    return Phase(tuple(steps), tuple(tables), tuple(rest))


def _kernel_fits(s: Step) -> bool:
    return (not s.per_tensor and s.src.is_cuda and fp8_blocks.available()
            and s.src.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and s.src.stride(-1) == 1 and s.dst.stride(-1) == 1 and s.scale.dtype == torch.float32
            and s.dst.dim() >= 2)
