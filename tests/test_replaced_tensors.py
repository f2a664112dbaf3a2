"""A tensor replaced or reallocated between refits (``torchrefit.layout.binding``).

Two gloo processes, a TP2 trainer into a TP1 engine (local copies and messages both).
Between two refits the model changes under the Refitter, the way engines and trainers
do (sleep / wake, re-wrapping, ``param.data = new``, ``module.weight = Parameter(new)``)
on both sides, and then on the destination sits new storage that is zeroed first. Each
case checks the destination against an oracle (``expected_local``: values computed
from the random seed, not by torchrefit) and that the storage the model dropped was neither
written (destination) nor read (source: the dropped storage is zeroed, so reading it
would show). A replacement that no longer fits (another shape) raises
:class:`LayoutError` naming the tensor on the rank that has it, before anything is
written there; over a group of two its peer raises :class:`TransportError` naming
that rank within the timeout. A mapping model whose entry is replaced is rebound too.
A tensor that keeps its storage but views it another way (``param.data =
param.data.t()``, a narrower view) is followed, or raises where its shape changed, and
so is one whose storage was resized to nothing and back (the same storage object at a
new address).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import torchrefit as tr
from torchrefit.testing import (
    Mesh,
    ModelSpec,
    build_toy,
    expected_local,
    run_world,
    usable_transports,
)

SPEC = ModelSpec(layers=2)
SRC, DST = Mesh(2, ranks=2), Mesh(1, ranks=2)
SENTINEL = -7.0


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def _put(model: nn.Module, name: str, p: nn.Parameter, new: torch.Tensor, how: str) -> None:
    """Give parameter ``name`` the storage ``new``: moved in place (``how == "data"``) or
    as a new Parameter set on its module."""
    if how == "data":
        p.data = new
    else:
        module, attr = _owner(model, name)
        setattr(module, attr, nn.Parameter(new))


def _wrong(dst, rank: int, mesh: Mesh = DST) -> list[str]:
    want = expected_local(SPEC, mesh, rank, 1)
    return sorted(k for k, v in dst.state_dict().items() if not torch.equal(v, want[k]))


def _untouched(old: list[torch.Tensor]) -> bool:
    return all(bool((t == SENTINEL).all()) for t in old)


def _replace_dst(dst: nn.Module, how: str) -> list[torch.Tensor]:
    """Give every destination parameter new zeroed storage; the old storage (filled
    with SENTINEL) is what a stale refit would write."""
    old = []
    with torch.no_grad():
        for name, p in list(dst.named_parameters()):
            old.append(p.data)
            p.data.fill_(SENTINEL)
            _put(dst, name, p, torch.zeros_like(p), how)
    return old


def _replace_src(src: nn.Module, how: str) -> None:
    """Move every source parameter to a copy and zero the storage it leaves."""
    with torch.no_grad():
        for name, p in list(src.named_parameters()):
            old = p.data
            _put(src, name, p, p.detach().clone(), how)
            old.zero_()  # a stale read would now copy zeros


def _case(rank: int, side: str, how: str) -> dict:
    src = build_toy(SPEC, SRC, rank, 1)
    dst = build_toy(SPEC, DST, rank, 2)
    r = tr.Refitter(src, dst)
    r.refit()
    out = {"first": _wrong(dst, rank)}
    with torch.no_grad():
        for p in dst.parameters():
            p.zero_()
    old = _replace_dst(dst, how) if side == "dst" else []
    if side == "src":
        _replace_src(src, how)
    report = r.refit()
    out.update(second=_wrong(dst, rank), untouched=_untouched(old), compiled=report.compiled)
    try:
        r.verify()  # the witness reads the model's current tensors too
        out["verify"] = None
    except tr.VerificationError as e:
        out["verify"] = str(e)
    return out


def _misfit(rank: int, how: str) -> dict:
    """A one-rank group: a destination tensor that changed shape."""
    import torch.distributed as dist

    me = dist.new_group([rank])
    src = build_toy(SPEC, Mesh(1, ranks=1), 0, 1)
    dst = build_toy(SPEC, Mesh(1, ranks=1), 0, 2)
    r = tr.Refitter(src, dst, group=me)
    r.refit()
    with torch.no_grad():
        for p in dst.parameters():
            p.fill_(SENTINEL)
    w = dst.decoder.final_layernorm
    if how == "data":
        w.weight.data = torch.zeros(w.weight.shape[0] + 1)
    else:
        w.weight = nn.Parameter(torch.zeros(w.weight.shape[0] + 1))
    try:
        r.refit()
        return {"raised": None}
    except tr.LayoutError as e:
        others = [p for n, p in dst.named_parameters() if n != "decoder.final_layernorm.weight"]
        return {"raised": str(e), "tensor": e.tensor, "written": not _untouched(others)}


def _reviewed(rank: int) -> dict:
    """A one-rank group, TP1 -> TP1: tensors that keep their storage but view it another
    way (``param.data = param.data.t()``: other strides; a narrower shape), on either
    side. Oracle: the source's tensors as they read now (the refit must follow the new
    view: a destination equal to its source, element for element)."""
    import torch.distributed as dist

    me = dist.new_group([rank])
    src = build_toy(SPEC, Mesh(1, ranks=1), 0, 1)
    dst = build_toy(SPEC, Mesh(1, ranks=1), 0, 2)
    r = tr.Refitter(src, dst, group=me)
    r.refit()
    square = "decoder.layers.1.self_attention.linear_proj.weight"  # (24, 24)

    def differing() -> list[str]:
        want = dict(src.named_parameters())
        return [n for n, p in dst.named_parameters() if not torch.equal(p, want[n])]

    out = {}
    for side, model in (("dst", dst), ("src", src)):
        with torch.no_grad():
            for p in dst.parameters():
                p.zero_()
            p = model.get_parameter(square)
            p.data = p.data.t()  # the same storage, its strides swapped
        report = r.refit()
        out[f"{side} transposed"] = {"differing": differing(), "compiled": report.compiled}
    for side, model in (("dst", dst), ("src", src)):
        with torch.no_grad():
            for p in dst.parameters():
                p.zero_()
            p = model.get_parameter(square)
            was = p.data_ptr()
            taken = _resize_in_place([p], None)
        report = r.refit()
        out[f"{side} resized"] = {"differing": differing(), "compiled": report.compiled,
                                  "moved": p.data_ptr() != was, "taken untouched": _untouched(taken)}
    narrow = dst.get_parameter("decoder.layers.0.mlp.linear_fc1.weight")  # (96, 24)
    with torch.no_grad():
        for p in dst.parameters():
            p.fill_(SENTINEL)
        narrow.data = narrow.data[:-1]  # the same first byte, one row less
    try:
        r.refit()
        out["narrowed"] = {"raised": None}
    except tr.LayoutError as e:
        out["narrowed"] = {"raised": str(e), "tensor": e.tensor, "written": not _untouched(list(dst.parameters()))}
    return out


def _resize_in_place(params, fill: float | None) -> list[torch.Tensor]:
    """Free each parameter's storage and give it new memory (the same storage object,
    as FSDP frees and re-gathers), its values kept (``fill`` None) or set to ``fill``.
    Returns tensors filled with SENTINEL that took the freed memory (mostly): a transfer
    to or from the old addresses would show in them or in the values."""
    taken = []
    with torch.no_grad():
        for p in params:
            values = p.detach().clone() if fill is None else torch.full_like(p, fill)
            was = p.data_ptr()
            for _ in range(8):  # until the new memory is elsewhere: the allocator decides
                p.untyped_storage().resize_(0)
                taken.append(torch.full((values.numel(),), SENTINEL))
                p.untyped_storage().resize_(values.nbytes)
                if p.data_ptr() != was:
                    break
            p.copy_(values)
    return taken


def _resized_one_sided(rank: int) -> dict:
    """Per one-sided transport usable here (nixl: registered addresses), storage resized
    in place on the destination, then on the source, a refit after each."""
    out = {}
    for name in usable_transports(cuda=False, one_sided_only=True):
        src = build_toy(SPEC, SRC, rank, 1)
        dst = build_toy(SPEC, DST, rank, 2)
        r = tr.Refitter(src, dst, transport=name)
        r.refit()
        got = {}
        for side, model, fill in (("dst", dst, 0.0), ("src", src, None)):
            taken = _resize_in_place(model.parameters(), fill)
            if side == "src":
                with torch.no_grad():
                    for p in dst.parameters():
                        p.zero_()
            r.refit()
            got[side] = {"wrong": _wrong(dst, rank), "taken untouched": _untouched(taken)}
        out[name] = got
    return out


def _mapping(rank: int) -> dict:
    """A model given as a dict of tensors, one entry replaced."""
    import torch.distributed as dist

    me = dist.new_group([rank])
    src = {"w": torch.arange(12.0).reshape(3, 4)}
    dst = {"w": torch.zeros(3, 4)}
    r = tr.Refitter(src, dst, group=me)
    r.refit()
    old = dst["w"]
    old.fill_(SENTINEL)
    dst["w"] = torch.zeros(3, 4)
    r.refit()
    return {"equal": torch.equal(dst["w"], src["w"]), "untouched": _untouched([old])}


def _one_at_a_time(rank: int) -> dict[str, list[str]]:
    """One tensor at a time moved (``.data``) or replaced (a new Parameter), each
    parameter of both sides in turn, a refit after each: the per-refit checks must
    notice every position, the first and the last one included. Returns, per way of
    changing, the tensors whose change a refit missed."""
    src = build_toy(SPEC, SRC, rank, 1)
    dst = build_toy(SPEC, DST, rank, 2)
    r = tr.Refitter(src, dst)
    r.refit()
    missed: dict[str, list[str]] = {"data": [], "parameter": []}
    for how in missed:
        for side, model in (("src", src), ("dst", dst)):
            for name, p in list(model.named_parameters()):
                with torch.no_grad():
                    old = p.data
                    new = p.detach().clone() if side == "src" else torch.zeros_like(p)
                    _put(model, name, p, new, how)
                    if side == "src":
                        old.zero_()  # a stale read would copy zeros
                    else:
                        old.fill_(SENTINEL)  # a stale write would overwrite this
                r.refit()
                if _wrong(dst, rank) or (side == "dst" and not _untouched([old])):
                    missed[how].append(f"{side} {name}")
    return missed


def _peer_world(rank: int, world: int) -> dict:
    out: dict = {"one at a time": _one_at_a_time(rank)}
    for side in ("dst", "src"):
        for how in ("data", "parameter"):
            out[f"{side}-{how}"] = _case(rank, side, how)
    out["misfit-data"] = _misfit(rank, "data")
    out["misfit-parameter"] = _misfit(rank, "parameter")
    out["mapping"] = _mapping(rank)
    out["reviewed"] = _reviewed(rank)
    out["resized one-sided"] = _resized_one_sided(rank)
    # last: over the group of two, rank 1's destination no longer fits
    src = build_toy(SPEC, SRC, rank, 1)
    dst = build_toy(SPEC, DST, rank, 2)
    r = tr.Refitter(src, dst, timeout=60.0)
    r.refit()
    r.timeout = r._transport.timeout = 5.0  # short for the failing refit only
    if rank == 1:
        w = dst.get_submodule("decoder.layers.0.mlp.linear_fc1")
        w.weight = nn.Parameter(torch.zeros(w.weight.shape[0], w.weight.shape[1] + 2))
    t0 = time.perf_counter()
    try:
        r.refit()
        out["peer"] = {"raised": None}
    except tr.RefitError as e:
        out["peer"] = {"raised": type(e).__name__, "msg": str(e), "tensor": e.tensor}
    out["peer"]["seconds"] = time.perf_counter() - t0
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(_peer_world, 2, timeout=400, pg_timeout=60)


@pytest.mark.parametrize("case", ["dst-data", "dst-parameter", "src-data", "src-parameter"])
def test_replaced_tensor_is_rebound(results, case: str) -> None:
    for rank, got in enumerate(results):
        got = got[case]
        assert got["first"] == [], (rank, got)
        assert got["second"] == [], f"rank {rank}: {case} left {got['second'][:3]} unlike the oracle"
        assert got["untouched"], f"rank {rank}: {case} wrote into storage the model dropped"
        assert got["verify"] is None, (rank, got["verify"])
        if case.endswith("parameter"):  # (``.data`` moves recompile inside the program)
            assert got["compiled"], f"rank {rank}: {case} did not recompile"


def test_each_position_is_checked(results) -> None:
    for rank, got in enumerate(results):
        assert got["one at a time"] == {"data": [], "parameter": []}, f"rank {rank}: {got['one at a time']}"


@pytest.mark.parametrize("how", ["data", "parameter"])
def test_replaced_tensor_of_another_shape_raises_before_writing(results, how: str) -> None:
    for rank, got in enumerate(results):
        got = got[f"misfit-{how}"]
        assert got["raised"] and "decoder.final_layernorm.weight" in got["raised"], (rank, got)
        assert got["tensor"] == "decoder.final_layernorm.weight" and "build a new Refitter" in got["raised"]
        assert not got["written"], f"rank {rank}: written before raising"


def test_mapping_model_entry_replaced(results) -> None:
    for got in results:
        assert got["mapping"] == {"equal": True, "untouched": True}, got["mapping"]


def test_tensor_viewing_its_storage_another_way_is_followed(results) -> None:
    for rank, got in enumerate(results):
        got = got["reviewed"]
        for side in ("dst", "src"):
            assert got[f"{side} transposed"]["differing"] == [], (rank, side, got)
            resized = got[f"{side} resized"]
            assert resized["moved"], f"rank {rank}: the resized storage kept its address; the case proves nothing"
            assert resized["differing"] == [] and resized["taken untouched"], (rank, side, resized)
        narrowed = got["narrowed"]
        assert narrowed["raised"] and narrowed["tensor"] == "decoder.layers.0.mlp.linear_fc1.weight", (rank, got)
        assert not narrowed["written"], f"rank {rank}: written before raising"


def test_storage_resized_in_place_is_followed_through_registered_memory(results) -> None:
    if not results[0]["resized one-sided"]:
        pytest.skip("no one-sided transport usable on CPU here (nixl-cu13 not installed)")
    for rank, got in enumerate(results):
        for name, sides in got["resized one-sided"].items():
            for side, seen in sides.items():
                assert seen == {"wrong": [], "taken untouched": True}, (rank, name, side, seen)


def test_misfit_on_one_rank_raises_on_every_rank(results) -> None:
    one, zero = results[1]["peer"], results[0]["peer"]
    assert one["raised"] == "LayoutError" and one["tensor"] == "decoder.layers.0.mlp.linear_fc1.weight", one
    assert zero["raised"] == "TransportError" and "rank 1" in zero["msg"], zero
    assert zero["seconds"] < 5.0 + 25.0, zero
