"""The nixl transport for real on CPU: NIXL's UCX backend writing host memory ("DRAM")
between processes, no GPU needed (skipped where ``nixl-cu13`` is not installed).

In one 2-process Gloo world: collocated TP2 -> TP1 (each rank copies its own half and is
written its peer's) and TP1 on rank 0 -> TP2; each refit checked exact against the toy's
values (an independent oracle), refit after refit with new source values. Storage moves
are followed one side at a time: only the senders' (their WRITE requests must read the
new storage although no receiver's table changed), only the receivers', then both.
Registrations follow the storages: one moved away is deregistered once it is freed, so
after many moves each rank holds as many registrations as it has live storages (none
pinned, none stale at a reused address). WRITE requests are built once per table and
re-posted. ``verify()`` catches a corrupted destination. Casts (``cast=True``) both ways,
refit after refit: fp32 -> bf16 converted by each sender into buffers of the wire dtype,
bf16 -> fp32 landing in buffers of the wire dtype and converted on receipt, exact against the source's
values cast.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import torchrefit as tr
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local, load_seed, run_world
from torchrefit.transport.base import transport_class

pytestmark = pytest.mark.skipif(not transport_class("nixl").available(),
                                reason=f"nixl: {transport_class('nixl').available().reason}")

SPEC = ModelSpec(layers=2, hidden=64, heads=4, groups=2, ffn=128, vocab=256)


def _equal(model, spec: ModelSpec, mesh: Mesh, rank: int, seed: int) -> bool:
    if model is None:
        return True
    want = expected_local(spec, mesh, rank, seed)
    return all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def _params(model) -> list:
    return [] if model is None else list(model.parameters())


def _move(model, spec: ModelSpec, mesh: Mesh, rank: int, seed: int | None) -> None:
    """Give every parameter new storage: the toy's values of ``seed``, or zeros."""
    fresh = None if seed is None else build_toy(spec, mesh, rank, seed=seed)
    with torch.no_grad():
        for i, p in enumerate(_params(model)):
            p.data = torch.zeros_like(p) if fresh is None else _params(fresh)[i].data.clone()


def _counted(transport) -> dict:
    """Count the agent's request builds and deregistrations (the real calls still run)."""
    agent, counts = transport._agent, {"requests": 0, "deregistered": 0}

    def initialize_xfer(*args, **kwargs):
        counts["requests"] += 1
        return type(agent).initialize_xfer(agent, *args, **kwargs)

    def deregister_memory(descs, *args, **kwargs):
        counts["deregistered"] += descs.descCount()
        return type(agent).deregister_memory(agent, descs, *args, **kwargs)

    agent.initialize_xfer, agent.deregister_memory = initialize_xfer, deregister_memory
    return counts


def _case(rank: int, src_mesh: Mesh, dst_mesh: Mesh) -> dict:
    src, dst = build_toy(SPEC, src_mesh, rank, seed=1), build_toy(SPEC, dst_mesh, rank, seed=2)
    out: dict = {"differed": not _equal(dst, SPEC, dst_mesh, rank, 1) if dst is not None else True}
    r = tr.Refitter(src, dst, transport="nixl")
    counts = _counted(r._transport)
    report = r.refit()
    out["transport"], out["received"] = report.transport, report.bytes_received
    out["exact"] = _equal(dst, SPEC, dst_mesh, rank, 1)
    r.verify()
    built = counts["requests"]
    _move(src, SPEC, src_mesh, rank, 3)  # only the senders' storage moves
    r.refit()
    out["src moved"] = _equal(dst, SPEC, dst_mesh, rank, 3)
    _move(dst, SPEC, dst_mesh, rank, None)  # only the receivers'
    r.refit()
    out["dst moved"] = _equal(dst, SPEC, dst_mesh, rank, 3)
    for seed in (4, 5, 6, 7):  # both, again and again
        _move(src, SPEC, src_mesh, rank, seed)
        _move(dst, SPEC, dst_mesh, rank, None)
        r.refit()
    out["both moved"] = _equal(dst, SPEC, dst_mesh, rank, 7)
    live = {t.untyped_storage().data_ptr() for m in (src, dst) for t in _params(m)}
    out["registered"], out["live"] = len(r._transport._registered), len(live)
    out["stale registrations"] = sorted(set(r._transport._registered) - live)
    out["deregistered"] = counts["deregistered"]
    before = counts["requests"]
    load_seed(src, SPEC, src_mesh, rank, 8)  # new values, same storage: the same requests re-posted
    r.refit()
    out["same requests"] = counts["requests"] == before and (built > 0 or src is None)
    out["in place exact"] = _equal(dst, SPEC, dst_mesh, rank, 8)
    if dst is not None:
        with torch.no_grad():
            _params(dst)[0].add_(1.0)  # corrupt the destination
    try:
        r.verify()
        out["verify caught"] = dst is None
    except tr.VerificationError as e:
        out["verify caught"] = "differs" in str(e)
    r.close()
    return out


def _cast(rank: int, src_dtype: torch.dtype, dst_dtype: torch.dtype) -> dict:
    """TP2 -> TP1 with ``cast=True``: a narrowing cast is converted by the sender into
    buffers of the wire dtype, a widening one lands in a wire buffer and is converted on receipt."""
    src_spec, dst_spec = replace(SPEC, dtype=src_dtype), replace(SPEC, dtype=dst_dtype)
    src_mesh, dst_mesh = Mesh(2, ranks=2), Mesh(1, ranks=2)
    src = build_toy(src_spec, src_mesh, rank, seed=1)
    dst = build_toy(dst_spec, dst_mesh, rank, seed=2)
    r = tr.Refitter(src, dst, transport="nixl", cast=True)
    out = {}
    for seed in (1, 3):
        load_seed(src, src_spec, src_mesh, rank, seed)
        r.refit()
        want = expected_local(src_spec, dst_mesh, rank, seed)  # the source's values, cast
        out[f"exact{seed}"] = [k for k, v in dst.state_dict().items() if not torch.equal(v, want[k].to(v.dtype))]
    stages = r._program.compiled.one_sided.compiled
    out["staged"] = (len(stages.before), len(stages.after))
    r.close()
    return out


def _world(rank: int, world: int) -> dict:
    return {
        "tp2->tp1": _case(rank, Mesh(2, ranks=2), Mesh(1, ranks=2)),
        "tp1 on rank 0 -> tp2": _case(rank, Mesh(1, ranks=1), Mesh(2, ranks=2)),
        "fp32->bf16": _cast(rank, torch.float32, torch.bfloat16),
        "bf16->fp32": _cast(rank, torch.bfloat16, torch.float32),
    }


def test_nixl_writes_host_memory_between_processes() -> None:
    results = run_world(_world, 2, timeout=240)
    for rank, cases in enumerate(results):
        narrow, widen = cases.pop("fp32->bf16"), cases.pop("bf16->fp32")
        for got in (narrow, widen):
            assert got["exact1"] == [] and got["exact3"] == [], (rank, got)
        # the sender converts a narrowing cast; a widening one is converted on receipt
        assert narrow["staged"][0] > 0 and narrow["staged"][1] == 0, (rank, narrow)
        assert widen["staged"][0] == 0 and widen["staged"][1] > 0, (rank, widen)
        for name, got in cases.items():
            where = f"rank {rank} {name}: {got}"
            assert got["transport"] == "nixl", where
            assert got["differed"] and got["exact"], where
            assert got["src moved"], "a sender's storage moved: its WRITE read the old storage; " + where
            assert got["dst moved"] and got["both moved"], where
            assert got["stale registrations"] == [] and got["registered"] <= got["live"], where
            assert got["deregistered"] > 0, where
            assert got["same requests"] and got["in place exact"], where
            assert got["verify caught"], where
    for name in results[0]:
        assert results[1][name]["received"] > 0, f"{name}: nothing came through nixl to rank 1"
