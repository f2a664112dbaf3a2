"""One copier per shared GPU (``transport.delegates``): where several ranks of a pull
transport copy on one device, the first of them does every copy of all of them.

On CPU through ``shm_transport``'s ``shm-pull-delegate`` (every rank of the host copies
on "cpu", as ranks sharing one GPU do; tensors in shared memory), in one 4-process Gloo
world, each destination checked exact against the toy's values (an independent oracle)
refit after refit with new source values:

- collocated TP2 -> TP1 (ranks 0-3): rank 0 reads every source and writes every
  destination; ranks 1-3 only post their ready token and wait for rank 0's done;
- non-collocated TP2 (ranks 0-1) -> TP1 (ranks 2-3): rank 2 copies for rank 3, and the
  senders' tables go to rank 2 only;
- TP1 -> TP1 on every rank (local copies only): rank 0 does all four ranks' copies;
- non-collocated PP2 -> PP2: rank 2 copies for rank 3 from rank 1, which rank 2 itself
  never reads (it learns of it from rank 3's work);
- non-collocated TP1 (rank 0) -> TP2 (ranks 1-2): rank 1 reads both halves from one
  table of rank 0's, its own and rank 2's;
- a member's destination storage moves (``param.data = ...``): it recompiles, rank 0
  attaches its new table, and the refit is still exact; ``verify()`` passes throughout;
- two devices (ranks 0 and 2 on one, 1 and 3 on the other), collocated TP2 -> TP1:
  each device's delegate reads from the other's ranks and both delegates read each rank;
- ``settings.delegate_copies`` off: the ranks take turns instead (and are exact). The cases
  above leave the variable unset: delegating is the default.

``shm-pull-word-delegate`` (2 processes, members ordered by words their fake streams
write) checks the cross-process order: a member's late producer runs before the
delegate reads, and the member's ``refit()`` returns after the delegate's copies.
``delegates_of`` and ``delegated_copies`` (which table region pairs with which, and the
refusals where a member sent no work or a table or a work does not fit) are checked as
pure functions.
"""

from __future__ import annotations

import time

import shm_transport
import torch

import torchrefit as tr
from torchrefit import settings
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local, load_seed, run_world
from torchrefit.transport.delegates import delegates_of
from torchrefit.transport.one_sided import protocol as one_sided
from torchrefit.transport.turns import device_key

SPEC = ModelSpec(layers=2, hidden=64, heads=4, groups=2, ffn=128, vocab=128)
REFITS = 3
LATE = 0.3  # seconds a member's producer runs late on its fake stream


def test_delegates_are_each_devices_first_copier() -> None:
    keys = ["h/a", "h/a", "h/b", "h/a", "h/b", "h/c"]
    copies = [False, True, True, True, True, True]
    assert delegates_of(keys, copies, [True] * 6) == {1: 1, 3: 1, 2: 2, 4: 2}  # h/c: alone
    # one rank of h/b cannot hand its copies over: nobody on h/b delegates
    assert delegates_of(keys, copies, [True, True, True, True, False, True]) == {1: 1, 3: 1}
    assert delegates_of(["h/a", "g/a"], [True, True], [True, True]) == {}  # same GPU name, other host
    assert delegates_of([], [], []) == {}


def _shared(model):
    if model is not None:
        model.share_memory()
    return model


def _exact(dst, mesh: Mesh, rank: int, seed: int) -> list[str]:
    if dst is None:
        return []
    want = expected_local(SPEC, mesh, rank, seed)
    return [k for k, v in dst.state_dict().items() if not torch.equal(v, want[k])]


def _case(rank: int, src_mesh: Mesh, dst_mesh: Mesh, move: int | None = None) -> dict:
    src = _shared(build_toy(SPEC, src_mesh, rank, 1))
    dst = _shared(build_toy(SPEC, dst_mesh, rank, 2))
    shm_transport.LOG.clear()
    r = tr.Refitter(src, dst, transport="shm-pull-delegate", timeout=30)
    wrong, logs = [], []
    for i in range(REFITS + (move is not None)):
        seed = 10 + i
        load_seed(src, SPEC, src_mesh, rank, seed)  # new source values each refit (the optimizer step)
        if i == REFITS and rank == move:  # the engine re-allocated its weights
            for p in dst.parameters():
                p.data = torch.zeros_like(p.data).share_memory_()
        shm_transport.LOG.clear()
        r.refit()
        logs.append(list(shm_transport.LOG))
        wrong.append(_exact(dst, dst_mesh, rank, seed))
    r.verify()  # not delegated: every rank compares its own
    r.close()
    return {"wrong": wrong, "logs": logs}


def _world(rank: int, world: int) -> dict:
    settings.configure(delegate_copies=True)  # the default: a delegate per device
    out = {"collocated": _case(rank, Mesh(2, ranks=4), Mesh(1, ranks=4), move=1),
           "non-collocated": _case(rank, Mesh(2, ranks=2), Mesh(1, ranks=2, offset=2)),
           "local": _case(rank, Mesh(1, ranks=4), Mesh(1, ranks=4)),
           "pp": _case(rank, Mesh(1, pp=2, ranks=2), Mesh(1, pp=2, ranks=2, offset=2)),
           "split": _case(rank, Mesh(1, ranks=1), Mesh(2, ranks=2, offset=1))}
    # two "GPUs": even ranks on one, odd on the other (as ranks 0-3 placed round-robin)
    one_sided.device_key = lambda device, rank=rank: f"host/gpu{rank % 2}"
    out["two-gpus"] = _case(rank, Mesh(2, ranks=4), Mesh(1, ranks=4))
    one_sided.device_key = device_key
    settings.configure(delegate_copies=False)
    out["off"] = _case(rank, Mesh(2, ranks=4), Mesh(1, ranks=4))
    return out


def _reached(*peers: int, attach: bool = False) -> list[str]:
    """A delegate's calls reaching ``peers`` in order: attach (first refit), then the wait."""
    return [e for p in peers for e in ([f"attach:{p}"] if attach else []) + [f"wait_ready:{p}"]]


def _calls(log: list[str]) -> list[str]:
    return [e for e in log if not e.startswith("turn_")]


def test_one_rank_copies_for_all_on_a_shared_device() -> None:
    results = run_world(_world, 4, timeout=300)
    for rank, got in enumerate(results):
        for name, case in got.items():
            assert all(w == [] for w in case["wrong"]), f"rank {rank} {name}: {case['wrong']}"
    colloc = [got["collocated"]["logs"] for got in results]
    # the first refit attaches every member's table; later ones only wait for the words
    assert _calls(colloc[0][0]) == [*_reached(1, 2, 3, attach=True), "done"], colloc[0][0]
    for i in range(1, REFITS):
        assert _calls(colloc[0][i]) == [*_reached(1, 2, 3), "done"], colloc[0][i]
    for rank in (1, 2, 3):
        assert all(_calls(log) == ["ready", "wait_done:0"] for log in colloc[rank]), (rank, colloc[rank])
    # rank 1's destination moved before the last refit: its new table, nobody else's
    assert [e for e in colloc[0][REFITS] if e.startswith("attach:")] == ["attach:1"], colloc[0][REFITS]
    assert not any(e.startswith("turn_") for got in results for log in got["collocated"]["logs"] for e in log)
    noncolloc = [got["non-collocated"]["logs"][0] for got in results]
    assert _calls(noncolloc[2]) == [*_reached(0, 1, 3, attach=True), "done"], noncolloc[2]
    for rank in (0, 1, 3):  # the senders' tables and rank 3's go to rank 2 only
        assert _calls(noncolloc[rank]) == ["ready", "wait_done:2"], (rank, noncolloc[rank])
    local = [got["local"]["logs"][0] for got in results]
    assert _calls(local[0]) == [*_reached(1, 2, 3, attach=True), "done"], local[0]
    assert all(_calls(local[r]) == ["ready", "wait_done:0"] for r in (1, 2, 3)), local
    # PP2 -> PP2: rank 3 reads only rank 1, whom rank 2 learns of from rank 3's work
    pp = [got["pp"]["logs"][0] for got in results]
    assert _calls(pp[2]) == [*_reached(0, 3, 1, attach=True), "done"], pp[2]
    assert all(_calls(pp[r]) == ["ready", "wait_done:2"] for r in (0, 1, 3)), pp
    # TP1 (rank 0) -> TP2 (ranks 1-2): rank 0's table for rank 1 holds both halves,
    # rank 1's first, then rank 2's; rank 3 holds nothing and takes no part
    split = [got["split"]["logs"][0] for got in results]
    assert _calls(split[1]) == [*_reached(0, 2, attach=True), "done"], split[1]
    assert _calls(split[0]) == ["ready", "wait_done:1"] and _calls(split[3]) == [], split
    # two GPUs, ranks 0 and 2 on one, 1 and 3 on the other: rank 0 copies for 0 and 2,
    # reading rank 1 (its half of TP group 0-1), rank 2 and rank 3 (rank 2's other half,
    # learnt from rank 2's work); rank 1 likewise for 1 and 3; each holder's table goes to
    # both delegates
    two = [got["two-gpus"]["logs"][0] for got in results]
    assert _calls(two[0]) == ["ready", *_reached(1, 2, 3, attach=True), "done", "wait_done:1"], two[0]
    assert _calls(two[1]) == ["ready", *_reached(0, 3, 2, attach=True), "done", "wait_done:0"], two[1]
    for rank in (2, 3):
        assert _calls(two[rank]) == ["ready", "wait_done:0", "wait_done:1"], (rank, two[rank])
    off = [got["off"]["logs"] for got in results]  # turns, each rank reading its own
    assert all(any(e.startswith("turn_start") for e in log) for logs in off for log in logs), off


def _word_world(rank: int, world: int) -> dict:
    """TP1 -> TP1 on both ranks, rank 0 copying for rank 1. Each refit rank 1's producer
    runs LATE on its fake stream (queued before ``refit()``): rank 0 must read only
    after it, and rank 1's ``refit()`` must return only after rank 0 wrote."""
    settings.configure(delegate_copies=True)
    mesh = Mesh(1, ranks=2)
    src, dst = _shared(build_toy(SPEC, mesh, rank, 1)), _shared(build_toy(SPEC, mesh, rank, 2))
    r = tr.Refitter(src, dst, transport="shm-pull-word-delegate")
    want = expected_local(SPEC, mesh, rank, 1)
    stale = []
    for k in range(3):
        torch.distributed.barrier()
        late = 2.0 if k == 0 else LATE  # the first refit also compiles
        if rank == 1:
            shm_transport.STREAM.queue(lambda late=late: (time.sleep(late), [p.data.add_(1.0) for p in src.parameters()]))
        else:
            with torch.no_grad():
                for p in src.parameters():
                    p.add_(1.0)
        r.refit()
        want = {n: v + 1.0 for n, v in want.items()}  # the same roundings as the source's
        stale.append([n for n, v in dst.state_dict().items() if not torch.equal(v, want[n])])
        shm_transport.STREAM.synchronize()
    r.close()
    return {"stale": stale}


def test_delegate_waits_for_members_and_members_for_it() -> None:
    results = run_world(_word_world, 2, timeout=240)
    assert [got["stale"] for got in results] == [[[], [], []]] * 2, results


def test_delegated_copies_pair_tables_by_member_and_refuse_what_disagrees() -> None:
    """``delegated_copies`` as a pure function on tensors: rank 0 delegates for itself and
    rank 1; rank 2 sends both. Oracle: which tensor lands where, by identity."""
    import pytest

    from torchrefit.errors import TransportError
    from torchrefit.execute.one_sided_program import Delegation, Work, delegated_copies

    t = {k: torch.zeros(n) for k, n in (("a", 2), ("b", 3), ("own_dst", 2), ("m_src", 4), ("m_dst", 4),
                                        ("m_dst2", 3), ("d_src", 5), ("m_dst3", 5))}
    d = Delegation((0, 1), {2: ((t["own_dst"], "own <- 2"),)}, {1: (t["d_src"],)})
    # rank 2's table for rank 0: its source for rank 0 (a), then for rank 1 (b)
    # rank 1's table: its local copy's source and destination, its reception from 2, from 0
    remote = [(1, 7, (t["m_src"], t["m_dst"], t["m_dst2"], t["m_dst3"])), (2, 3, (t["a"], t["b"]))]
    works = {1: Work(((0, 1, "m local"),), ((2, 2, "m <- 2"), (0, 3, "m <- 0")))}
    got = [(c.dst, c.src, c.name) for c in delegated_copies(d, 0, remote, works)]
    want = [(t["own_dst"], t["a"], "own <- 2"), (t["m_dst"], t["m_src"], "m local"),
            (t["m_dst2"], t["b"], "m <- 2"), (t["m_dst3"], t["d_src"], "m <- 0")]
    assert [(id(x), id(y), n) for x, y, n in got] == [(id(x), id(y), n) for x, y, n in want]
    with pytest.raises(TransportError, match="rank 1 copies on this rank's GPU but sent it no work"):
        delegated_copies(d, 0, remote, {1: None})
    short = [remote[0], (2, 3, (t["a"],))]  # rank 2's table lacks rank 1's region
    with pytest.raises(TransportError, match=r"rank 2's exposed regions \(1\) do not match"):
        delegated_copies(d, 0, short, works)
    with pytest.raises(TransportError, match="rank 1 receives 0 regions from this rank, which sends it 1"):
        delegated_copies(d, 0, [(1, 7, (t["m_src"], t["m_dst"], t["m_dst2"])), remote[1]],
                         {1: Work(((0, 1, "m local"),), ((2, 2, "m <- 2"),))})
