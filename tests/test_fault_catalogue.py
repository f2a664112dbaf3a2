"""The fault catalogue at refit time: what a user can cause or suffer once a Refitter
exists, each on real processes (gloo); planning faults are in
``tests/test_planning_faults.py``.

Every case asserts that every rank raises the expected error within a bound (or
finishes with the right weights, checked against an oracle) and that the destination
is unchanged, fully updated, or, where a peer died mid-refit, holds only old or new
values (never garbage) with the error saying so. docs/reliability.md ("The fault
catalogue") lists the catalogue with these results. Cases (one world each): a rank killed before a refit, with the default timeout and with ``timeout=None``;
a rank that stops (sleeps) past a short timeout, through gloo rounds and through a
one-sided transport; a rank killed, and one stopped, under nixl for real (CPU memory,
where ``nixl-cu13`` is installed); a rank that never builds its Refitter; a storage move between
refits; a flipped destination byte caught by ``verify()``; ``swap_model_weights`` with list keywords, a
cache that drops dead models, a Gloo group built over a non-Gloo group; and 1000 refits
with flat memory and unchanged results.
"""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch

import torchrefit as tr
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local, run_world

SPEC = ModelSpec(layers=2)
TP2, TP1 = Mesh(2, ranks=4), Mesh(1, ranks=4)


# ---------------------------------------------------------- a peer dies or stops
def _old_or_new(dst, old: dict, rank: int) -> bool:
    """Every destination element holds its old value or the source's: never garbage."""
    want = expected_local(SPEC, TP1, rank, 1)
    return all(bool(((v == old[k]) | (v == want[k])).all()) for k, v in dst.state_dict().items())


def _absent_world(rank: int, world: int) -> dict:
    """Rank 3 is alive but never builds its Refitter: the others' roster gather must end
    by the refit's timeout (gloo would notice a rank that exited by itself)."""
    if rank == 3:
        time.sleep(40)
        return {}
    t0 = time.perf_counter()
    try:
        tr.Refitter(build_toy(SPEC, TP2, rank, 1), build_toy(SPEC, TP1, rank, 2), timeout=5.0)
        return {"raised": None, "seconds": time.perf_counter() - t0}
    except tr.RefitError as e:
        return {"raised": type(e).__name__, "msg": str(e), "seconds": time.perf_counter() - t0}


def test_rank_absent_from_construction() -> None:
    for rank, got in enumerate(run_world(_absent_world, 4, timeout=240, pg_timeout=120)[:3]):
        assert got["raised"] == "TransportError" and "gathering metadata" in got["msg"], (rank, got)
        assert got["seconds"] < 5.0 + 25.0, (rank, got)  # not the group's own 120 s


def _dying_world(rank: int, world: int, mode: str) -> dict:
    kwargs = {}
    if mode == "stopped-one-sided":  # pull through shared memory: Gloo control messages
        import shm_transport  # noqa: F401  (registers shm-pull)

        kwargs["transport"] = "shm-pull"
    if mode.endswith("-nixl"):  # push through NIXL for real (CPU memory)
        kwargs["transport"] = "nixl"
    src = build_toy(SPEC, TP2, rank, 1)
    dst = build_toy(SPEC, TP1, rank, 2)
    if kwargs.get("transport") == "shm-pull":
        src.share_memory()
    old = {k: v.clone() for k, v in dst.state_dict().items()}
    timeout = {"killed": tr.refitter.DEFAULT_TIMEOUT, "killed-no-timeout": None, "stopped": 4.0,
               "stopped-one-sided": 4.0, "killed-nixl": 20.0, "stopped-nixl": 4.0}[mode]
    r = tr.Refitter(src, dst, timeout=60.0 if timeout and timeout < 10 else timeout, **kwargs)
    r.timeout = r._transport.timeout = timeout  # short for the refit only: start-up is slow here
    if rank == 3 and mode.startswith("killed"):
        os._exit(17)  # dies between planning and the refit
    if rank == 3 and mode.startswith("stopped"):
        time.sleep(12)  # stops past its peers' timeout, then tries
    t0 = time.perf_counter()
    out: dict = {}
    try:
        r.refit()
        out["raised"] = None
    except tr.RefitError as e:
        out["raised"], out["msg"] = type(e).__name__, str(e)
    out["seconds"] = time.perf_counter() - t0
    want = expected_local(SPEC, TP1, rank, 1)
    out["updated"] = all(torch.equal(v, want[k]) for k, v in dst.state_dict().items())
    out["old_or_new"] = _old_or_new(dst, old, rank)
    if out["raised"]:
        try:
            r.refit()
            out["again"] = None
        except tr.TransportError as e:
            out["again"] = str(e)
    return out


_NIXL = pytest.mark.skipif(not tr.transport.base.transport_class("nixl").available(),
                           reason="nixl-cu13 is not installed")


@pytest.mark.parametrize("mode,bound", [("killed", 30.0), ("killed-no-timeout", 30.0), ("stopped", 30.0),
                                        ("stopped-one-sided", 30.0),
                                        pytest.param("killed-nixl", 30.0, marks=_NIXL),
                                        pytest.param("stopped-nixl", 30.0, marks=_NIXL)])
def test_peer_dies_or_stops(mode: str, bound: float) -> None:
    # with a short refit timeout, the group's own (pg_timeout) is longer than the bound:
    # only torchrefit's own deadline can end the waits in time
    pg_timeout = 120 if mode.startswith("stopped") else 20
    results = run_world(_dying_world, 4, mode, timeout=240, pg_timeout=pg_timeout, may_die=[3])
    alive = results[:3] if mode.startswith("killed") else results
    raised = [got for got in alive if got["raised"]]
    assert raised, f"{mode}: no rank noticed the dead peer"
    for rank, got in enumerate(alive):
        assert got["seconds"] < bound, (rank, got["seconds"])
        assert got["old_or_new"], f"rank {rank}: destination holds garbage"
        if got["raised"] is None:
            assert got["updated"], f"rank {rank} finished without the new weights"
            continue
        assert got["raised"] == "TransportError", (rank, got)
        if rank != 3:
            assert "rank 3" in got["msg"], (rank, got["msg"])
        assert "partly updated" in got["msg"] or "did not make the same call" in got["msg"], got["msg"]
        assert got["again"] and "an earlier refit failed" in got["again"], got["again"]
    if mode.startswith("stopped"):
        assert results[3]["raised"] == "TransportError", results[3]


# --------------------------------------------- storage moves, verify, drop-in
def _refit_time_world(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from torchrefit import swap as module

    out: dict = {}
    src = build_toy(SPEC, TP2, rank, 1)
    dst = build_toy(SPEC, TP1, rank, 2)
    want = expected_local(SPEC, TP1, rank, 1)
    r = tr.Refitter(src, dst)
    r.refit()
    with torch.no_grad():
        for p in dst.parameters():  # an engine's sleep / wake: new storage, old values gone
            p.data = torch.zeros_like(p)
    r.refit()
    out["storage_move"] = all(torch.equal(v, want[k]) for k, v in dst.state_dict().items())
    r.verify()
    if rank == 2:
        with torch.no_grad():
            getattr(dst.decoder.layers, "1").self_attention.linear_qkv.weight.view(-1).view(torch.uint8)[5] ^= 0x10
    try:
        r.verify()
        out["flipped"] = None
    except tr.VerificationError as e:
        out["flipped"] = str(e)
    # drop-in: list keywords hit the cache
    d2 = build_toy(SPEC, TP1, rank, 2)
    a = tr.swap_model_weights(src, d2, refit_method="gloo", skip=["*.nothing"], cast=True)
    b = tr.swap_model_weights(src, d2, refit_method="gloo", skip=["*.nothing"], cast=True)
    out["list_kwargs"] = (a.compiled, b.compiled)
    out["list_correct"] = all(torch.equal(v, want[k]) for k, v in d2.state_dict().items())
    # the cache holds models weakly: a dead engine drops its entry
    before = len(module._CACHE)
    del d2, a, b
    gc.collect()
    out["dropped"] = (before, len(module._CACHE))
    # refit_method="gloo" over a group whose backend is not Gloo: a Gloo group over its ranks
    real = dist.get_backend
    dist.get_backend = lambda g=None: "nccl" if g is dist.group.WORLD else real(g)
    try:
        d3 = build_toy(SPEC, TP1, rank, 2)
        tr.swap_model_weights(src, d3, refit_method="gloo")
        gloo = module._GLOO_GROUPS.get(tuple(range(world)))
        out["gloo_group"] = gloo is not None and gloo is not dist.group.WORLD
        out["gloo_correct"] = all(torch.equal(v, want[k]) for k, v in d3.state_dict().items())
    finally:
        dist.get_backend = real
    tr.clear_caches()
    out["cleared"] = len(module._CACHE)
    return out


@pytest.fixture(scope="module")
def refit_time():
    return run_world(_refit_time_world, 4, timeout=300, pg_timeout=60)


def test_storage_move_between_refits_recompiles(refit_time) -> None:
    assert all(got["storage_move"] for got in refit_time)


def test_flipped_destination_byte_caught_by_verify(refit_time) -> None:
    for got in refit_time:
        assert got["flipped"] and "decoder.layers.1.self_attention.linear_qkv.weight" in got["flipped"]
        assert "on destination rank 2" in got["flipped"], got["flipped"]


def test_drop_in_edge_cases(refit_time) -> None:
    for got in refit_time:
        assert got["list_kwargs"] == (True, False) and got["list_correct"]
        before, after = got["dropped"]
        assert after == before - 1, got["dropped"]
        assert got["gloo_group"] and got["gloo_correct"]
        assert got["cleared"] == 0


# ------------------------------------------------------------------ long runs
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _long_world(rank: int, world: int, n: int) -> dict:
    src = build_toy(SPEC, Mesh(2, ranks=2), rank, 1)
    dst = build_toy(SPEC, Mesh(1, ranks=2), rank, 2)
    want = expected_local(SPEC, Mesh(1, ranks=2), rank, 1)
    r = tr.Refitter(src, dst)
    rss, wrong = [], 0
    for i in range(n):
        with torch.no_grad():
            for p in dst.parameters():
                p.zero_()  # every refit must write every element again
        r.refit()
        if i % 100 == 99:
            wrong += sum(not torch.equal(v, want[k]) for k, v in dst.state_dict().items())
            gc.collect()
            rss.append(_rss())
    r.verify()
    return {"rss": rss, "wrong": wrong, "version": r.version}


def test_1000_refits_flat_memory_unchanged_results() -> None:
    for got in run_world(_long_world, 2, 1000, timeout=600, pg_timeout=60):
        assert got["version"] == 1000 and got["wrong"] == 0
        growth = got["rss"][-1] - got["rss"][1]  # after warm-up
        assert growth < 4 << 20, f"host memory grew {growth / 2**20:.1f} MiB over 800 refits: {got['rss']}"


# ------------------------------------------------------------------ timeouts agree
def test_refit_timeout_is_at_most_the_connections() -> None:
    """With a ``tr.connect`` Connection the refit waits at most the connection's timeout
    (its joint group's own bounds every collective anyway); None takes the connection's."""
    from torchrefit.connect import Connection
    from torchrefit.refitter import _timeout

    conn = Connection("trainer", 0, 1, 1, "gloo", 20.0)
    assert _timeout(300.0, conn) == 20.0 and _timeout(5.0, conn) == 5.0 and _timeout(None, conn) == 20.0
    assert _timeout(300.0, None) == 300.0 and _timeout(None, None) is None
    for bad in (0, -1.0, "10"):
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            _timeout(bad, None)
