"""The nvshmem transport on CPU: its inbox schedule, pair counters, data signals and
acknowledgements, with NVSHMEM's host bindings faked over shared memory
(``shm_transport.ShmNvshmem``), in one 8-process Gloo world.

Covers: the pure inbox plan (slots per receiver, offsets, a message from a rank the
receiver does not expect); 16 of the layout suite's 50 cases, one or two of each
kind (all 50 passed once, in 150 s on the shared 2-core machine), through the real
``NvshmemTransport`` code with a message-pool budget so small that every pair exchanges
several messages per refit (so each put after the second waits for the receiver's
acknowledgement of the slot it reuses), receivers slowed before each wait so a
missing wait shows, destinations checked against the toy's global values after two
refits and ``verify()``; the puts' signal values counting up per pair across
refits; ranks sharing one GPU refused on every rank; and ``transport="nvshmem"``
refused on every rank of a CPU world, with the reason.
"""

from __future__ import annotations

import pytest
import shm_transport
import torch
from test_layouts import CASES, WORLD, _build_dst, _expected, _state

import torchrefit as tr
from torchrefit.errors import TransportError
from torchrefit.testing import build_toy, run_world
from torchrefit.transport.nvshmem import plan_inbox

PICK = ["dense-(2, 2)->(1, 1)", "dense-(1, 2)->(2, 4)", "moe-(2, 1, 2)->(4, 1, 1)", "moe-(4, 1, 1)->(1, 1, 4)",
        "mamba-(2, 1)->(1, 2)", "router-bias-tp1ep2->tp2ep2", "tp2->tp3", "tp3->tp1-dp8", "pp3->pp2-uneven",
        "etp2-tp4->etp1-tp2-ep4", "tied-pp2->untied-tp2", "buffer-fp32->bf16", "cast-fp32->bf16",
        "noncolloc-tp2dp2(0-3)->tp1dp4(4-7)", "noncolloc-pp2(0-1)->tp4(2-5)-idle",
        "noncolloc-moe-ep2(4-7)->ep4tp1(0-3)"]  # one or two of each kind in the layout suite
SELECTED = [c for c in CASES if c.id in PICK]
POOL_BYTES = 64 << 10  # messages of at most 4-8 KiB: several per pair and refit


def test_inbox_plan() -> None:
    inbox = plan_inbox([(1, 2), (0,), (), (0, 1, 2)], [100, 4096, 0, 17])
    assert inbox.slot_bytes == 4096 and inbox.slots == 3 and inbox.nbytes == 2 * 3 * 4096
    assert inbox.offset(3, 0, 0) == 0 and inbox.offset(3, 2, 0) == 2 * 4096
    assert inbox.offset(3, 1, 1) == (3 + 1) * 4096  # parity 1 follows all of parity 0's slots
    assert inbox.offset(0, 2, 1) == (3 + 1) * 4096
    with pytest.raises(TransportError, match="rank 1 expects no message from rank 3"):
        inbox.offset(1, 3, 0)
    assert plan_inbox([(), ()], [0, 0]).nbytes == 0


def _case(case, rank: int) -> dict:
    src = build_toy(case.spec, case.src, rank, 1)
    dst = _build_dst(case, rank)
    expected = _expected(case, rank)
    shm_transport.LOG.clear()
    r = tr.Refitter(src, dst, transport="shm-nvshmem", pool_bytes=POOL_BYTES, **case.kwargs)
    r.refit()
    r.refit()
    wrong = [k for k, v in _state(dst).items() if not torch.equal(v.detach(), expected[k])]
    r.verify()
    puts: dict[str, list[int]] = {}
    for entry in shm_transport.LOG:
        kind, peer, value = entry.split(":")
        if kind == "put":
            puts.setdefault(peer, []).append(int(value))
    r.close()
    r.close()  # a second close frees nothing
    freed = shm_transport.LOG.count("free")
    try:
        r.refit()
        after = "refit after close ran"
    except Exception as e:
        after = f"{type(e).__name__}: {e}"
    return {"wrong": wrong, "puts": puts, "recvs": len(r.plan.recvs), "freed": freed, "after_close": after,
            "exchanges": bool(r.plan.sends or r.plan.recvs)}


def _world(rank: int, world: int) -> dict:
    shm_transport.ShmNvshmem.slow_receiver = 2e-4  # a missing wait then reads too early
    out = {}
    for case in SELECTED:
        try:
            out[case.id] = _case(case, rank)
        except Exception as e:  # agreed errors: every rank records one
            out[case.id] = {"error": f"{type(e).__name__}: {e}"}
        torch.distributed.barrier()
    shm_transport.ShmNvshmem.shared_place = True
    case = SELECTED[0]
    try:
        tr.Refitter(build_toy(case.spec, case.src, rank, 1), _build_dst(case, rank), transport="shm-nvshmem")
        out["shared"] = "no error"
    except TransportError as e:
        out["shared"] = str(e)
    shm_transport.ShmNvshmem.shared_place = False
    try:
        tr.Refitter(build_toy(case.spec, case.src, rank, 1), _build_dst(case, rank), transport="nvshmem")
        out["real"] = "no error"
    except TransportError as e:
        out["real"] = str(e)
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(_world, WORLD, timeout=900)


@pytest.mark.parametrize("case", [c.id for c in SELECTED])
def test_layouts_through_nvshmem(case: str, results) -> None:
    for rank, got in enumerate(results):
        got = got[case]
        assert "error" not in got, f"rank {rank}: {got['error']}"
        assert got["wrong"] == [], f"rank {rank}: {got['wrong'][:4]}"
        for peer, values in got["puts"].items():  # per pair: 1, 2, 3, ... across refits and verify
            assert values == list(range(1, len(values) + 1)), f"rank {rank} -> {peer}: {values}"


def test_close_frees_the_inbox(results) -> None:
    """close() frees the symmetric heap on every rank, once, collectively; a refit after
    it raises instead of putting into freed memory."""
    for rank, got in enumerate(results):
        for case in SELECTED:
            assert got[case.id]["freed"] == 1, f"rank {rank}, {case.id}: freed {got[case.id]['freed']} times"
            if got[case.id]["exchanges"]:
                assert "after close()" in got[case.id]["after_close"], (rank, case.id, got[case.id]["after_close"])


def test_several_messages_per_pair(results) -> None:
    """Guards the selection: pairs must reuse slots, so acknowledgements are waited for."""
    longest = max(len(v) for r in results for c in SELECTED for v in r[c.id].get("puts", {}).values())
    assert longest >= 6, longest


def test_ranks_sharing_a_gpu_and_cpu_worlds_refused(results) -> None:
    for rank, got in enumerate(results):
        assert "share one GPU" in got["shared"] and "ranks [0, 1, 2, 3, 4, 5, 6, 7]" in got["shared"], got["shared"]
        if not torch.cuda.is_available():
            assert "needs CUDA tensors" in got["real"], f"rank {rank}: {got['real']}"
