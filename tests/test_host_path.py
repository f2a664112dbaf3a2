"""Host work around a refit of a model of thousands of tensors on CPU.

* The per-refit binding check (``layout.binding.Binding.changed``) reads module
  dicts through ``dict.get`` in C, falls back to a Python helper for mapping models
  that are not dicts, and still reports a replaced tensor either way.
* Python's cyclic collector is paused while a Refitter is built and its program
  compiled (``torchrefit._util.gc_pause``): with the collector's threshold set low, no
  collection starts inside construction or the first compile of a MoE-shaped toy
  (1024 expert tensors per model): at most the one each paused region defers to its
  end, while the same process collects outside a refit; the
  collector's state is restored afterwards, also after an exception, and a caller's
  disabled collector stays disabled. The refit is checked against the oracle.
* Describing a model of thousands of whole tensors takes a shortcut: a single piece
  that is the whole local and global tensor is accepted without the tiling checks
  (``layout._types.TensorLayout``), and every other single piece is still checked
  (one whole-sized piece moved off the origin, globally or locally, is rejected).
* Building a Refitter walks each model's module tree once (``layout.walk``: the
  describe adapters and the binding share the walk; outside a construction every
  call walks afresh), and ``named_refit_tensors`` built from that walk yields what
  torch's ``named_parameters()`` does (a tied parameter once, under its first path; a
  shared submodule once; None skipped), or the model's own ``named_parameters`` where
  it overrides it. The refit is checked against the oracle.
* Compiling takes a box that is the whole tensor as the tensor itself (no indexing),
  and any other box, also one at the origin, as its slice (``execute.views.Views``).
* The benchmark's aggregation (``bench.runner._aggregate``) derives the device-time
  and flat-copy ratios from the samples it is given (figures worked out by hand).
"""

from __future__ import annotations

import gc
from collections.abc import MutableMapping
from contextlib import nullcontext

import pytest
import torch
from torch import nn

import torchrefit as tr
from torchrefit._util.gc_pause import gc_paused
from torchrefit.bench.config import BenchConfig
from torchrefit.bench.runner import _aggregate
from torchrefit.errors import LayoutError
from torchrefit.execute.views import Views
from torchrefit.layout import walk
from torchrefit.layout._described import named_refit_tensors
from torchrefit.layout._types import Box, Piece, TensorLayout
from torchrefit.layout.binding import Binding
from torchrefit.layout.sharding import whole_piece
from torchrefit.layout.walk import named_modules, shared_walks
from torchrefit.plan.types import RankPlan
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local, run_world


class _Store(MutableMapping):
    """A mapping model that is not a dict."""

    def __init__(self, d: dict) -> None:
        self._d = d

    def __getitem__(self, k):
        return self._d[k]

    def __setitem__(self, k, v) -> None:
        self._d[k] = v

    def __delitem__(self, k) -> None:
        del self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


def test_binding_of_modules_reads_dicts_in_c_and_sees_a_replacement() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    tensors = dict(model.named_parameters())
    binding = Binding(model, tensors, "dst")
    assert binding._get is dict.get and binding.changed() == {}
    new = nn.Parameter(torch.zeros(2, 4))
    model[1].weight = new
    assert binding.changed() == {"1.weight": new}


def test_binding_of_a_mapping_model_that_is_not_a_dict() -> None:
    store = _Store({"a": torch.zeros(3), "b": torch.ones(2)})
    binding = Binding(store, dict(store.items()), "src")
    assert binding._get is not dict.get and binding.changed() == {}
    store["b"] = torch.full((2,), 2.0)
    assert list(binding.changed()) == ["b"]
    del store["a"]
    assert binding.changed()["a"] is None


def test_whole_tensor_layouts_take_the_shortcut_and_others_are_still_checked() -> None:
    shape = (4, 6)
    assert whole_piece(torch.Size(shape)) is whole_piece(shape)  # one piece per shape
    TensorLayout("w", shape, "bfloat16", shape, whole_piece(shape))
    for piece in (Piece(Box((1, 0), shape), (0, 0)), Piece(Box((0, 0), shape), (0, 2))):
        with pytest.raises(LayoutError, match="outside"):
            TensorLayout("w", shape, "bfloat16", shape, (piece,))
    with pytest.raises(LayoutError, match="tile"):  # a whole-sized piece of a larger global tensor
        TensorLayout("w", (8, 6), "bfloat16", shape, (Piece(Box((0, 0), (2, 6)), (0, 0)),))


def test_gc_paused_restores_the_collector() -> None:
    @gc_paused
    def inside(fail: bool) -> bool:
        if fail:
            raise ValueError("boom")
        return gc.isenabled()

    assert gc.isenabled()
    assert inside(False) is False and gc.isenabled()
    with pytest.raises(ValueError):
        inside(True)
    assert gc.isenabled()
    gc.disable()
    try:
        inside(False)
        assert not gc.isenabled()  # the caller's choice stays
    finally:
        gc.enable()


SPEC = ModelSpec(layers=2, hidden=32, heads=4, groups=2, ffn=64, vocab=64, experts=256, expert_ffn=8)


def _collections_world(rank: int, world: int) -> dict:
    mesh = Mesh(1, ranks=1)
    src = build_toy(SPEC, mesh, rank, seed=1)
    dst = build_toy(SPEC, mesh, rank, seed=2)
    starts: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            starts.append(info["generation"])

    old = gc.get_threshold()
    gc.set_threshold(50, 2, 2)  # collections every few hundred allocations: frequent if allowed
    gc.callbacks.append(count)
    try:
        r = tr.Refitter(src, dst)
        r.refit()
        during = len(starts)
        enabled = gc.isenabled()
        junk = [[{}] for _ in range(2000)]  # the same process collects outside a refit
        outside = len(starts) - during
        del junk
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*old)
    want = expected_local(SPEC, mesh, rank, seed=1)
    got = dict(dst.named_parameters())
    wrong = [k for k, v in want.items() if k in got and not torch.equal(got[k].detach(), v)]
    return {"during": during, "outside": outside, "enabled": enabled, "wrong": wrong,
            "tensors": len(got), "compared": sum(k in got for k in want)}


def test_no_collection_while_a_refitter_builds_and_first_refits() -> None:
    (got,) = run_world(_collections_world, 1, timeout=300)
    assert got["tensors"] > 1000 and got["compared"] == got["tensors"], got
    assert got["wrong"] == [], got["wrong"][:3]
    assert got["enabled"] and got["outside"] > 0, got
    # each paused region leaves its allocations counted: one collection follows it at the
    # next allocation (after construction, after the first compile), not one per few hundred
    assert got["during"] <= 2, f"{got['during']} collections while building and first refitting"


def _walks_world(rank: int, world: int) -> dict:
    mesh = Mesh(1, ranks=1)
    src = build_toy(SPEC, mesh, rank, seed=1)
    dst = build_toy(SPEC, mesh, rank, seed=2)
    walks = {"src": 0, "dst": 0}
    sides, inside = {id(src): "src", id(dst): "dst"}, []
    real = walk._walk

    def counting_walk(root):  # every walk through torchrefit's walker, shared or not
        if id(root) in sides:
            walks[sides[id(root)]] += 1
        inside.append(root)
        try:
            return real(root)
        finally:
            inside.pop()
    walk._walk = counting_walk
    for side, model in (("src", src), ("dst", dst)):
        # ... and any walk of torch's from the root outside it (named_modules recurses with memo)
        def counting(*args, _side=side, _walk=model.named_modules, **kwargs):
            if not args and not kwargs and not inside:
                walks[_side] += 1
            return _walk(*args, **kwargs)
        model.named_modules = counting
    tr.Refitter(src, dst).refit()
    built = dict(walks)
    named_modules(src)
    named_modules(src)  # outside a construction nothing is kept
    want = expected_local(SPEC, mesh, rank, seed=1)
    got = dict(dst.named_parameters())
    wrong = [k for k, v in want.items() if not torch.equal(got[k].detach(), v)]
    return {"built": built, "after": walks["src"] - built["src"], "wrong": wrong, "compared": len(want)}


def test_each_model_is_walked_once_while_a_refitter_builds() -> None:
    (got,) = run_world(_walks_world, 1, timeout=300)
    assert got["built"] == {"src": 1, "dst": 1}, got["built"]
    assert got["after"] == 2
    assert got["compared"] > 1000 and got["wrong"] == [], got["wrong"][:3]


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 3)
        self.block = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
        self.again = self.block  # a shared submodule: walked once, under its first path
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, its first path
        self.register_parameter("unset", None)
        self.register_buffer("steps", torch.zeros(1))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


class _Renaming(_Tied):
    def named_parameters(self, *args, **kwargs):
        for name, p in super().named_parameters(*args, **kwargs):
            yield f"renamed.{name}", p


@pytest.mark.parametrize("shared", [False, True])
def test_named_refit_tensors_walks_as_torch_does(shared: bool) -> None:
    for cls in (_Tied, _Renaming):
        m = cls()
        with shared_walks() if shared else nullcontext():
            got = list(named_refit_tensors(m))
            assert named_modules(m) == list(m.named_modules())
        want = list(m.named_parameters()) + [("steps", m.steps)]
        assert [n for n, _ in got] == [n for n, _ in want], cls
        assert all(a is b for (_, a), (_, b) in zip(got, want))


def test_views_take_a_whole_box_as_the_tensor_and_slice_any_other() -> None:
    t = torch.arange(24.0).reshape(4, 6)
    views = Views(RankPlan(0, 1, (), (), ()), {"w": t}, {})
    for offset, size in [((0, 0), (4, 6)), ((0, 0), (4, 5)), ((0, 0), (3, 6)), ((1, 2), (3, 4))]:
        got = views.view("src", "w", Box(offset, size))
        want = t[tuple(slice(o, o + s) for o, s in zip(offset, size))]
        assert got.shape == want.shape and got.stride() == want.stride(), (offset, size)
        assert got.data_ptr() == want.data_ptr() and torch.equal(got, want), (offset, size)
    assert views.view("src", "w", Box((0, 0), (4, 6))).storage_offset() == 0


def test_aggregate_derives_device_and_flat_copy_ratios() -> None:
    cfg = BenchConfig(spec=ModelSpec(layers=1), variants=("graph",))
    row = {"impl": "torchrefit", "variant": "graph", "transport": "gloo", "bytes_local": 1000,
           "bytes_sent": 0, "bytes_received": 0, "pool_bytes": 0, "first_refit_s": 0.5,
           "peak_extra_bytes": 0, "times": [0.004, 0.006, 0.005], "hosts": [], "hosts_cold": [],
           "devices": [0.0042, 0.0044, 0.0040]}
    per_rank = [{"rows": [row], "bandwidth": 2000 / 0.004,  # floor: 2 x 1000 B at that rate = 4 ms
                 "params": 1, "model_bytes": 2, "dst_bytes": 1000,
                 "flat_copy": {"bytes": 1000, "times": [0.0041, 0.0045, 0.0043], "devices": [0.004]}}]
    (out,) = _aggregate(cfg, per_rank)
    assert out["floor_ms"] == pytest.approx(4.0)
    assert out["ratio_to_floor"] == pytest.approx(5.0 / 4.0)
    assert out["device_ms"] == pytest.approx(4.2) and out["device_ratio_to_floor"] == pytest.approx(4.2 / 4.0)
    assert out["flat_copy_ms"] == pytest.approx(4.3) and out["ratio_to_flat_copy"] == pytest.approx(5.0 / 4.3)
    assert out["flat_copy_device_ms"] == pytest.approx(4.0)
    del per_rank[0]["flat_copy"]
    row["devices"] = []
    (bare,) = _aggregate(cfg, per_rank)
    assert bare["ratio_to_flat_copy"] is None and bare["device_ratio_to_floor"] is None
