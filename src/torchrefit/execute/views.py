"""Tensor views of a rank's plan, looked up while compiling (never on the hot path)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import LayoutError
from ..layout._types import Box
from ..plan.types import RankPlan

__all__ = ["Views"]


class Views:
    """The local tensors of one rank by side (``"src"`` / ``"dst"``) and key, and views
    of boxes in them. Built by ``Program`` once per compile."""

    def __init__(self, plan: RankPlan, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> None:
        self.plan = plan
        self._tables = {"src": src, "dst": dst}
        self._bases: dict[tuple[str, str], torch.Tensor] = {}

    def tensor(self, side: str, key: str) -> torch.Tensor:
        try:
            return self._tables[side][key]
        except KeyError:
            raise LayoutError(f"rank {self.plan.rank}: local tensor {key!r} ({side}) is missing "
                              "from the model") from None

    def base(self, side: str, key: str) -> torch.Tensor:
        """The local tensor detached (an alias: its storage, offset, sizes and strides),
        made once per compile."""
        base = self._bases.get((side, key))
        if base is None:
            base = self._bases[(side, key)] = self.tensor(side, key).detach()
        return base

    def view(self, side: str, key: str, box: Box) -> torch.Tensor:
        base = self.base(side, key)
        if box.ndim and (any(box.offset) or box.size != base.shape):
            return base[box.slices()]
        # the whole tensor: most boxes of a TP1 -> TP1 refit, and indexing costs ~10 us
        # each (4182 of them compiling qwen3-30b-a3b, 8 layers)
        return base

    def forget(self, side: str, key: str) -> None:
        """The tensor's storage changed (aliasing): views are taken afresh."""
        self._bases.pop((side, key), None)

    def used(self) -> list[tuple[str, str, torch.Tensor]]:
        """(side, key, tensor) of every local tensor the plan reads or writes, in a fixed order."""
        plan = self.plan
        used = {("src", c.src_key) for c in plan.local} | {("dst", c.dst_key) for c in plan.local}
        used |= {("src", t.key) for t in plan.sends} | {("dst", t.key) for t in plan.recvs}
        for q in plan.quantize:
            out = "src" if q.staged else "dst"
            used |= {("dst" if q.received else "src", q.src_key), (out, q.dst_key), (out, q.scale_key)}
        return [(side, key, self.tensor(side, key)) for side, key in sorted(used)]
