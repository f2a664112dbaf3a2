"""What a benchmark run measures: model shape, layouts, mode, transport, variants."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch

from ..testing.toy import Mesh, ModelSpec

__all__ = ["BenchConfig", "parse_layout", "PRESETS", "VARIANTS"]

#: model shapes by name; ``gpt-4b`` is the seed's benchmark model (Megatron defaults:
#: 4x MLP without gating, biases, untied output layer: 4.46 B parameters)
PRESETS: dict[str, dict] = {
    "gpt-4b": dict(layers=20, hidden=4096, heads=32, groups=32, ffn=16384, vocab=50304, swiglu=False),
    "tiny": dict(layers=2, hidden=64, heads=4, groups=2, ffn=128, vocab=256, swiglu=True),
}

#: how the executor runs: eager copies, CUDA-graph replay of local copies (the default),
#: shared storage
VARIANTS = {
    "plain": {"cuda_graph": False},
    "graph": {"cuda_graph": True},
    "share": {"share_storage": True},
}

_LAYOUT = re.compile(r"(tp|pp|ep|etp|dp)(\d+)")


def parse_layout(text: str) -> dict[str, int]:
    """``"tp2pp2ep4etp1"`` -> ``{"tp": 2, "pp": 2, "ep": 4, "etp": 1}`` (dp where given)."""
    text = text.strip().lower()
    parts = _LAYOUT.findall(text)
    if not parts or "".join(f"{k}{v}" for k, v in parts) != text:
        raise ValueError(f"cannot read layout {text!r}; write it like tp2pp2ep4 (tp, pp, ep, etp, dp)")
    out = {k: int(v) for k, v in parts}
    if any(v < 1 for v in out.values()):
        raise ValueError(f"layout {text!r}: sizes must be positive")
    return out


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark configuration (all ranks of one world)."""

    spec: ModelSpec
    src: str = "tp1"
    dst: str = "tp1"
    mode: str = "collocated"  # or "non-collocated"
    transport: str = "auto"
    nproc: int = 1
    warmup: int = 5
    iters: int = 30
    variants: tuple[str, ...] = ("plain",)
    compare: str | None = None  # "megatron-core"
    label: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in ("collocated", "non-collocated"):
            raise ValueError(f"mode must be collocated or non-collocated, not {self.mode!r}")
        for v in self.variants:
            if v not in VARIANTS:
                raise ValueError(f"unknown variant {v!r}; choose from {sorted(VARIANTS)}")

    def meshes(self) -> tuple[Mesh, Mesh]:
        """Source and destination meshes over this world's ranks."""
        s, d = parse_layout(self.src), parse_layout(self.dst)
        if self.mode == "collocated":
            return _mesh(s, self.nproc, 0), _mesh(d, self.nproc, 0)
        ns, nd = _ranks(s), _ranks(d)
        if ns + nd > self.nproc:
            raise ValueError(f"non-collocated {self.src} -> {self.dst} needs {ns + nd} processes, "
                             f"got {self.nproc}")
        return _mesh(s, ns, 0), _mesh(d, nd, ns)

    def with_(self, **kw) -> BenchConfig:
        return replace(self, **kw)

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype


def _ranks(layout: dict[str, int]) -> int:
    dense = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1)
    experts = layout.get("ep", 1) * layout.get("etp", layout.get("tp", 1)) * layout.get("pp", 1)
    return max(dense, experts)


def _mesh(layout: dict[str, int], ranks: int, offset: int) -> Mesh:
    return Mesh(tp=layout.get("tp", 1), pp=layout.get("pp", 1), ep=layout.get("ep", 1),
                etp=layout.get("etp"), ranks=ranks, offset=offset)
