"""The toy GPT that tests and benchmarks build stands on the simulator's mesh and split.

* Its pipeline split: where PP does not divide the layer count, the stages
  together still hold every layer exactly once (the split is
  ``simulate.shapes.stage_layers``, as even as can be), and each stage numbers its
  layers from its first global layer.
* Its mesh is the one mesh (``testing.Mesh`` is ``simulate.Mesh``, layout strings
  included): every rank's process-group indices follow Megatron-core's order,
  checked against an enumeration of that order written with nested loops.
* Its tensors are the simulator's: every rank of a grid of shapes (dense, biases,
  GELU, tied, MoE with and without router buffers, grouped experts, Mamba, layers
  PP does not divide) and meshes describes itself, through the Megatron adapter
  reading the toy's parameter attributes, as the very layout
  ``simulate.layout_of`` cuts from the shape's table without a tensor; and that
  layout is checked against the toy's values: each piece's local block holds the
  global tensor's values at the piece's box (global values cut with torch ops).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import torchrefit.simulate as sim
import torchrefit.testing as testing
from torchrefit.layout import describe
from torchrefit.simulate.shapes import stage_layers
from torchrefit.testing import Mesh, ModelSpec, build_toy
from torchrefit.testing.toy import global_value


@pytest.mark.parametrize("layers,pp", [(5, 2), (4, 3), (7, 4), (3, 3), (8, 2)])
def test_pipeline_stages_hold_every_layer_once(layers: int, pp: int) -> None:
    spec = ModelSpec(layers=layers, hidden=8, heads=2, groups=1, ffn=8, vocab=16)
    held = []
    for stage in range(pp):
        model = build_toy(spec, Mesh(1, pp, ranks=pp), stage, seed=1)
        numbers = [m.layer_number for m in model.decoder.layers.children()]
        assert [n - 1 for n in numbers] == list(stage_layers(layers, pp, stage))
        held += numbers
    assert sorted(held) == list(range(1, layers + 1))


def _megatron_order(tp: int, pp: int, ep: int, etp: int, ranks: int) -> dict[int, dict[str, int]]:
    """Rank -> group indices, enumerated in Megatron-core's order: TP fastest, then DP,
    then PP; for experts expert-TP fastest, then EP, then expert-DP, then PP."""
    dp, edp = ranks // (tp * pp), ranks // (etp * ep * pp)
    out: dict[int, dict[str, int]] = {}
    for rank, (p, d, t) in enumerate(itertools.product(range(pp), range(dp), range(tp))):
        out[rank] = {"tp": t, "dp": d, "pp": p}
    for rank, (_, _, e, t) in enumerate(itertools.product(range(pp), range(edp), range(ep), range(etp))):
        out[rank].update(ep=e, expt_tp=t)
    return out


@pytest.mark.parametrize("layout,ranks", [("tp2pp2", 8), ("tp2ep2", 4), ("tp2pp2ep4etp1", 16),
                                          ("tp4ep2etp2", 8), ("pp2ep2", 4)])
def test_toy_groups_follow_megatron_order(layout: str, ranks: int) -> None:
    mesh = sim.parse_mesh(layout, ranks)
    assert Mesh is sim.Mesh and testing.Coords is sim.Coords
    spec = ModelSpec(layers=2, hidden=8, heads=2, groups=1, ffn=8, vocab=16, experts=4, expert_ffn=8)
    want = _megatron_order(mesh.tp, mesh.pp, mesh.ep, mesh.etp, ranks)
    for rank in range(ranks):
        pg = build_toy(spec, mesh, rank, seed=1).pg_collection
        got = {k: getattr(pg, k).rank() for k in ("tp", "dp", "pp", "ep", "expt_tp")}
        assert got == want[rank], (layout, rank)


SHAPES = {
    "dense": ModelSpec(), "no-bias": ModelSpec(bias=False), "gelu": ModelSpec(swiglu=False),
    "tied": ModelSpec(tie=True), "moe": ModelSpec(experts=4), "moe-router-bias": ModelSpec(experts=4, router_bias=True),
    "moe-grouped": ModelSpec(experts=4, grouped_experts=True, swiglu=False), "mamba": ModelSpec(mamba=True),
    "5-layers": ModelSpec(layers=5), "bf16": ModelSpec(dtype=torch.bfloat16),
}
MESHES = ["tp2", "tp2pp2", "pp3@1:4", "tp2ep2", "ep4", "tp2pp2ep2etp1"]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_toy_rosters_are_the_simulators(name: str) -> None:
    spec = SHAPES[name]
    for layout in MESHES:
        mesh = sim.parse_mesh(layout, 8 if "etp" in layout else 4)
        if (mesh.ep > 1) != bool(spec.experts):
            continue
        for rank in range(mesh.end):
            model = build_toy(spec, mesh, rank, seed=1)
            c = mesh.coords(rank)
            if c is None:
                assert model is None
                continue
            toy = describe(model, None).layout
            simulated = sim.layout_of(spec.shape(), mesh, c)
            # the same entries (module order may differ: the planner sorts by name)
            assert dict(toy.tensors) == dict(simulated.tensors), (name, layout, rank)
            assert len(toy.tensors) == len(simulated.tensors) and toy.aliases == simulated.aliases
            _pieces_hold_their_values(model, simulated, spec, (name, layout, rank))


def _pieces_hold_their_values(model, layout, spec: ModelSpec, where: tuple) -> None:
    """The independent check: every piece of the description says where the model's
    tensor holds which values of which global tensor, against the global values
    themselves (the toy cuts them with torch.chunk and torch.split, not with the
    description's ``shard_pieces``), and the pieces leave no local element out."""
    held = dict(model.named_parameters()) | dict(model.named_buffers())
    for key, t in layout.tensors:
        local = held[key].detach()
        assert tuple(local.shape) == t.local_shape and str(local.dtype) == f"torch.{t.dtype}", (where, key)
        g = global_value(t.name, t.global_shape, 1, spec).to(local.dtype)
        seen = torch.zeros(local.shape, dtype=torch.int32)
        for p in t.pieces:
            assert torch.equal(local[p.local_box.slices()], g[p.box.slices()]), (where, key, p)
            seen[p.local_box.slices()] += 1
        assert bool((seen == 1).all()), (where, key, "pieces do not tile the local tensor")
