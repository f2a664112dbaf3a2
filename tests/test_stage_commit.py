"""``Refitter.stage()`` and ``commit()`` on 2 real CPU processes (gloo), checked against
the toy oracle (``expected_local``: the values each rank must hold, computed from the
seed, not through the plan).

Covers: a stage leaves the live weights and version untouched and a commit installs
exactly the source as it was when the stage read it (a collocated trainer overwriting
its weights in between changes nothing), in device and host staging; the commit waits
for a stage still in flight; a stage requested while a commit reads staging waits for
it (no torn commit); a stage that fails mid-way, on one rank, raises on every rank and
leaves live weights, version and nothing committable; supersede (a newer stage
replaces an uncommitted one, never mixing), explicit versions, and a plain refit
discarding a staged version; arguments refused up front; a stage through a one-sided
(pull) transport, receivers reading the senders' memory into their staging; the
commit's copies of a tensor the plan writes only in part (padding keeps its live values),
following a live tensor whose storage moved.
"""

from __future__ import annotations

import threading
import time

import pytest
import shm_transport  # noqa: F401  (registers the CPU one-sided test transports)
import torch

import torchrefit as tr
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local, run_world
from torchrefit.testing.toy import load_seed

SPEC = ModelSpec(layers=2)
# non-collocated: the trainer on rank 0, the engine on rank 1 (every byte crosses gloo)
TRAINER, ENGINE = Mesh(1, ranks=1), Mesh(1, ranks=1, offset=1)


def _equal(model, expected) -> bool:
    state = model.state_dict() if model is not None else {}
    return all(torch.equal(v, expected[k]) for k, v in state.items() if k in expected)


def _snapshot(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()} if model is not None else {}


def _models(rank: int, collocated: bool):
    if collocated:  # TP2 trainer, TP1 engine on both ranks: local copies and receives
        return (build_toy(SPEC, Mesh(2, ranks=2), rank, 1), build_toy(SPEC, Mesh(1, ranks=2), rank, 2),
                Mesh(2, ranks=2), Mesh(1, ranks=2))
    return build_toy(SPEC, TRAINER, rank, 1), build_toy(SPEC, ENGINE, rank, 2), TRAINER, ENGINE


# ------------------------------------------------------------------ stage, then commit
def _stage_then_commit(rank: int, world: int, collocated: bool, staging: str) -> dict:
    src, dst, smesh, dmesh = _models(rank, collocated)
    r = tr.Refitter(src, dst, staging=staging)
    out = {}
    before = _snapshot(dst)
    rep = r.stage()
    out["stage"] = rep.wait()
    out["live_untouched"] = _equal(dst, before)
    out["version_after_stage"] = tr.weight_version(dst)
    load_seed(src, SPEC, smesh, rank, 3)  # the trainer's next step, before the engine commits
    out["commit"] = r.commit()
    out["installed_stage_time"] = _equal(dst, expected_local(SPEC, dmesh, rank, 1))
    out["version_after_commit"] = tr.weight_version(dst)
    r.stage()  # now the trainer's new weights
    out["commit2"] = r.commit()
    out["installed_second"] = _equal(dst, expected_local(SPEC, dmesh, rank, 3))
    out["dst_bytes"] = sum(t.nbytes for t in dst.state_dict().values()) if dst is not None else 0
    load_seed(src, SPEC, smesh, rank, 4)
    out["refit"] = r.refit()  # a plain refit is unchanged
    out["refit_ok"] = _equal(dst, expected_local(SPEC, dmesh, rank, 4))
    r.verify()
    r.close()
    return out


@pytest.mark.parametrize("collocated,staging", [(True, "device"), (False, "host")])
def test_stage_then_commit(collocated: bool, staging: str) -> None:
    results = run_world(_stage_then_commit, 2, collocated, staging, timeout=180)
    for rank, got in enumerate(results):
        engine = collocated or rank == 1
        assert got["live_untouched"]
        assert got["version_after_stage"] is None
        assert got["installed_stage_time"] and got["installed_second"] and got["refit_ok"]
        assert got["stage"].staging == got["commit"].staging == staging
        if engine:
            assert got["version_after_commit"] == 1
            assert got["commit"].version == 1 and got["commit2"].version == 2
            assert got["refit"].version == 3
            # the twins hold the destination's bytes, allocated once, all committed
            assert got["stage"].staging_bytes == got["dst_bytes"] == got["commit"].bytes_committed
            assert got["stage"].compiled and got["stage"].bytes_received > 0
        else:  # the trainer: nothing to stage for or to commit
            assert got["stage"].staging_bytes == 0 and got["commit"].bytes_committed == 0


# ----------------------------------------------- rule 1: commit waits for the stage
def _commit_waits(rank: int, world: int) -> dict:
    src, dst, _, _ = _models(rank, collocated=False)
    r = tr.Refitter(src, dst)
    if rank == 0:
        time.sleep(1.0)  # the trainer's weights are late
        r.stage()
        return {}
    handle = r.stage(wait=False)  # returns while the bytes have yet to come
    queued = not handle.done()
    report = r.commit()  # the engine's commit point, right away
    return {"queued": queued, "waited": report.waited_seconds, "version": tr.weight_version(dst),
            "ok": _equal(dst, expected_local(SPEC, ENGINE, rank, 1))}


def test_commit_waits_for_the_stage() -> None:
    got = run_world(_commit_waits, 2, timeout=120)[1]
    assert got["queued"]
    assert got["ok"] and got["version"] == 1
    assert got["waited"] > 0.5


# ------------------------------- rule 3: a stage never overwrites what a commit reads
def _slow_commit(self) -> None:
    """A commit whose copies take a while (as a large one on a busy device does)."""
    with torch.no_grad():
        for live, twin in zip(self.live, self.twins):
            live.copy_(twin)
            time.sleep(0.02)


def _no_overwrite(rank: int, world: int) -> dict:
    src, dst, smesh, _ = _models(rank, collocated=False)
    r = tr.Refitter(src, dst)
    if rank == 0:
        r.stage()
        load_seed(src, SPEC, smesh, rank, 3)
        r.stage()
        return {}
    from torchrefit.execute import staged

    staged.Commit.run = _slow_commit
    r.stage()
    reports = []
    committer = threading.Thread(target=lambda: reports.append(r.commit()))
    committer.start()
    while not r._stager.reading and committer.is_alive():  # the commit is reading staging
        time.sleep(0.001)
    r.stage(wait=False).wait()  # the next version arrives meanwhile
    committer.join()
    first = _equal(dst, expected_local(SPEC, ENGINE, rank, 1))
    second = r.commit()
    return {"first_exact": first, "first_version": reports[0].version, "second_version": second.version,
            "second_exact": _equal(dst, expected_local(SPEC, ENGINE, rank, 3)),
            "copies": len(r._commit.live)}


def test_stage_waits_for_a_commit_reading_staging() -> None:
    got = run_world(_no_overwrite, 2, timeout=120)[1]
    assert got["copies"] > 5  # the stage had time to overwrite staging mid-commit
    assert got["first_exact"] and got["first_version"] == 1
    assert got["second_exact"] and got["second_version"] == 2


# ---------------------------------------- rule 4: a failed stage changes nothing live
def _failed_stage(rank: int, world: int, fail_at: str) -> dict:
    src, dst, smesh, _ = _models(rank, collocated=False)
    # a small message budget: the stage takes several rounds
    r = tr.Refitter(src, dst, pool_bytes=16384, timeout=4)
    out: dict = {}
    r.stage()  # version 1 staged, not committed
    rounds = len(r._stage_program.compiled.rounds.rounds)
    out["rounds"] = rounds
    load_seed(src, SPEC, smesh, rank, 3)
    if rank == 1:
        finish, calls = r._transport.finish, []
        # "mid": after the second round landed (the sender still has rounds to send);
        # "end": after the last one (every byte moved, the engine's side fails after)
        fail = 2 if fail_at == "mid" else rounds

        def failing_finish(handle) -> None:
            finish(handle)
            calls.append(1)
            if len(calls) == fail:
                raise RuntimeError("injected: the engine's side failed mid-stage")

        r._transport.finish = failing_finish
    t0 = time.perf_counter()
    try:
        r.stage()
        out["stage_error"] = None
    except tr.RefitError as e:
        out["stage_error"] = (type(e).__name__, str(e))
    out["seconds"] = time.perf_counter() - t0
    if rank == 1:
        try:
            r.commit()
            out["commit_error"] = None
        except tr.RefitError as e:
            out["commit_error"] = str(e)
        out["live_unchanged"] = _equal(dst, expected_local(SPEC, ENGINE, rank, 2))
        out["version"] = tr.weight_version(dst)
    try:
        r.refit()
        out["refit_after"] = None
    except tr.RefitError as e:
        out["refit_after"] = type(e).__name__
    return out


@pytest.mark.parametrize("fail_at", ["end", "mid"])
def test_failed_stage_raises_everywhere_and_changes_nothing(fail_at: str) -> None:
    sender, engine = run_world(_failed_stage, 2, fail_at, timeout=120)
    assert engine["rounds"] > 2
    for got in (sender, engine):
        assert got["stage_error"] is not None, got
        assert got["refit_after"] == "TransportError"  # the group is unusable, as after a failed refit
    assert "rank 1" in engine["stage_error"][1] and "injected" in engine["stage_error"][1]
    if fail_at == "end":  # every byte moved: the agreement tells the sender at once
        assert sender["stage_error"][0] == "RefitError"
        assert "rank 1" in sender["stage_error"][1] and "injected" in sender["stage_error"][1]
        assert sender["seconds"] < 3
    else:  # the sender waits for rounds the engine never receives: its timeout tells it
        assert sender["stage_error"][0] == "TransportError" and "rank 1" in sender["stage_error"][1]
    # staging may hold the whole new version ("end") or part of it ("mid"): neither is committed
    assert engine["commit_error"] and "failed, nothing was committed" in engine["commit_error"]
    assert engine["live_unchanged"] and engine["version"] is None


# ------------------------------------------- supersede, versions, refit discards
def _supersede(rank: int, world: int) -> dict:
    src, dst, smesh, dmesh = _models(rank, collocated=False)
    r = tr.Refitter(src, dst)
    out: dict = {}
    r.stage()  # version 1, not committed
    load_seed(src, SPEC, smesh, rank, 3)
    out["second"] = r.stage().version  # supersedes it
    if rank == 1:
        out["commit"] = r.commit().version
        out["newest_exact"] = _equal(dst, expected_local(SPEC, dmesh, rank, 3))
        out["recommit"] = _raises(r.commit)
    out["explicit"] = r.stage(version=7).version
    if rank == 1:
        out["commit7"] = r.commit().version
        out["weight_version"] = tr.weight_version(dst)
    load_seed(src, SPEC, smesh, rank, 4)
    r.stage()  # version 8, then a plain refit of the same source before its commit
    load_seed(src, SPEC, smesh, rank, 5)
    out["refit"] = r.refit().version
    if rank == 1:
        out["after_refit_commit"] = _raises(r.commit)
        out["refit_exact"] = _equal(dst, expected_local(SPEC, dmesh, rank, 5))
    out["bad_version"] = _raises(lambda: r.stage(version="8"))
    return out


def _raises(fn) -> str | None:
    try:
        fn()
    except (tr.RefitError, TypeError) as e:
        return str(e)
    return None


def test_supersede_and_versions() -> None:
    trainer, engine = run_world(_supersede, 2, timeout=120)
    assert trainer["second"] == engine["second"] == 2
    assert engine["commit"] == 2 and engine["newest_exact"]
    assert "nothing staged" in engine["recommit"]
    assert engine["explicit"] == 7 and engine["commit7"] == 7 and engine["weight_version"] == 7
    # the next default follows the newest staged version on every rank, committed or not
    assert trainer["refit"] == engine["refit"] == 9
    assert engine["after_refit_commit"] and "nothing staged" in engine["after_refit_commit"]
    assert engine["refit_exact"]
    assert "int" in trainer["bad_version"]


# ------------------------------------------------------------------- refused up front
def _refused(rank: int, world: int) -> dict:
    src, dst, _, _ = _models(rank, collocated=True)
    out = {"bad_staging": _raises_value(lambda: tr.Refitter(src, dst, staging="gpu"))}
    shared = tr.Refitter(src, dst, share_storage=True)
    out["share_storage"] = _raises(shared.stage)
    out["commit_first"] = _raises(tr.Refitter(src, dst).commit)
    return out


def _raises_value(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def test_refused_arguments() -> None:
    for got in run_world(_refused, 2, timeout=120):
        assert "staging must be one of" in got["bad_staging"]
        assert "share_storage" in got["share_storage"]
        assert "before any stage" in got["commit_first"]


# ------------------------------------------------------- through a one-sided transport
def _one_sided(rank: int, world: int) -> dict:
    src, dst, smesh, dmesh = _models(rank, collocated=True)
    for m in (src, dst):
        m.share_memory()  # the test transport reads peers' shared memory
    r = tr.Refitter(src, dst, transport="shm-pull")
    before = _snapshot(dst)
    r.stage()
    out = {"live_untouched": _equal(dst, before)}
    load_seed(src, SPEC, smesh, rank, 3)
    r.commit()
    out["installed"] = _equal(dst, expected_local(SPEC, dmesh, rank, 1))
    r.stage()
    r.commit()
    out["second"] = _equal(dst, expected_local(SPEC, dmesh, rank, 3))
    out["received"] = r.plan.bytes_received
    return out


def test_stage_through_a_one_sided_transport() -> None:
    for got in run_world(_one_sided, 2, timeout=120):
        assert got["received"] > 0
        assert got["live_untouched"] and got["installed"] and got["second"]


# ------------------------------------------------------------ the commit's copies
def test_commit_copies_only_written_regions_and_follows_moved_storage() -> None:
    from torchrefit.execute.staged import compile_commit
    from torchrefit.layout import Box

    whole = torch.nn.Parameter(torch.zeros(4, 3))
    padded = torch.nn.Parameter(torch.full((6, 3), -1.0))  # rows 4-5: padding no source covers
    live = {"whole": whole, "padded": padded}
    boxes = {"whole": (Box((0, 0), (4, 3)),), "padded": (Box((0, 0), (2, 3)), Box((2, 0), (2, 3)))}
    twins = {"whole": torch.ones(4, 3), "padded": torch.full((6, 3), 7.0)}
    commit = compile_commit(boxes, live, twins)
    assert commit.nbytes == (12 + 12) * 4
    commit.run()
    assert torch.equal(whole, torch.ones(4, 3))
    assert torch.equal(padded[:4], torch.full((4, 3), 7.0)) and torch.equal(padded[4:], torch.full((2, 3), -1.0))
    assert commit.current(live)
    with torch.no_grad():
        padded.data = torch.full((6, 3), -2.0)  # an engine re-allocated its weight
    assert not commit.current(live)  # its views would write the old storage: compiled again
    compile_commit(boxes, live, twins).run()
    assert torch.equal(padded[:4], torch.full((4, 3), 7.0)) and torch.equal(padded[4:], torch.full((2, 3), -2.0))
    commit = compile_commit(boxes, live, twins)
    with torch.no_grad():
        whole.data = torch.zeros(4, 3)  # a tensor written whole, re-allocated
    assert not commit.current(live)  # the compiled copies hold the old address
    compile_commit(boxes, live, twins).run()
    assert torch.equal(whole, torch.ones(4, 3))


def test_commit_runs_the_refits_compiled_local_copies() -> None:
    """Large copies one by one, small ones fused, as a refit's local copies; each exact."""
    from torchrefit.execute.local import SMALL_COPY_BYTES
    from torchrefit.execute.staged import compile_commit
    from torchrefit.layout import Box

    n = SMALL_COPY_BYTES // 4 + 64  # float32 elements of a large copy
    live = {"big": torch.nn.Parameter(torch.zeros(n)), "small": torch.zeros(10, 4),
            "half": torch.full((8, 4), -1.0, dtype=torch.bfloat16)}
    twins = {"big": torch.arange(n, dtype=torch.float32), "small": torch.randn(10, 4),
             "half": torch.randn(8, 4).bfloat16()}
    boxes = {"big": (Box((0,), (n,)),), "small": (Box((0, 0), (10, 4)),), "half": (Box((2, 0), (3, 4)),)}
    commit = compile_commit(boxes, live, twins)
    assert commit.local is not None and len(commit.local.big) == 1 and len(commit.local.small) == 2
    commit.run()
    assert torch.equal(live["big"], twins["big"]) and torch.equal(live["small"], twins["small"])
    assert torch.equal(live["half"][2:5], twins["half"][2:5])
    assert torch.equal(live["half"][:2], torch.full((2, 4), -1.0, dtype=torch.bfloat16))
    assert torch.equal(live["half"][5:], torch.full((3, 4), -1.0, dtype=torch.bfloat16))
