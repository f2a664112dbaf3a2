"""Turns on a shared GPU (``transport.turns``): ranks of a one-host pull transport that
copy on one device copy one after another, in rank order, every refit.

On CPU through ``shm_transport``'s ``shm-pull-turns`` (every rank of the host copies on
"cpu"; each turn's copies held 50 ms before its word, every turn's start and end
logged on the one monotonic clock of the host), in one 4-process Gloo world:

- collocated TP2 -> TP1 twice over (ranks 0-3; each rank copies its half and reads its
  peer's): all four take turns, 0 then 1, 2, 3, each refit, no two turns overlapping,
  and each destination is exact against the toy's values (an independent oracle),
  refit after refit with new source values; on every rank the ready token and the
  wait for the peer's precede the turn, and the reads' done token falls inside it;
- non-collocated TP2 (ranks 0-1) -> TP1 (ranks 2-3): only the readers take turns.

The chain itself (``chain_of``) is checked as a pure function.
"""

from __future__ import annotations

import shm_transport
import torch

import torchrefit as tr
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local, load_seed, run_world
from torchrefit.transport.turns import chain_of

SPEC = ModelSpec(layers=2, hidden=64, heads=4, groups=2, ffn=128, vocab=128)
REFITS = 3


def test_chain_is_the_ranks_copying_on_one_device() -> None:
    keys = ["h/a", "h/a", "h/b", "h/a", "h/a"]
    copies = [True, False, True, True, True]
    assert chain_of(0, keys, copies) == [0, 3, 4]
    assert chain_of(3, keys, copies) == [0, 3, 4]
    assert chain_of(1, keys, copies) == []  # copies nothing: waits for nobody
    assert chain_of(2, keys, copies) == []  # alone on its device
    assert chain_of(0, ["h/a", "g/a"], [True, True]) == []  # same GPU name, other host


def _shared(model):
    if model is not None:
        model.share_memory()
    return model


def _turns(log: list[str]) -> list[tuple[float, float]]:
    starts = [float(e.split(":", 1)[1]) for e in log if e.startswith("turn_start:")]
    ends = [float(e.split(":", 1)[1]) for e in log if e.startswith("turn_end:")]
    assert len(starts) == len(ends)
    return list(zip(starts, ends))


def _case(rank: int, src_mesh: Mesh, dst_mesh: Mesh) -> dict:
    src = _shared(build_toy(SPEC, src_mesh, rank, 1))
    dst = _shared(build_toy(SPEC, dst_mesh, rank, 2))
    shm_transport.LOG.clear()
    r = tr.Refitter(src, dst, transport="shm-pull-turns")
    exact = []
    for i in range(REFITS):
        seed = 10 + i
        load_seed(src, SPEC, src_mesh, rank, seed)  # new source values each refit (the optimizer step)
        r.refit()
        exact.append(dst is None or all(torch.equal(v, expected_local(SPEC, dst_mesh, rank, seed)[k])
                                        for k, v in dst.state_dict().items()))
    turns = _turns(shm_transport.LOG)
    # the protocol's calls around each turn: ready token, then the peer's ready awaited,
    # then the turn, the reads and their done token inside it, then the turn's end
    kinds = ("ready", "wait_ready", "turn_start", "done", "turn_end")
    order = [e.split(":", 1)[0] for e in shm_transport.LOG if e.split(":", 1)[0] in kinds]
    r.close()
    return {"exact": exact, "turns": turns, "order": order}


def _world(rank: int, world: int) -> dict:
    out = {"collocated": _case(rank, Mesh(2, ranks=4), Mesh(1, ranks=4)),
           "non-collocated": _case(rank, Mesh(2, ranks=2), Mesh(1, ranks=2, offset=2))}
    return out


def _in_turn(per_rank: list[list[tuple[float, float]]], order: list[int]) -> None:
    """Each refit's turns run in ``order``, one after another."""
    for i in range(REFITS):
        spans = [per_rank[r][i] for r in order]
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end, f"refit {i}: a turn started at {start} before the previous ended at {end}"


def test_ranks_copying_on_one_device_take_turns() -> None:
    results = run_world(_world, 4, timeout=300)
    for rank, got in enumerate(results):
        for name, case in got.items():
            assert all(case["exact"]), f"rank {rank} {name}: {case['exact']}"
    for rank, got in enumerate(results):  # every rank both exposes and reads its peer's half
        assert got["collocated"]["order"] == ["ready", "wait_ready", "turn_start", "done", "turn_end"] * REFITS, \
            f"rank {rank}: {got['collocated']['order']}"
    colloc = [got["collocated"]["turns"] for got in results]
    assert [len(t) for t in colloc] == [REFITS] * 4
    _in_turn(colloc, [0, 1, 2, 3])
    noncolloc = [got["non-collocated"]["turns"] for got in results]
    assert [len(t) for t in noncolloc] == [0, 0, REFITS, REFITS]  # the senders copy nothing
    _in_turn(noncolloc, [2, 3])
