"""A trainer killed in the middle of a stage, on real separate jobs (CPU, gloo, ``tr.connect``).

A 2-rank TP2 trainer job stages into a 2-rank TP2 engine job, which keeps reading its live
weights while the stage is in flight (it serves). Trainer rank 1 leaves (``os._exit``) right
after posting the sends of one of its rounds, a few rounds into a stage of tens of rounds
(the engine's staging is seen partly written: the stage really was in flight). Checked, in
device and host staging:

* every live rank raises within a bound: the engine ranks' stage with a ``TransportError``
  naming the dead trainer rank; engine rank 0, whose own bytes all came from the live
  trainer rank, must not commit them either (the ranks agree on a failed stage);
* the engine's live weights are bit-identical to the saved copy of version v, and
  ``tr.weight_version`` stays v; a later ``commit()`` is refused (nothing staged) and changes
  nothing; a later ``stage()`` on the broken link is refused at once;
* a new trainer job connects to the same engine processes (a new ``tr.connect`` and a new
  ``Refitter`` over the same destination model) and stages and commits version v+1, which
  equals the toy's oracle exactly.
"""

from __future__ import annotations

import os
import queue
import time

import pytest
import torch

import torchrefit as tr
from torchrefit.testing import Mesh, ModelSpec, WorldError, build_toy, expected_local
from torchrefit.testing.jobs import _start, free_ports
from torchrefit.testing.toy import load_seed

# ~12 MB of float32 weights, 0.25 MiB messages: each trainer rank sends tens of rounds
SPEC = ModelSpec(layers=2, hidden=256, heads=8, groups=4, ffn=1024, vocab=2048)
TRAINER, ENGINE = Mesh(tp=2, ranks=2), Mesh(tp=2, ranks=2)
MESSAGE_BYTES = 1 << 18
TIMEOUT = 5.0  # the refit timeout: how long a rank waits for a dead peer
CONNECT_TIMEOUT = 60.0  # starting a job's processes on a loaded machine is slower
KILL_AT_ROUND = 3  # trainer rank 1 leaves right after posting this round's sends
#: a live rank must raise within: the round's wait, the agreement, the wait that names the
#: missing ranks (each bounded by TIMEOUT), plus slack for 2 loaded cores
BOUND = 3 * TIMEOUT + 10
V = 1  # the engine's live version when the trainer dies


def _bits(model) -> dict[str, bytes]:
    return {k: v.detach().contiguous().view(torch.uint8).numpy().tobytes()
            for k, v in model.state_dict().items()}


def _refitter(conn, src, dst, staging: str) -> tr.Refitter:
    r = tr.Refitter(src, dst, group=conn, staging=staging, pool_bytes=MESSAGE_BYTES,
                    timeout=CONNECT_TIMEOUT)
    r.timeout = r._transport.timeout = TIMEOUT  # short for the stages only: start-up is slow here
    return r


def _connect(role: str, rank: int, port: int) -> tr.Connection:
    return tr.connect(role=role, rank=rank, world_size=2, peer_world_size=2, address="127.0.0.1",
                      port=port, backend="gloo", timeout=CONNECT_TIMEOUT)


# ---------------------------------------------------------------------------- the jobs
def _dying_trainer(rank: int, world: int, port: int, staging: str) -> dict:
    src = build_toy(SPEC, TRAINER, rank, V)
    r = _refitter(_connect("trainer", rank, port), src, None, staging)
    r.stage()  # version v, which the engine commits
    load_seed(src, SPEC, TRAINER, rank, V + 1)
    if rank == 1:
        start, rounds = r._transport.start, []

        def dying_start(sends, recvs):
            handle = start(sends, recvs)
            rounds.append(1)
            if len(rounds) == KILL_AT_ROUND:  # this round's sends are posted, not complete
                os._exit(9)
            return handle

        r._transport.start = dying_start
    out: dict = {"rounds": len(r._stage_program.compiled.rounds.rounds)}
    t0 = time.perf_counter()
    try:
        r.stage()
        out["raised"] = None
    except tr.RefitError as e:
        out["raised"], out["message"], out["ranks"] = type(e).__name__, str(e), e.ranks
    out["seconds"] = time.perf_counter() - t0
    return out


def _new_trainer(rank: int, world: int, port: int, staging: str) -> dict:
    src = build_toy(SPEC, TRAINER, rank, V + 2)
    r = _refitter(_connect("trainer", rank, port), src, None, staging)
    return {"version": r.stage(version=V + 1).version}


def _engine(rank: int, world: int, port: int, staging: str, new_port: int) -> dict:
    dst = build_toy(SPEC, ENGINE, rank, 99)
    r = _refitter(_connect("engine", rank, port), None, dst, staging)
    r.stage()
    r.commit()  # version v is live; staging holds it too
    out: dict = {"v_exact": _equal(dst, expected_local(SPEC, ENGINE, rank, V))}
    saved = _bits(dst)
    handle = r.stage(wait=False)  # the trainer dies in its middle
    t0, reads = time.perf_counter(), 0
    while not handle.done():  # the engine serves from its live weights meanwhile
        with torch.no_grad():
            sum(p.sum() for p in dst.parameters())
        reads += 1
    try:
        handle.wait()
        out["raised"] = None
    except tr.RefitError as e:
        out["raised"], out["message"], out["ranks"] = type(e).__name__, str(e), e.ranks
    out["seconds"], out["reads"] = time.perf_counter() - t0, reads
    out["partly_staged"] = _staged_fraction(r, dst)
    out["live_bit_identical"] = _bits(dst) == saved
    out["version"] = (tr.weight_version(dst), r.version)
    out["commit"] = _refused(r.commit)
    out["after_commit"] = (_bits(dst) == saved, tr.weight_version(dst))
    out["stage_again"] = _refused(r.stage)
    r.close()
    # a new trainer job: a new connection, a new Refitter over the same live model
    r = _refitter(_connect("engine", rank, new_port), None, dst, staging)
    r.stage(version=V + 1)
    out["still_v"] = _bits(dst) == saved
    out["recommitted"] = r.commit().version
    out["new_exact"] = _equal(dst, expected_local(SPEC, ENGINE, rank, V + 2))
    out["new_version"] = tr.weight_version(dst)
    return out


def _equal(model, expected) -> bool:
    state = model.state_dict()
    return set(state) == set(expected) and all(torch.equal(state[k], expected[k]) for k in expected)


def _staged_fraction(r: tr.Refitter, dst) -> tuple[int, int]:
    """(twins that differ from the live version v, twins): what the cut stage wrote."""
    live = dict(dst.state_dict())
    twins = r._twins or {}
    return sum(not torch.equal(t, live[k]) for k, t in twins.items()), len(twins)


def _refused(fn) -> str | None:
    try:
        fn()
    except tr.RefitError as e:
        return f"{type(e).__name__}: {e}"
    return None


# --------------------------------------------------------------------------- the runner
def _run(staging: str, timeout: float = 240.0) -> tuple[list, list, list]:
    """The engine job and the dying trainer job at once, then the new trainer job."""
    port, new_port, *inits = free_ports(5)
    engine = _start(_engine, 2, port, inits[0], (staging, new_port), 60.0)
    dying = _start(_dying_trainer, 2, port, inits[1], (staging,), 60.0)
    deadline = time.monotonic() + timeout
    got = {"dying": _collect(dying, 2, deadline, may_die=(1,))}
    new = _start(_new_trainer, 2, new_port, inits[2], (staging,), 60.0)
    got["new"] = _collect(new, 2, deadline)
    got["engine"] = _collect(engine, 2, deadline)
    return got["dying"], got["new"], got["engine"]


def _collect(job, n: int, deadline: float, may_die: tuple[int, ...] = ()) -> list:
    procs, out = job
    results: dict[int, tuple[bool, object]] = {}
    try:
        while len(results) < n and time.monotonic() < deadline:
            try:
                rank, ok, value = out.get(timeout=0.2)
                results[rank] = (ok, value)
            except queue.Empty:
                alive = [r for r, p in enumerate(procs.processes) if p.is_alive()]
                if all(r in results or r in may_die for r in range(n)) or not alive:
                    if out.empty():
                        break
    finally:
        for p in procs.processes:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    bad = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(results.items()) if not ok]
    missing = [r for r in range(n) if r not in results and r not in may_die]
    if bad or missing:
        raise WorldError("\n".join(bad + ([f"ranks {missing} did not finish"] if missing else [])))
    return [results[r][1] if r in results else None for r in range(n)]


@pytest.mark.parametrize("staging", ["device", "host"])
def test_trainer_killed_mid_stage(staging: str) -> None:
    dying, new, engines = _run(staging)
    survivor = dying[0]
    assert dying[1] is None  # it left mid-stage
    assert survivor["rounds"] > 3 * KILL_AT_ROUND, survivor  # the stage is long: cut well inside
    assert survivor["raised"] == "TransportError" and survivor["seconds"] < BOUND, survivor
    # the dead rank named, and no live one: trainer rank 1 is joint rank 1
    assert "trainer rank 1 died or stopped" in survivor["message"], survivor
    assert survivor["ranks"] == (1,), survivor
    for rank, got in enumerate(engines):
        assert got["v_exact"], rank
        assert got["raised"] == "TransportError", (rank, got)
        assert "trainer rank 1 died or stopped" in got["message"], (rank, got["message"])
        assert got["ranks"] == (1,) and "written" in got["message"], (rank, got["message"])
        assert got["seconds"] < BOUND, (rank, got["seconds"])
        assert got["reads"] > 0  # the engine read its live weights while the stage ran
        assert got["live_bit_identical"], rank
        assert got["version"] == (V, V), (rank, got["version"])
        assert got["commit"] and "nothing staged to commit" in got["commit"], (rank, got["commit"])
        assert f"the stage of version {V + 1} failed" in got["commit"], (rank, got["commit"])
        assert got["after_commit"] == (True, V), rank
        assert got["stage_again"] and "unusable" in got["stage_again"], (rank, got["stage_again"])
        assert got["still_v"] and got["recommitted"] == V + 1 and got["new_version"] == V + 1, got
        assert got["new_exact"], rank
    # staging was partly written when the trainer died (the stage was in flight), on the rank
    # that receives from the dead trainer rank
    written, twins = engines[1]["partly_staged"]
    assert 0 < written < twins, engines[1]["partly_staged"]
    assert [n["version"] for n in new] == [V + 1, V + 1]
