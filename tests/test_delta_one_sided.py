"""Delta refits over one-sided transports (``execute.delta_one_sided``) and nvshmem, on CPU
processes through the shared-memory test transports of ``shm_transport.py``: ``shm-pull``
(receivers read the senders' registered slots and sources, as ipc), ``shm-pull-word``
(the same, ordered by stream-written mailbox words), ``shm-push`` (senders write the
receivers' registered slots and destinations, as nixl) and ``shm-nvshmem`` (the nvshmem
transport's inbox, signals and acknowledgements over faked host bindings), and the real
``nixl`` transport (NIXL's UCX backend writing host memory) where it is installed.

The oracle is a full refit of the same source into a second destination over the same
transport, compared bit for bit after every call. Covers: every dtype (``test_delta``'s
scenario: casts, block-FP8 targets, NaN payloads, -0.0, densities 0 to 100%: sparse and
the dense fallback); the version chain with stage / commit (``test_delta``'s sequence:
a committed stage, replaced tensors, refits dropping a staged version); one sender and
two receivers where one receiver's engine reloads its weights (that pair gets full
bytes, the other keeps patching, in the same call) and, collocated, a TP change with
stage / commit; a ``delta_dense_above`` raised after compiling (payloads that outgrow
the registered slots go dense); the protocol's order on every rank (ready before any
wait, wait_ready before the reads or writes, done after them, wait_done last), and the
same seen in data: a pull sender that overwrites its slots and sources as soon as its
refit returns, or a push receiver that reads its weights then, while the initiator
dawdles; nvshmem headers larger than an inbox slot; a failed refit.
"""

from __future__ import annotations

import pytest
import shm_transport
import torch
from test_delta import (
    SPEC,
    _chain_world,
    _dtypes_world,
    _failed_world,
    _same,
    check_chain,
    check_dtypes,
)
from test_one_sided_cpu import _check_order, _shared

import torchrefit as tr
from torchrefit.testing import Mesh, build_toy, run_world
from torchrefit.transport.base import transport_class

ONE_SIDED = ["shm-pull", "shm-push"]
#: the real nixl transport, NIXL's UCX backend writing host memory (test_nixl_dram.py)
NIXL = pytest.param("nixl", marks=pytest.mark.skipif(not transport_class("nixl").available(),
                                                    reason=f"nixl: {transport_class('nixl').available().reason}"))
ALL = ["shm-pull", "shm-pull-word", "shm-push", "shm-nvshmem", NIXL]


@pytest.mark.parametrize("transport", ALL)
def test_every_dtype_bit_exact_at_every_density(transport: str) -> None:
    results = run_world(_dtypes_world, 2, "device", "cpu", transport, timeout=240)
    check_dtypes(results)


@pytest.mark.parametrize("transport", ["shm-pull", "shm-push"])
def test_host_reference_and_torch_ops(transport: str) -> None:
    check_dtypes(run_world(_dtypes_world, 2, "host", "cpu", transport, False, timeout=240))


@pytest.mark.parametrize("transport", ["shm-pull", "shm-push", "shm-nvshmem", NIXL])
def test_version_chain_never_patches_the_wrong_base(transport: str) -> None:
    check_chain(run_world(_chain_world, 2, transport, timeout=180)[1]["rows"])


# --------------------------------------------- one sender, two receivers, one reloads
def _reload_world(rank: int, world: int, transport: str) -> dict:
    """Rank 0 sends to ranks 1 and 2 (each a whole replica). Each step changes 1% of the
    elements (0 changed at step 2, every element at step 4); at step 3 rank 2's engine
    reloads its weights (new tensors of other contents)."""
    g = torch.Generator().manual_seed(3)
    shapes = {"a": (384, 512), "b": (1000,), "c": (7, 3)}
    src = {k: torch.randn(s, generator=g).to(torch.bfloat16).share_memory_() for k, s in shapes.items()} \
        if rank == 0 else None
    dst_d = {k: torch.zeros(s, dtype=torch.bfloat16).share_memory_() for k, s in shapes.items()} if rank else None
    dst_f = {k: torch.zeros(s, dtype=torch.bfloat16).share_memory_() for k, s in shapes.items()} if rank else None
    r_d = tr.Refitter(src, dst_d, transport=transport, delta="device")
    r_f = tr.Refitter(src, dst_f, transport=transport)
    rows = []
    for step in range(6):
        if rank == 0 and step:
            for t in src.values():
                mask = torch.rand(t.shape, generator=g) < (0.0 if step == 2 else 1.0 if step == 4 else 0.01)
                t[mask] += 1.0
        if rank == 2 and step == 3:
            for k in shapes:
                dst_d[k] = torch.full(shapes[k], 5.0, dtype=torch.bfloat16).share_memory_()
                dst_f[k] = dst_d[k].clone().share_memory_()
        rep = r_d.refit()
        r_f.refit()
        rows.append({"wrong": _same(dst_d, dst_f) if rank else [], "wire": rep.wire_bytes_received,
                     "sent": rep.wire_bytes_sent})
    return {"rows": rows, "full": r_f.plan.bytes_received}


@pytest.mark.parametrize("transport", ALL)
def test_a_reloaded_receiver_gets_full_bytes_while_the_other_patches(transport: str) -> None:
    results = run_world(_reload_world, 3, transport, timeout=240)
    for rank in (1, 2):
        rows, full = results[rank]["rows"], results[rank]["full"]
        assert [r["wrong"] for r in rows] == [[]] * 6, (rank, rows)
        kinds = ["full" if r["wire"] >= full else "patch" if r["wire"] < full / 10 else "?" for r in rows]
        want = ["full", "patch", "patch", "full" if rank == 2 else "patch", "full", "patch"]
        assert kinds == want, (rank, kinds, rows)
    sent = [r["sent"] for r in results[0]["rows"]]
    assert sent[2] < 200 and sent[1] < 2 * results[1]["full"] / 10, sent  # headers alone; two patches


# --------------------------------------------------- collocated, across a TP change
def _toy_world(rank: int, world: int, transport: str) -> dict:
    src = _shared(build_toy(SPEC, Mesh(2, ranks=2), rank, 1))
    dst_d = _shared(build_toy(SPEC, Mesh(1, ranks=2), rank, 2))
    dst_f = _shared(build_toy(SPEC, Mesh(1, ranks=2), rank, 3))
    r_d = tr.Refitter(src, dst_d, transport=transport, delta="device", staging="host")
    r_f = tr.Refitter(src, dst_f, transport=transport)
    wrong, wires = [], []
    g = torch.Generator().manual_seed(rank)
    for op, density in TOY_STEPS:
        with torch.no_grad():
            for p in src.parameters():
                p[torch.rand(p.shape, generator=g) < density] += 1.0
        if op == "stage":
            rep = r_d.stage().wait()
            r_d.commit()
            r_f.stage(), r_f.commit()
        else:
            rep = r_d.refit()
            r_f.refit()
        wires.append(rep.wire_bytes_received)
        wrong.append(_same(dst_d.state_dict(), dst_f.state_dict()))
    return {"wrong": wrong, "wires": wires, "full": r_f.plan.bytes_received}


#: (call, share of elements changed before it); stages are committed at once
TOY_STEPS = [("refit", 0.02), ("refit", 0.02), ("stage", 0.02), ("stage", 0.5), ("stage", 0.02), ("refit", 0.02)]


@pytest.mark.parametrize("transport", ALL)
def test_tp_change_collocated_with_stage_and_commit(transport: str) -> None:
    """Patches where the target holds the reference's version: the second refit, and
    the third stage (the second changed half the elements: dense); full bytes for the
    first refit, the first stage and a refit after commits it never saw."""
    for got in run_world(_toy_world, 2, transport, timeout=240):
        assert got["wrong"] == [[]] * len(TOY_STEPS), got
        full, wires = got["full"], got["wires"]
        kinds = ["full" if w >= full else "patch" if w < full / 5 else "?" for w in wires]
        assert kinds == ["full", "patch", "full", "full", "patch", "full"], got


# ------------------------------------------------- a setting raised after compiling
def _raised_world(rank: int, world: int, transport: str) -> dict:
    g = torch.Generator().manual_seed(9)
    src = {"w": torch.randn(256, 1024, generator=g).to(torch.bfloat16).share_memory_()} if rank == 0 else None
    dst_d = {"w": torch.zeros(256, 1024, dtype=torch.bfloat16).share_memory_()} if rank == 1 else None
    dst_f = {"w": torch.zeros(256, 1024, dtype=torch.bfloat16).share_memory_()} if rank == 1 else None
    r_d = tr.Refitter(src, dst_d, transport=transport, delta="device")
    r_f = tr.Refitter(src, dst_f, transport=transport)
    rows = []
    for density, above in [(0.0, 0.1), (0.05, 0.1), (0.3, 0.9), (0.05, 0.9)]:
        if rank == 0:
            src["w"][torch.rand(256, 1024, generator=g) < density] += 1.0
        with tr.settings.overridden(delta_dense_above=above):
            rep = r_d.refit()
        r_f.refit()
        rows.append({"wrong": _same(dst_d, dst_f) if rank else [], "wire": rep.wire_bytes_received})
    return {"rows": rows, "full": r_f.plan.bytes_received}


@pytest.mark.parametrize("transport", [*ONE_SIDED, NIXL])
def test_payloads_larger_than_their_slots_go_dense(transport: str) -> None:
    """Slots are sized at compile for ``delta_dense_above`` then (0.1): at 0.9 a 30%
    patch no longer fits (dense, exact), a 5% one still does."""
    got = run_world(_raised_world, 2, transport, timeout=120)[1]
    full, wires = got["full"], [r["wire"] for r in got["rows"]]
    assert [r["wrong"] for r in got["rows"]] == [[]] * 4, got
    assert wires[0] >= full and wires[2] >= full and wires[1] < full / 5 and wires[3] < full / 5, (wires, full)


# ------------------------------------------------------------------- the order
def _order_world(rank: int, world: int, transport: str) -> dict:
    src = {"w": torch.arange(4096, dtype=torch.float32).share_memory_()} if rank == 0 else None
    dst = {"w": torch.zeros(4096).share_memory_()} if rank == 1 else None
    r = tr.Refitter(src, dst, transport=transport, delta="device")
    logs = []
    for step in range(3):
        if rank == 0:
            src["w"][step * 7] += 1.0
        shm_transport.LOG.clear()
        r.refit()
        logs.append(list(shm_transport.LOG))
    return {"logs": logs, "sends": sorted(r.plan.send_peers), "recvs": sorted(r.plan.recv_peers),
            "exact": rank != 1 or torch.equal(dst["w"], torch.arange(4096.0) + torch.tensor(
                [1.0 if i in (0, 7, 14) else 0.0 for i in range(4096)]))}


@pytest.mark.parametrize("transport", ONE_SIDED)
def test_protocol_order(transport: str) -> None:
    """Every refit (a dense first one, then patches): a target posts its ready token
    before it waits for anything and waits for its initiators' done last; an initiator
    reads or writes only after the ready token and posts done after."""
    pull = transport == "shm-pull"
    for got in run_world(_order_world, 2, transport, timeout=120):
        mine, theirs = (got["recvs"], got["sends"]) if pull else (got["sends"], got["recvs"])
        assert got["exact"]
        for i, log in enumerate(got["logs"]):
            _check_order(log, mine, theirs, pull, attach=i == 0)
            assert len(log) == (1 if theirs else 0) + len(theirs) + (
                (2 + (not pull) + (i == 0)) * len(mine) if mine else 0), log


LATE = 0.3  # seconds an initiator dawdles between the ready token and its transfer


def _targets_wait_world(rank: int, world: int, transport: str) -> dict:
    """Rank 0 trains, rank 1 serves, 5% changed per step; the initiator dawdles before
    each transfer. Pull: the trainer overwrites its sources, and its slots as the next
    encode would, as soon as ``refit()`` returns; push: the engine reads its weights then."""
    pull = transport == "shm-pull"
    shm_transport.INITIATOR_DELAY = LATE if (rank == 1) == pull else 0.0
    g = torch.Generator().manual_seed(4)
    src = {"w": torch.randn(512, 512, generator=g).to(torch.bfloat16).share_memory_()} if rank == 0 else None
    dst = {"w": torch.zeros(512, 512, dtype=torch.bfloat16).share_memory_()} if rank == 1 else None
    r = tr.Refitter(src, dst, transport=transport, delta="device", timeout=10)
    want = src["w"].clone() if rank == 0 else None
    stale = []
    for _ in range(3):
        torch.distributed.barrier()
        if rank == 0:
            src["w"][torch.rand(512, 512, generator=g) < 0.05] += 1.0
            want = src["w"].clone()
        r.refit()
        if rank == 0:  # the next step starts at once
            src["w"].fill_(float("nan"))
            for pair in r._program.compiled.delta_one_sided.targets.values():
                for slot in pair.slots:
                    slot.fill_(0xFF)
        else:
            got = dst["w"].clone()
        torch.distributed.barrier()
        if rank == 0:
            src["w"].copy_(want)
        shared = [want if rank == 0 else None]
        torch.distributed.broadcast_object_list(shared, src=0)
        if rank == 1:
            stale.append(not torch.equal(got.view(torch.int16), shared[0].view(torch.int16)))
    return {"stale": stale}


@pytest.mark.parametrize("transport", ONE_SIDED)
def test_targets_return_after_their_initiators_transfer(transport: str) -> None:
    """The target's ``refit()`` returns only once the initiator's reads or writes are
    done, seen in data: a pull sender that overwrote its sources and slots early, or a
    push receiver that applied before the writes landed, leaves the engine wrong."""
    _, receiver = run_world(_targets_wait_world, 2, transport, timeout=90, pg_timeout=20)
    assert receiver["stale"] == [False, False, False], receiver["stale"]


# ------------------------------------------------------------ nvshmem's inbox
def _many_parts_world(rank: int, world: int) -> dict:
    """Many one-element tensors in messages cut small: a pair's header (4 bytes a part)
    outgrows the inbox slot (the largest message), so it travels in several rounds."""
    names = [f"t{i}" for i in range(1200)]
    src = {n: torch.tensor([float(i)]) for i, n in enumerate(names)} if rank == 0 else None
    dst_d = {n: torch.zeros(1) for n in names} if rank == 1 else None
    dst_f = {n: torch.zeros(1) for n in names} if rank == 1 else None
    r_d = tr.Refitter(src, dst_d, transport="shm-nvshmem", delta="device", pool_bytes=8192)
    r_f = tr.Refitter(src, dst_f, transport="shm-nvshmem", pool_bytes=8192)
    wrong = []
    for step in range(3):
        if rank == 0 and step:
            src[names[step * 5]] += 1.0
        r_d.refit(), r_f.refit()
        wrong.append(_same(dst_d, dst_f) if rank else [])
    return {"wrong": wrong, "slot": r_d._transport.inbox.slot_bytes,
            "header": 4 * sum(1 + len(m.parts) for ms in r_d._program.compiled.delta.recvs.values() for m in ms)}


def test_nvshmem_headers_longer_than_a_slot() -> None:
    got = run_world(_many_parts_world, 2, timeout=120)[1]
    assert got["header"] > got["slot"], got  # the case this test is for
    assert got["wrong"] == [[], [], []], got


# ------------------------------------------------------------------ a failed refit
@pytest.mark.parametrize("transport", ONE_SIDED)
def test_a_failed_delta_refit_leaves_what_a_failed_full_refit_leaves(transport: str) -> None:
    for got in run_world(_failed_world, 2, transport, timeout=120):
        assert got["None"] == got["device"] == (["raised", "unusable"], 1), got


# ------------------------------------------------------------------- nixl's requests
def _requests_world(rank: int, world: int) -> dict:
    """A WRITE request per call (each writes other lengths of its slots): the transport
    keeps a bounded number of them."""
    g = torch.Generator().manual_seed(5)
    src = {"w": torch.randn(64, 1024, generator=g).to(torch.bfloat16)} if rank == 0 else None
    dst = {"w": torch.zeros(64, 1024, dtype=torch.bfloat16)} if rank == 1 else None
    r = tr.Refitter(src, dst, transport="nixl", delta="device")
    exact = []
    for step in range(40):
        if rank == 0:
            src["w"].view(-1)[step * 13: step * 13 + step] += 1.0  # a patch of another length each call
        r.refit()
        shared = [src["w"].clone() if rank == 0 else None]
        torch.distributed.broadcast_object_list(shared, src=0)
        exact.append(rank == 0 or torch.equal(dst["w"].view(torch.int16), shared[0].view(torch.int16)))
    return {"exact": all(exact), "requests": len(r._transport._requests)}


@pytest.mark.parametrize("transport", [NIXL])
def test_nixl_keeps_a_bounded_number_of_requests(transport: str) -> None:
    from torchrefit.transport.nixl import _REQUESTS
    sender, receiver = run_world(_requests_world, 2, timeout=120)
    assert receiver["exact"] and sender["requests"] <= _REQUESTS + 1, (sender, receiver)
