"""What a benchmark run measures: model shape, layouts, mode, transport, variants."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..execute.staged import STAGING
from ..refitter import WATCH_MODES
from ..settings import Settings
from ..simulate.meshes import Mesh, min_ranks, parse_mesh
from ..simulate.shapes import preset
from ..testing.toy import ModelSpec

__all__ = ["BenchConfig", "spec_from_preset", "VARIANTS"]

#: how the executor runs: eager copies, CUDA-graph replay of local copies (the default),
#: shared storage
VARIANTS = {
    "plain": {"cuda_graph": False},
    "graph": {"cuda_graph": True},
    "share": {"share_storage": True},
}


def spec_from_preset(name: str, **overrides) -> ModelSpec:
    """The toy model spec of a ``torchrefit.simulate`` preset (the one preset table).

    Toy models have no learned position embeddings and only weight layer norms, so
    ``gpt-4b`` comes to 4.44 B parameters here against 4.46 B in megatron-core.
    """
    shape = preset(name)
    if shape.mla or shape.dense_layers or shape.shared_expert_ffn:
        raise ValueError(f"preset {name!r} has features toy models lack (MLA, mixed dense and "
                         "MoE layers, shared experts); pass shape flags instead")
    fields = dict(layers=shape.layers, hidden=shape.hidden, heads=shape.heads, groups=shape.kv_heads,
                  ffn=shape.ffn, vocab=shape.vocab, swiglu=shape.swiglu, bias=shape.bias,
                  tie=shape.tie, experts=shape.experts, dtype=getattr(torch, shape.dtype))
    if shape.experts:
        fields["expert_ffn"] = shape.expert_ffn
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return ModelSpec(**fields)


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
    name_map: str | None = None  # "hf": a Hugging Face-named engine through megatron_to_hf
    fp8: bool = False  # with name_map "hf": block FP8 projections and experts
    watch: str = "every"  # Refitter(watch=...): "manual" skips the per-refit tensor checks
    stage: bool = False  # also time stage() and commit() against a plain refit, in one run
    staging: str = "device"  # Refitter(staging=...) for the staged row: "device" | "host"
    #: applied in every rank's process before its models are built (the ranks are spawned,
    #: so the caller's ``settings.configure`` does not reach them); None: each rank's own
    settings: Settings | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("collocated", "non-collocated"):
            raise ValueError(f"mode must be collocated or non-collocated, not {self.mode!r}")
        if self.name_map not in (None, "hf"):
            raise ValueError(f"--map must be hf, not {self.name_map!r}")
        if self.fp8 and self.name_map != "hf":
            raise ValueError("--fp8 quantizes a Hugging Face-named engine: pass --map hf too")
        if self.name_map and (self.dst != "tp1" or self.compare):
            raise ValueError("--map hf builds a whole engine on every rank (--dst tp1, no --compare)")
        if self.staging not in STAGING:
            raise ValueError(f"--staging must be one of {STAGING}, not {self.staging!r}")
        if self.watch not in WATCH_MODES:
            raise ValueError(f"--watch must be one of {WATCH_MODES}, not {self.watch!r}")
        for v in self.variants:
            if v not in VARIANTS:
                raise ValueError(f"unknown variant {v!r}; choose from {sorted(VARIANTS)}")

    def meshes(self) -> tuple[Mesh, Mesh]:
        """Source and destination meshes over this world's ranks (layout strings as in
        ``torchrefit plan``). Non-collocated without ``@START:END``: the source takes the
        first ranks it needs, the destination the ones after."""
        src, dst = self.src, self.dst
        if self.mode == "non-collocated" and "@" not in src + dst:
            ns, nd = min_ranks(src), min_ranks(dst)
            if ns + nd > self.nproc:
                raise ValueError(f"non-collocated {src} -> {dst} needs {ns + nd} processes, "
                                 f"got {self.nproc}")
            src, dst = f"{src}@0:{ns}", f"{dst}@{ns}:{ns + nd}"
        return parse_mesh(src, self.nproc), parse_mesh(dst, self.nproc)

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

