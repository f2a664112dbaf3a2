"""Trainer and engine as separately launched jobs, joined by ``tr.connect`` (CPU: gloo, and
nixl where ``nixl-cu13`` is installed).

Covers: two independently spawned worlds (two ``mp.start_processes`` calls, two
default groups on two master ports) joined by ``tr.connect``; a Megatron-style TP2
trainer refit into a TP1 x DP3 engine three times (weights checked against the toy's
oracle, cut with plain torch ops), with versions (counter 1, 2, then an explicit 10)
read by ``tr.weight_version`` on every engine rank and carried by the report; a failed
refit keeps the previous version; ``swap_model_weights(group=conn)``; both default groups
still usable afterwards. Missing peers: a trainer whose engine never comes, an engine
whose trainer never comes, and an engine job with one rank that never calls connect
all raise ``tr.ConnectError`` naming the missing ranks within timeout + a few seconds;
jobs that disagree about their sizes raise naming both views. NCCL: the same refit
over a ``backend="nccl"`` connection (marked ``gpu``, needs 2 GPUs).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import torchrefit as tr
from torchrefit.testing import (
    Mesh,
    ModelSpec,
    build_toy,
    expected_local,
    run_world,
    usable_transports,
)
from torchrefit.testing.jobs import free_port, run_jobs

SPEC = ModelSpec(layers=2)
TRAINER, ENGINE = Mesh(tp=2, ranks=2), Mesh(tp=1, ranks=3)


def _set_weights(model, mesh: Mesh, rank: int, seed: int) -> None:
    """An optimizer step, in place: the trainer's tensors take seed ``seed``'s values."""
    want = expected_local(SPEC, mesh, rank, seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(want[name])


def _matches(model, mesh: Mesh, rank: int, seed: int) -> bool:
    want = expected_local(SPEC, mesh, rank, seed)
    got = model.state_dict()
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def _default_group_sum() -> int:
    x = torch.ones(1)
    dist.all_reduce(x)  # the job's own default group, untouched by the joint one
    return int(x.item())


def _refits(conn, src, dst, check, transport: str) -> dict:
    """The same sequence on both sides; ``check(seed)`` says whether this rank holds
    what it should after a refit of seed ``seed``."""
    out: dict = {"joint": (conn.joint_rank, conn.joint_world)}
    r = tr.Refitter(src, dst, group=conn, transport=transport)
    out["transport"] = r.transport_name
    out["offsets"] = (conn.src_rank_offset, conn.dst_rank_offset)
    reports = []
    for seed, version in ((1, None), (2, None), (3, 10)):
        if src is not None:
            _set_weights(src, TRAINER, conn.rank, seed)
        reports.append(r.refit(version=version))
        out[f"ok{seed}"] = check(seed)
        out[f"stamp{seed}"] = tr.weight_version(dst) if dst is not None else None
    out["versions"] = [rep.version for rep in reports]
    out["received"] = sum(rep.bytes_received for rep in reports)

    def broken(*_args, **_kwargs):  # a transport that fails mid-refit, on every rank
        raise tr.TransportError("injected failure")
    r._program.run = broken
    with pytest.raises(tr.TransportError):
        r.refit()
    out["after_failure"] = (r.version, tr.weight_version(dst) if dst is not None else None)

    if src is not None:
        _set_weights(src, TRAINER, conn.rank, 4)
    rep = tr.swap_model_weights(src, dst, refit_method="gloo", group=conn)
    out["swap_ok"] = check(4)
    out["swap_version"] = rep.version
    out["default_sum"] = _default_group_sum()
    conn.close()
    return out


def _trainer(rank: int, world: int, port: int, engines: int, transport: str) -> dict:
    conn = tr.connect(role="trainer", rank=rank, world_size=world, peer_world_size=engines,
                      address="127.0.0.1", port=port, backend="gloo", timeout=60.0)
    src = build_toy(SPEC, TRAINER, rank, 0)
    return _refits(conn, src, None, lambda seed: True, transport)


def _engine(rank: int, world: int, port: int, engines: int, transport: str) -> dict:
    conn = tr.connect(role="engine", rank=rank, world_size=world, peer_world_size=2,
                      address="127.0.0.1", port=port, backend="gloo", timeout=60.0)
    dst = build_toy(SPEC, ENGINE, rank, 99)
    out = {"before": tr.weight_version(dst)}
    out.update(_refits(conn, None, dst, lambda seed: _matches(dst, ENGINE, rank, seed), transport))
    return out


@pytest.mark.parametrize("transport", usable_transports(cuda=False))
def test_trainer_and_engine_jobs(transport: str) -> None:
    """Each transport usable on CPU here (nixl: its notifications are tagged with ranks
    of the joint group, which both jobs share, not of each job's own default group)."""
    trainers, engines = run_jobs(_trainer, 2, _engine, 3, 3, transport, timeout=240)
    for got in trainers + engines:
        assert got["transport"] == transport, got
    for rank, got in enumerate(trainers):
        assert got["joint"] == (rank, 5)
        assert got["versions"] == [1, 2, 10] and got["after_failure"] == (10, None)
        assert got["default_sum"] == 2 and got["swap_version"] == 1
        assert got["offsets"] == (0, 2)
    for rank, got in enumerate(engines):
        assert got["joint"] == (2 + rank, 5)
        assert got["before"] is None
        assert got["ok1"] and got["ok2"] and got["ok3"] and got["swap_ok"], got
        assert (got["stamp1"], got["stamp2"], got["stamp3"]) == (1, 2, 10)
        assert got["versions"] == [1, 2, 10]
        assert got["after_failure"] == (10, 10)  # the failed refit left version 10
        assert got["received"] > 0 and got["default_sum"] == 3


# ------------------------------------------------------------------ missing peers
TIMEOUT = 3.0


def _attempt(**kwargs) -> tuple[str, str, float]:
    t0 = time.monotonic()
    try:
        tr.connect(address="127.0.0.1", timeout=TIMEOUT, **kwargs)
        return "connected", "", time.monotonic() - t0
    except tr.RefitError as e:
        return type(e).__name__, str(e), time.monotonic() - t0


def _lonely(rank: int, world: int) -> dict:
    """Nobody else comes: a trainer waits for engines, an engine for the trainer."""
    return {
        "no_engines": _attempt(role="trainer", rank=0, world_size=1, peer_world_size=3,
                               port=free_port()),
        "no_trainer": _attempt(role="engine", rank=0, world_size=1, peer_world_size=2,
                               port=free_port()),
    }


def test_missing_peer_raises_naming_it() -> None:
    got = run_world(_lonely, 1, timeout=120)[0]
    kind, msg, seconds = got["no_engines"]
    assert kind == "ConnectError" and "missing engine ranks [0, 1, 2]" in msg, msg
    assert seconds < TIMEOUT + 10
    kind, msg, seconds = got["no_trainer"]
    assert kind == "ConnectError" and "missing trainer rank 0" in msg, msg
    assert seconds < TIMEOUT + 10


def _partial_trainer(rank: int, world: int, port: int, engines: int) -> tuple:
    return _attempt(role="trainer", rank=rank, world_size=world, peer_world_size=engines, port=port)


def _partial_engine(rank: int, world: int, port: int, engines: int) -> tuple:
    if rank == world - 1:
        return ("skipped", "", 0.0)  # this engine rank never calls connect
    return _attempt(role="engine", rank=rank, world_size=world, peer_world_size=2, port=port)


def _disagree_engine(rank: int, world: int, port: int, engines: int) -> tuple:
    return _attempt(role="engine", rank=rank, world_size=world, peer_world_size=2, port=port)


def test_one_missing_engine_rank() -> None:
    trainers, engines = run_jobs(_partial_trainer, 2, _partial_engine, 3, 3, timeout=120)
    for kind, msg, seconds in trainers + engines[:-1]:
        assert kind == "ConnectError", msg
        assert "missing engine ranks [2]" in msg and "trainer ranks" not in msg, msg
        assert seconds < TIMEOUT + 10
    assert engines[-1][0] == "skipped"


def test_jobs_that_disagree_about_sizes() -> None:
    # the engine says the trainer job has 2 ranks; it has 1: the trainer sees everyone
    # it expects register, finds the engine's view differs and tells everyone
    trainers, engines = run_jobs(_partial_trainer, 1, _disagree_engine, 1, 1, timeout=120)
    for kind, msg, seconds in trainers + engines:  # the engine hears it from the trainer
        assert kind == "ConnectError" and "disagree" in msg, msg
        assert "1 trainer + 1 engine" in msg and "2 trainer + 1 engine" in msg, msg
        assert seconds < TIMEOUT + 10


# ---------------------------------------------------------------------------- NCCL
def _nccl_trainer(rank: int, world: int, port: int, engines: int) -> dict:
    torch.cuda.set_device(0)
    conn = tr.connect(role="trainer", rank=rank, world_size=world, peer_world_size=engines,
                      address="127.0.0.1", port=port, backend="nccl", timeout=60.0)
    src = build_toy(SPEC, Mesh(tp=1, ranks=1), rank, 5, device="cuda")
    r = tr.Refitter(src, None, group=conn, transport="nccl")
    rep = r.refit()
    conn.close()
    return {"version": rep.version, "transport": rep.transport}


def _nccl_engine(rank: int, world: int, port: int, engines: int) -> dict:
    torch.cuda.set_device(1)
    conn = tr.connect(role="engine", rank=rank, world_size=world, peer_world_size=1,
                      address="127.0.0.1", port=port, backend="nccl", timeout=60.0)
    dst = build_toy(SPEC, Mesh(tp=1, ranks=1), rank, 99, device="cuda")
    r = tr.Refitter(None, dst, group=conn, transport="nccl")
    rep = r.refit()
    want = expected_local(SPEC, Mesh(tp=1, ranks=1), rank, 5)
    ok = all(torch.equal(v.cpu(), want[k]) for k, v in dst.state_dict().items())
    conn.close()
    return {"ok": ok, "version": tr.weight_version(dst), "bytes": rep.bytes_received}


@pytest.mark.gpu
def test_nccl_jobs() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL cannot pair two ranks on one GPU; needs 2 GPUs")
    trainers, engines = run_jobs(_nccl_trainer, 1, _nccl_engine, 1, 1, timeout=240)
    assert trainers[0] == {"version": 1, "transport": "nccl"}
    assert engines[0]["ok"] and engines[0]["version"] == 1 and engines[0]["bytes"] > 0


def _ipc_trainer(rank: int, world: int, port: int, engines: int) -> dict:
    conn = tr.connect(role="trainer", rank=rank, world_size=world, peer_world_size=engines,
                      address="127.0.0.1", port=port, backend="nccl", timeout=60.0)
    src = build_toy(SPEC, Mesh(tp=1, ranks=1), rank, 0, device="cuda")
    r = tr.Refitter(src, None, group=conn, transport="ipc")
    versions = []
    for seed in (5, 6):
        _set_weights(src, Mesh(tp=1, ranks=1), rank, seed)
        versions.append(r.refit().version)
    conn.close()
    return {"versions": versions}


def _ipc_engine(rank: int, world: int, port: int, engines: int) -> dict:
    conn = tr.connect(role="engine", rank=rank, world_size=world, peer_world_size=1,
                      address="127.0.0.1", port=port, backend="nccl", timeout=60.0)
    dst = build_toy(SPEC, Mesh(tp=1, ranks=1), rank, 99, device="cuda")
    r = tr.Refitter(None, dst, group=conn, transport="ipc")
    ok = []
    for seed in (5, 6):
        r.refit()
        want = expected_local(SPEC, Mesh(tp=1, ranks=1), rank, seed)
        ok.append(all(torch.equal(v.cpu(), want[k]) for k, v in dst.state_dict().items()))
    conn.close()
    return {"ok": ok, "version": tr.weight_version(dst)}


@pytest.mark.gpu
def test_nccl_connection_ipc_on_one_gpu() -> None:
    """A ``backend="nccl"`` connection on one GPU: its Gloo half carries the gathers and
    the IPC handshake, CUDA IPC the bytes (NCCL itself would need two GPUs)."""
    trainers, engines = run_jobs(_ipc_trainer, 1, _ipc_engine, 1, 1, timeout=240)
    assert trainers[0]["versions"] == [1, 2]
    assert engines[0] == {"ok": [True, True], "version": 2}
