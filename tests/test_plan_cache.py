"""``Refitter(plan_cache=...)``: plans kept across Refitters (``tr.PlanCache``).

Pure: the key of a plan is equal only for arguments that plan alike: name maps by their
``cache_key()`` (equal tables, equal keys), a map class that does not say what identifies
it by the object itself, which the key holds alive (so no later object can take its
address and its plan); ``cast`` and ``skip`` by value; a bounded cache drops the oldest.

On 2 real CPU processes (gloo): a second Refitter between the same layouts takes the first
one's plan (``reused``) and refits exactly (checked against the toy's oracle, not
``verify()``); a different name map, or a different instance of a map that has no
``cache_key()``, plans anew; the same instance reuses.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import torchrefit as tr
from torchrefit.plan.cache import frozen
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local, run_world

SPEC = ModelSpec(layers=2)


class _Plain(tr.maps.NameMap):
    """A map with no ``cache_key()``: only the object itself identifies it."""


def test_keys_are_equal_only_for_arguments_that_plan_alike() -> None:
    assert frozen(tr.maps.Rename({"a": "b"})) == frozen(tr.maps.Rename({"a": "b"}))
    assert frozen(tr.maps.Rename({"a": "b"})) != frozen(tr.maps.Rename({"a": "c"}))
    assert frozen(tr.maps.Identity()) == frozen(tr.maps.Identity())
    one, two = _Plain(), _Plain()
    assert frozen(one) == frozen(one) and frozen(one) != frozen(two)
    assert frozen(True) != frozen("buffers") and frozen(True) != frozen(1)
    assert frozen(("*.bias",)) == frozen(("*.bias",)) != frozen(())
    key = frozen(one)
    alive = weakref.ref(one)
    del one
    gc.collect()
    assert alive() is not None, "the key must hold the map it stands for"
    del key
    gc.collect()
    assert alive() is None


def test_a_bounded_cache_drops_the_oldest() -> None:
    plans = tr.PlanCache(most=2)
    for k in "abc":
        plans.put(k, k.upper())
    assert len(plans) == 2 and plans.get("a") is None and plans.get("c") == "C"
    assert (plans.built, plans.reused) == (3, 1)
    with pytest.raises(ValueError):
        tr.PlanCache(most=0)


def _world(rank: int, world: int) -> dict:
    mesh_s, mesh_d = Mesh(2, ranks=2), Mesh(1, ranks=2)
    src = build_toy(SPEC, mesh_s, rank, 1)
    plans = tr.PlanCache()
    plain = _Plain()

    def refitter(**kw) -> tr.Refitter:
        dst = build_toy(SPEC, mesh_d, rank, 2)
        return tr.Refitter(src, dst, plan_cache=plans, **kw), dst

    out = {}
    first, _ = refitter()
    out["first"] = (plans.built, plans.reused)
    second, dst = refitter()
    out["second"] = (plans.built, plans.reused)
    out["same_plan"] = second.plan is first.plan
    second.refit()
    want = expected_local(SPEC, mesh_d, rank, 1)
    out["exact"] = all(torch.equal(v, want[k]) for k, v in dst.state_dict().items())
    refitter(name_map=tr.maps.Rename({"never.{}": "matched.{}"}))
    out["renamed"] = (plans.built, plans.reused)
    refitter(name_map=plain)
    refitter(name_map=_Plain())
    out["plain"] = (plans.built, plans.reused)
    refitter(name_map=plain)
    out["plain_again"] = (plans.built, plans.reused)
    return out


def test_refitters_between_the_same_layouts_share_a_plan() -> None:
    for got in run_world(_world, 2, timeout=120):
        assert got["first"] == (1, 0) and got["second"] == (1, 1) and got["same_plan"]
        assert got["exact"]
        assert got["renamed"] == (2, 1)  # another map: planned anew
        assert got["plain"] == (4, 1)  # two objects of a map class with no cache_key(): two plans
        assert got["plain_again"] == (4, 2)
