"""The optional C++ form of ``watch="every"``'s per-refit checks (``torchrefit._native.watch``).

Built once per test run into a temporary cache (``conftest.native_cache``; skipped where
no C++ compiler builds it). Its
two answers must be "unchanged" exactly when the Python checks' are, for every way a
tensor or its holder changes (the Python expressions are the oracle, computed apart);
and a Refitter that has it must use it and still refit exactly after each change
(oracle: the source model's tensors, read directly).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from torch import nn

import torchrefit as tr
from torchrefit import settings
from torchrefit._native import watch as native
from torchrefit.layout.binding import Binding
from torchrefit.testing import run_world


@pytest.fixture(scope="module")
def built(native_cache: str) -> str:
    patch = pytest.MonkeyPatch()
    patch.setenv("TORCHREFIT_KERNEL_CACHE", native_cache)
    patch.delenv(settings.ENV["native_watch"], raising=False)
    settings.reload()
    assert native.module(fresh=True) is not None
    yield native_cache
    patch.undo()


def _params(n: int = 4) -> list[nn.Parameter]:
    """``n`` 8 x 8 weights and an empty one (no bytes, still "unchanged" when it is)."""
    return [*(nn.Parameter(torch.randn(8, 8)) for _ in range(n)), nn.Parameter(torch.empty(0, 8))]


def _python_unchanged(watched: list[torch.Tensor], refs: list[torch.Tensor], pointers: list[int]) -> bool:
    return (list(map(torch.Tensor.data_ptr, watched)) == pointers
            and all(map(torch.Tensor.is_set_to, watched, refs)))


def _resize_in_place(p: torch.Tensor) -> torch.Tensor:
    """Resize ``p``'s storage to 0 and back, its freed bytes taken by a tensor of the
    same size in between (the allocator's most recent free block of that size), so
    that the storage comes back elsewhere; returns that tensor (keep it alive)."""
    storage = p.untyped_storage()
    n = storage.nbytes()
    storage.resize_(0)
    filler = torch.empty(n, dtype=torch.uint8)
    storage.resize_(n)
    return filler


def _offset(p: torch.Tensor) -> None:
    base = torch.randn(65)
    p.data = base[1:].view(8, 8)


VIEW_CHANGES: dict[str, Callable[[torch.Tensor], object]] = {
    "moved": lambda p: setattr(p, "data", torch.randn(8, 8)),
    "transposed in place (square: same sizes)": lambda p: setattr(p, "data", p.data.t()),
    "narrower": lambda p: setattr(p, "data", p.data[:4]),
    "flattened": lambda p: setattr(p, "data", p.data.view(-1)),
    "offset": _offset,
    "set_ to another storage": lambda p: p.set_(torch.randn(8, 8).untyped_storage(), 0, (8, 8), (8, 1)),
}


@pytest.mark.parametrize("change", ["none", *VIEW_CHANGES])
def test_views_answer_as_the_python_check(built: str, change: str) -> None:
    params = _params()
    refs = [p.detach() for p in params]
    check = native.views_check(tuple(params), tuple(refs))
    pointers = [p.data_ptr() for p in params]
    assert check.unchanged() and _python_unchanged(params, refs, pointers)
    if change != "none":
        with torch.no_grad():
            VIEW_CHANGES[change](params[2])
        assert not _python_unchanged(params, refs, pointers)
    assert check.unchanged() is _python_unchanged(params, refs, pointers)


def test_a_storage_resized_in_place_is_seen_wherever_its_address_moved(built: str) -> None:
    """FSDP's resize to 0 and back keeps the storage and may move its bytes: the
    answer must follow the address, as the Python check's pointers do."""
    params = _params()
    refs = [p.detach() for p in params]
    check = native.views_check(tuple(params), tuple(refs))
    pointers = [p.data_ptr() for p in params]
    filler = _resize_in_place(params[1])
    assert params[1].data_ptr() != pointers[1], "the storage came back at its address: nothing tested"
    assert params[1].untyped_storage()._cdata == refs[1].untyped_storage()._cdata  # the same storage
    assert not _python_unchanged(params, refs, pointers) and not check.unchanged()
    del filler


def test_restored_views_are_unchanged_again(built: str) -> None:
    params = _params()
    refs = [p.detach() for p in params]
    check = native.views_check(tuple(params), tuple(refs))
    with torch.no_grad():
        params[0].data = params[0].data.t()
        assert not check.unchanged()
        params[0].data = refs[0]
    assert check.unchanged()


def test_collapse_covers_each_region_of_the_watched_metadata_once(built: str) -> None:
    """``Views.collapse`` asks for one huge page per 2 MiB region holding a watched
    tensor's TensorImpl or its StorageImpl (oracle: those addresses from torch's
    ``_cdata``); what it makes huge pages changes no answer."""
    params = _params(600)
    refs = [p.detach() for p in params]
    check = native.views_check(tuple(params), tuple(refs))
    objects = [p._cdata for p in params] + [p.untyped_storage()._cdata for p in params]
    assert sorted(check.regions) == sorted({a >> 21 for a in objects})
    regions, done = check.collapse()
    assert regions == len(check.regions) and 0 <= done <= regions, (regions, done)
    assert check.unchanged()
    with torch.no_grad():
        params[300].data = torch.randn(8, 8)
    assert not check.unchanged()


def test_huge_pages_start_at_the_first_check_of_many_views_unless_told(built: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """From ``COLLAPSE_MIN`` views on, ``views_check`` asks for huge pages, and the first
    ``unchanged()`` (the second refit's, after the one that compiled) starts them on a
    thread of its own, once; fewer views: never."""
    monkeypatch.setattr(native, "COLLAPSE_MIN", 6)
    pending = []
    for n in (4, 5):  # _params(n) holds n + 1 tensors
        params = _params(n)
        check = native.views_check(tuple(params), tuple(p.detach() for p in params))
        before = check.collapse_pending
        assert check.unchanged() and check.unchanged()
        pending.append((before, check.collapse_pending))
    assert pending == [(False, False), (True, False)], pending


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8, bias=False)
        self.register_buffer("scale", torch.ones(8))


HOLDER_CHANGES: dict[str, Callable[[_Net], object]] = {
    "parameter replaced": lambda m: setattr(m.a, "weight", nn.Parameter(torch.randn(8, 8))),
    "buffer replaced": lambda m: setattr(m, "scale", torch.zeros(8)),
    "parameter removed": lambda m: m.b._parameters.pop("weight"),
    "set to None": lambda m: setattr(m.a, "bias", None),
}


@pytest.mark.parametrize("change", ["none", "the same tensor set again", *HOLDER_CHANGES])
def test_holders_answer_as_the_python_check(built: str, change: str) -> None:
    model = _Net()
    binding = Binding(model, dict(model.state_dict(keep_vars=True)), "dst")
    fast = binding._native
    assert fast is not None and fast.unchanged()

    def python_unchanged() -> bool:
        return all(d.get(n) is h for d, n, h in zip(binding._dicts, binding._names, binding._held))

    if change == "the same tensor set again":
        model.a.weight = model.a.weight
    elif change != "none":
        HOLDER_CHANGES[change](model)
        assert not python_unchanged()
    assert fast.unchanged() is python_unchanged()
    assert (binding.changed() == {}) is python_unchanged()


def test_holders_watch_their_dicts_where_python_can(built: str) -> None:
    """After a full look, holders answer from their dicts' changes without looking them
    up (Python 3.12+: a count of changes to watched dicts; before: each dict's version
    tag); a change, even one put back, makes the next answer a full look."""
    model, other = _Net(), _Net()
    fast, other_fast = (Binding(m, dict(m.state_dict(keep_vars=True)), "dst")._native for m in (model, other))
    assert fast.watched
    assert fast.unchanged() and fast.unchanged() and other_fast.unchanged()
    original = model.a.weight
    model.a.weight = nn.Parameter(torch.randn(8, 8))
    assert not fast.unchanged() and not fast.unchanged()
    model.a.weight = original  # put back: the full look finds the very objects again
    assert fast.unchanged()
    other.b.weight = nn.Parameter(torch.randn(8, 8))  # another model's: this one's answer stays
    assert fast.unchanged() and not other_fast.unchanged()
    model.scale = torch.zeros(8)  # a buffer dict: watched as well
    assert not fast.unchanged()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _native_world(rank: int, world: int) -> dict:
    src, dst = _Net(), _Net()
    r = tr.Refitter(src, dst)  # watch="every", the default
    out: dict = {"native views": None, "native holders": [], "wrong": []}

    def refit_and_compare(step: str) -> None:
        with torch.no_grad():
            for p in src.parameters():
                p.add_(1.0)
        r.refit()
        want = {k: _bits(v) for k, v in src.state_dict().items()}
        got = {k: _bits(v) for k, v in dst.state_dict().items()}
        out["wrong"] += [f"{k} after {step}" for k in want if not torch.equal(want[k], got[k])]

    refit_and_compare("the first refit")
    out["native views"] = r._program.compiled.native is not None and r._program.compiled.native.unchanged()
    out["native holders"] = [b._native is not None and b._native.unchanged() for b in r._bindings.values()]
    with torch.no_grad():
        dst.a.weight.data = torch.zeros(8, 8)  # the engine re-allocated a weight
        refit_and_compare("a destination moved")
        dst.b.weight.data = dst.b.weight.data.t()  # re-viewed in place, same sizes
        refit_and_compare("a destination transposed in place")
        src.a.weight.data = src.a.weight.data.clone()  # the trainer's storage moved
        refit_and_compare("a source moved")
    dst.a.weight = nn.Parameter(torch.zeros(8, 8))  # replaced in its module
    refit_and_compare("a destination replaced")
    out["native again"] = r._program.compiled.native is not None and r._program.compiled.native.unchanged()
    # the holders' check made again over the tensors now held (the old one held the replaced one)
    out["native holders again"] = [b._native is not None and b._native.unchanged() for b in r._bindings.values()]
    return out


def test_a_refitter_uses_it_and_refits_exactly_after_every_change(built: str) -> None:
    assert os.environ["TORCHREFIT_KERNEL_CACHE"] == built  # the spawned rank finds the build
    (got,) = run_world(_native_world, 1, timeout=120)
    assert got["wrong"] == [], got
    assert got["native views"] and got["native holders"] and all(got["native holders"]), got
    assert got["native again"] and all(got["native holders again"]), got


def test_unused_where_unbuilt_without_a_cache_or_off(built: str, tmp_path) -> None:
    settings.configure(kernel_cache=str(tmp_path / "kernels"))  # nothing built there
    assert native.module() is None and native.views_check((), ()) is None
    settings.configure(kernel_cache="0")
    assert native.built_path() is None and native.module() is None
    settings.reload()
    assert native.module() is not None
    settings.configure(native_watch=False)
    assert native.module() is None and native.views_check((), ()) is None


def test_the_command_says_whether_refits_use_it(built: str, tmp_path,
                                                capsys: pytest.CaptureFixture) -> None:
    from torchrefit.cli import main

    assert main(["native", "status"]) == 0
    assert "torchrefit native: used (" in capsys.readouterr().out
    settings.configure(kernel_cache=str(tmp_path / "kernels"))  # nothing built there
    assert main(["native", "status"]) == 0
    assert "torchrefit native: not used (" in capsys.readouterr().out


def test_what_it_cannot_hold_is_left_to_the_python_checks(built: str) -> None:
    from collections import OrderedDict

    t = torch.zeros(2)
    assert native.holders_check([OrderedDict(w=t)], ["w"], [t]) is None  # not a plain dict: no raise
    assert native.views_check((t,), ()) is None  # mismatched lists


def test_no_collection_while_a_refitter_builds_and_first_refits_with_it(built: str) -> None:
    """The native holders check is made inside construction's collector pause (made at
    the first refit, its lists of every holder set off a collection there)."""
    from test_host_path import _collections_world

    (got,) = run_world(_collections_world, 1, timeout=300)
    assert got["wrong"] == [] and got["enabled"], got
    assert got["during"] <= 2, f"{got['during']} collections while building and first refitting"
