"""``Refitter(watch="manual")`` and ``Refitter.rebind()`` (one spawned world of 2 CPU
processes, gloo; several cases in it, to start processes once).

With ``watch="manual"`` a refit skips the per-refit checks for replaced tensors and
moved storage; the caller calls ``rebind()`` after changing the models. Covered:

* a TP2 trainer into a TP1 engine on both ranks (local copies and messages): after
  ``param.data = new`` on every destination parameter, then on every source parameter
  (new values), then ``module.weight = Parameter(new)`` on every destination
  parameter, then one of each at once, ``rebind()`` and a refit leave the
  destination's current tensors equal to an oracle computed from the random seed (and the
  same elementwise function the source's new values got), and the storage the
  destination dropped is not written;
* without ``rebind()`` (the trade-off ``watch="manual"`` makes): a refit writes the
  destination's old storage and leaves the new one untouched, and reads the source's
  old storage (the destination keeps the old values); ``rebind()`` then puts it right;
* a replacement of another shape, by ``.data`` (the program's storage check) and by a
  new Parameter (the binding check): ``rebind()`` raises :class:`LayoutError` naming
  it, nothing is written, and a refit after it raises too; a ``rebind()`` after the
  model was put right recovers (destination equal to the source model's tensors), also
  where the same ``rebind()`` had adopted a replaced source tensor before raising;
* a ``load_weights`` sink (one program per bucket): moved source storage is followed by
  ``rebind()`` (and, with ``watch="every"``, by the refit) in every bucket's program;
* ``watch="sometimes"``: :class:`ValueError` naming it and the allowed values, before
  any collective.

``watch="every"`` (the default) is what tests/test_replaced_tensors.py covers.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_replaced_tensors import DST, SENTINEL, SPEC, SRC, _put
from torch import nn

import torchrefit as tr
from torchrefit.testing import Mesh, build_toy, expected_local, run_world
from torchrefit.testing.toy import global_table, global_value

ONE = Mesh(1, ranks=1)
BUCKET = 12 * 1024  # several load_weights calls for the toy's ~80 KB


def _raised(call, error: type[Exception]) -> str | None:
    """What ``call()`` raised of ``error`` (None: nothing), so that a rank reports it
    instead of failing the whole world."""
    try:
        call()
    except error as e:
        return str(e)
    return None


def _f(t: torch.Tensor) -> torch.Tensor:
    """The source's new values (elementwise: the oracle applies it to whole tensors)."""
    return t * 2 + 1


def _wrong(dst: nn.Module, want: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k, v in dst.state_dict().items() if not torch.equal(v, want[k]))


def _untouched(old: list[torch.Tensor]) -> bool:
    return all(bool((t == SENTINEL).all()) for t in old)


def _move_dst(dst: nn.Module, names: list[str], how: str) -> list[torch.Tensor]:
    """New zeroed storage for destination ``names``; the old storage, filled with
    SENTINEL, is returned (a stale refit would write it)."""
    params = dict(dst.named_parameters())
    old = []
    with torch.no_grad():
        for name in names:
            p = params[name]
            old.append(p.data)
            p.data.fill_(SENTINEL)
            _put(dst, name, p, torch.zeros_like(p), how)
    return old


def _move_src(src: nn.Module, names: list[str], want: dict[str, torch.Tensor], zero_old: bool) -> None:
    """Source ``names`` get new values (``_f``) in new storage; ``want`` follows."""
    params = dict(src.named_parameters())
    with torch.no_grad():
        for name in names:
            p = params[name]
            old = p.data
            p.data = _f(p.detach())
            if zero_old:
                old.zero_()  # a stale read would now copy zeros
            want[name] = _f(want[name])


def _change(step: str, src: nn.Module, dst: nn.Module, want: dict) -> list[torch.Tensor]:
    names = [n for n, _ in dst.named_parameters()]
    if step == "src-data":
        _move_src(src, names, want, zero_old=True)
        return []
    if step == "mixed":  # one of each before one rebind()
        _move_src(src, names[-1:], want, zero_old=True)
        return _move_dst(dst, names[:1], "data") + _move_dst(dst, names[1:2], "parameter")
    return _move_dst(dst, names, step.removeprefix("dst-"))


def _refitted_once(rank: int) -> tuple:
    """Toy models of this rank, a ``watch="manual"`` Refitter that has refit once, and
    the destination's expected values."""
    src = build_toy(SPEC, SRC, rank, 1)
    dst = build_toy(SPEC, DST, rank, 2)
    r = tr.Refitter(src, dst, watch="manual")
    r.refit()
    return src, dst, r, expected_local(SPEC, DST, rank, 1)


def _manual(rank: int) -> dict:
    src, dst, r, want = _refitted_once(rank)
    out: dict = {"watch": r.watch, "first": _wrong(dst, want)}
    for step in ("dst-data", "src-data", "dst-parameter", "mixed"):
        dropped = _change(step, src, dst, want)
        r.rebind()
        report = r.refit()
        out[step] = {"wrong": _wrong(dst, want), "untouched": _untouched(dropped),
                     "compiled": report.compiled}
    out["verify"] = _raised(r.verify, tr.VerificationError)  # reads what the models hold now
    return out


def _without_rebind(rank: int) -> dict:
    src, dst, r, want = _refitted_once(rank)
    names = [n for n, _ in dst.named_parameters()]
    old = _move_dst(dst, names, "data")
    new = [p.data for p in dst.parameters()]
    r.refit()
    out: dict = {"new untouched": all(bool((t == 0).all()) for t in new),
                 "old written": [n for n, t in zip(names, old) if not torch.equal(t, want[n])]}
    r.rebind()
    r.refit()
    out["dst rebound"] = _wrong(dst, want)
    before = dict(want)
    _move_src(src, names, want, zero_old=False)  # the old storage keeps the old values
    r.refit()
    out["src stale"] = _wrong(dst, before)
    r.rebind()
    r.refit()
    out["src rebound"] = _wrong(dst, want)
    return out


def _misfit(me, how: str) -> dict:
    """Destination ``decoder.final_layernorm.weight`` replaced by one row longer."""
    src, dst = build_toy(SPEC, ONE, 0, 1), build_toy(SPEC, ONE, 0, 2)
    r = tr.Refitter(src, dst, group=me, watch="manual")
    r.refit()
    with torch.no_grad():
        for p in dst.parameters():
            p.fill_(SENTINEL)
    name = "decoder.final_layernorm.weight"
    others = [p for n, p in dst.named_parameters() if n != name]
    w = dst.decoder.final_layernorm
    if how == "data":
        w.weight.data = torch.zeros(w.weight.shape[0] + 1)
    else:
        w.weight = nn.Parameter(torch.zeros(w.weight.shape[0] + 1))
    out: dict = {}
    for call in ("rebind", "refit"):
        try:
            getattr(r, call)()
            out[call] = None
        except tr.LayoutError as e:
            out[call] = (e.tensor, str(e))
    out["written"] = not _untouched(others) or bool(w.weight.any())
    return out


def _recovers(me) -> dict:
    """A rebind() that raised, the model put right, rebind() again: refits as before."""
    src, dst = build_toy(SPEC, ONE, 0, 1), build_toy(SPEC, ONE, 0, 2)
    r = tr.Refitter(src, dst, group=me, watch="manual")
    r.refit()
    w = dst.decoder.final_layernorm
    n = w.weight.shape[0]
    w.weight = nn.Parameter(torch.zeros(n + 1))
    raised = _raised(r.rebind, tr.LayoutError)
    w.weight = nn.Parameter(torch.zeros(n))
    r.rebind()
    with torch.no_grad():
        for p in src.parameters():
            p.mul_(3)  # new values in place: no rebind() needed for those
    r.refit()
    srcs = dict(src.named_parameters())
    return {"raised": raised, "differ": [k for k, v in dst.named_parameters() if not torch.equal(v, srcs[k])]}


def _both_sides(me) -> dict:
    """A source Parameter replaced (adopted) and a destination one of another shape in one
    rebind(), which raises; the destination's own Parameter put back, rebind() again: the
    programs must not keep the source's dropped tensor."""
    src, dst = build_toy(SPEC, ONE, 0, 1), build_toy(SPEC, ONE, 0, 2)
    r = tr.Refitter(src, dst, group=me, watch="manual")
    r.refit()
    a, w = src.decoder.final_layernorm, dst.decoder.final_layernorm
    dropped, kept = a.weight, w.weight
    a.weight = nn.Parameter(_f(dropped.detach()))
    with torch.no_grad():
        dropped.zero_()  # a stale read would copy zeros
    w.weight = nn.Parameter(torch.zeros(kept.shape[0] + 1))
    raised = _raised(r.rebind, tr.LayoutError)
    w.weight = kept
    r.rebind()
    r.refit()
    return {"raised": raised, "equal": torch.equal(w.weight, a.weight)}


def _sink(me, watch: str) -> dict:
    """A source on this rank into a load_weights sink of several buckets; its storage
    moves, followed by ``rebind()`` ("manual") or by the refit itself ("every")."""
    got: dict[str, torch.Tensor] = {}

    def load_weights(weights) -> None:
        for name, t in weights:
            got[name] = t.clone()

    table = {n: d for n, d in global_table(SPEC).items() if d.persistent}
    sink = tr.load_weights_sink(load_weights, [(n, d.shape, torch.float32) for n, d in table.items()],
                                bucket_bytes=BUCKET)
    src = build_toy(SPEC, ONE, 0, 1)
    r = tr.Refitter(src, nn.Module(), dst_layout=sink, group=me, watch=watch)
    r.refit()
    want = {n: global_value(n, d.shape, 1, SPEC) for n, d in table.items()}
    _move_src(src, [n for n, _ in src.named_parameters()], want, zero_old=True)
    if watch == "manual":
        r.rebind()
    got.clear()
    r.refit()
    return {"buckets": len(r._phase_programs), "names": sorted(got) == sorted(want),
            "wrong": [n for n in want if n not in got or not torch.equal(got[n], want[n])]}


def _bad_value(rank: int) -> dict:
    """Construction with watch="sometimes", counting the collectives it reached."""
    import torchrefit.refitter as refitter

    calls: list[str] = []
    real = refitter.all_gather_rosters, refitter.all_gather_pickled
    refitter.all_gather_rosters = lambda *a, **k: calls.append("rosters") or real[0](*a, **k)
    refitter.all_gather_pickled = lambda *a, **k: calls.append("pickled") or real[1](*a, **k)
    try:
        tr.Refitter(build_toy(SPEC, SRC, rank, 1), build_toy(SPEC, DST, rank, 2), watch="sometimes")
        msg = None
    except ValueError as e:
        msg = str(e)
    finally:
        refitter.all_gather_rosters, refitter.all_gather_pickled = real
    return {"msg": msg, "collectives": calls}


def _world(rank: int, world: int) -> dict:
    ones = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    me = ones[rank]
    return {
        "bad value": _bad_value(rank),  # first: the cases after it show the group still works
        "manual": _manual(rank),
        "without rebind": _without_rebind(rank),
        "misfit-data": _misfit(me, "data"),
        "misfit-parameter": _misfit(me, "parameter"),
        "recovers": _recovers(me),
        "both sides": _both_sides(me),
        "sink-manual": _sink(me, "manual"),
        "sink-every": _sink(me, "every"),
    }


@pytest.fixture(scope="module")
def results():
    return run_world(_world, 2, timeout=300, pg_timeout=60)


@pytest.mark.parametrize("step", ["dst-data", "src-data", "dst-parameter", "mixed"])
def test_rebind_follows_replaced_and_moved_tensors(results, step: str) -> None:
    for rank, got in enumerate(results):
        got = got["manual"]
        assert got["watch"] == "manual" and got["first"] == [], (rank, got)
        assert got[step]["wrong"] == [], f"rank {rank}: {step} left {got[step]['wrong'][:3]} unlike the oracle"
        assert got[step]["untouched"], f"rank {rank}: {step} wrote into storage the model dropped"
        if step in ("dst-parameter", "mixed"):  # a new Parameter: rebind() dropped the programs
            assert got[step]["compiled"], (rank, step)
        assert got["verify"] is None, (rank, got["verify"])


def test_without_rebind_refit_uses_the_old_storage(results) -> None:
    for rank, got in enumerate(results):
        got = got["without rebind"]
        assert got["new untouched"], f"rank {rank}: the new destination storage was written"
        assert got["old written"] == [], f"rank {rank}: old storage not written: {got['old written'][:3]}"
        assert got["src stale"] == [], f"rank {rank}: the source's new storage was read: {got['src stale'][:3]}"
        assert got["dst rebound"] == [] and got["src rebound"] == [], (rank, got)


@pytest.mark.parametrize("how", ["data", "parameter"])
def test_rebind_raises_on_a_misfit_and_refit_then_refuses(results, how: str) -> None:
    name = "decoder.final_layernorm.weight"
    for rank, got in enumerate(results):
        got = got[f"misfit-{how}"]
        assert got["rebind"] is not None, f"rank {rank}: rebind() accepted a tensor of another shape"
        assert got["rebind"][0] == name and name in got["rebind"][1], (rank, got)
        assert got["refit"] is not None and got["refit"][0] == name, (rank, got)
        assert not got["written"], f"rank {rank}: written after the misfit"


def test_rebind_after_the_model_was_put_right_recovers(results) -> None:
    for rank, got in enumerate(results):
        assert got["recovers"]["raised"] and got["recovers"]["differ"] == [], (rank, got["recovers"])


def test_rebind_that_raised_on_one_side_still_drops_the_other_sides_programs(results) -> None:
    for rank, got in enumerate(results):
        assert got["both sides"]["raised"], (rank, got["both sides"])
        assert got["both sides"]["equal"], f"rank {rank}: the source's dropped tensor was read"


@pytest.mark.parametrize("watch", ["manual", "every"])
def test_moved_storage_is_followed_in_every_bucket_program(results, watch: str) -> None:
    for rank, got in enumerate(results):
        got = got[f"sink-{watch}"]
        assert got["buckets"] > 1 and got["names"], (rank, got)
        assert got["wrong"] == [], f"rank {rank}: buckets read stale source storage: {got['wrong'][:3]}"


def test_bad_watch_value_raises_before_any_collective(results) -> None:
    for rank, got in enumerate(results):
        got = got["bad value"]
        assert got["msg"] and "'sometimes'" in got["msg"] and "every" in got["msg"] and "manual" in got["msg"], got
        assert got["collectives"] == [], f"rank {rank}: reached {got['collectives']} before raising"
