"""The one-sided transports on a real GPU: two processes sharing one GPU (gloo group),
for every one-sided transport usable here (ipc; nixl where its package is installed).

Covers, in one world per transport: collocated TP2 -> TP1 (each rank copies its own half locally
and maps the other half from its peer) and TP1 on rank 0 -> TP2 (rank 1 maps its
half from rank 0). Each case asserts the destination
differed before and is exact after, ``verify()`` passes, a storage move on the
sender (new handles must be exported and mapped) and on the receiver is followed,
and ``verify()`` catches a corrupted destination on every rank. For ipc it also
checks that the sender exported far fewer allocation segments than tensors. With
tensors of 2-16 MB (``LARGE``), the row-parallel halves landing in ``full[:, :half]``
(local copies and ipc's pulls out of the peer's memory) run row by row in the batched
copy kernel (``batched.strided_runs``), exactly. A MoE-shaped model (256 expert weights of 1-2
MB) held by rank 0 and pulled whole by rank 1 runs both ranks' copies in one batched launch
each (rank 1's reading rank 0's mapped memory), exactly. ipc runs twice: each rank copying
its own (taking turns), and as ``ipc:delegate`` with rank 0 copying for both (the default,
``transport.delegates``): rank 0 then runs every batched copy of both ranks, rank 1 none.
"""

from __future__ import annotations

import os

import pytest
import torch

import torchrefit as tr
from torchrefit import settings
from torchrefit.testing import (
    Mesh,
    ModelSpec,
    build_toy,
    expected_local,
    run_world,
    usable_transports,
)

pytestmark = pytest.mark.gpu

SPEC = ModelSpec(layers=2, hidden=256, heads=8, groups=4, ffn=1024, vocab=4096)
# fp32 halves of 2 MB (linear_proj) and 8 MB (linear_fc2): large copies, strided in TP2 -> TP1
LARGE = ModelSpec(layers=2, hidden=1024, heads=8, groups=4, ffn=4096, vocab=4096)
# 256 fp32 expert weights of 1-2 MB: a program of many mid-sized copies, batched in one
# kernel launch by default (execute.batched): rank 1's pulls out of rank 0's memory too
MOE = ModelSpec(layers=2, hidden=1024, heads=8, groups=4, ffn=2048, vocab=4096, experts=64, expert_ffn=256)


def _expandable() -> bool:
    """Whether this run's allocator maps memory in pieces (``expandable_segments:True``)."""
    return "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()


def _equal(model, expected) -> bool:
    return model is None or all(torch.equal(v.cpu(), expected[k]) for k, v in model.state_dict().items())


def _build(spec: ModelSpec, mesh: Mesh, rank: int, seed: int):
    model = build_toy(spec, mesh, rank, seed=seed)
    return None if model is None else model.cuda()


def _widened(r: tr.Refitter) -> int:
    """Large copies this rank runs on complex128 views: local ones and pulls out of peers."""
    one_sided = r._program.compiled.one_sided
    pulls = one_sided._pulls[1] if one_sided is not None and one_sided._pulls else None
    return sum(c.dst.dtype == torch.complex128 for copies in (r._program.local, pulls) if copies is not None
               for c in copies.big)


def _batched(r: tr.Refitter) -> int:
    """Copies this rank moves in a batched launch: local ones and pulls out of peers."""
    one_sided = r._program.compiled.one_sided
    pulls = one_sided._pulls[1] if one_sided is not None and one_sided._pulls else None
    return sum(len(copies.batch.dst) for copies in (r._program.local, pulls)
               if copies is not None and copies.batch is not None)


def _params(model) -> list:
    return [] if model is None else list(model.parameters())


def _case(rank: int, src_mesh: Mesh, dst_mesh: Mesh, transport: str, spec: ModelSpec = SPEC) -> dict:
    src, dst = _build(spec, src_mesh, rank, 1), _build(spec, dst_mesh, rank, 2)
    out = {"differed": dst is None or not _equal(dst, expected_local(spec, dst_mesh, rank, 1))}
    r = tr.Refitter(src, dst, transport=transport)
    report = r.refit()
    out["widened"] = _widened(r)
    out["batched"] = _batched(r)
    out["transport"] = report.transport
    exposed = r._program.compiled.one_sided.compiled.exposed if r._program.compiled.one_sided else None
    if transport == "ipc" and exposed is not None:
        segments, tensors = exposed
        out["segments"], out["tensors"] = len(segments), len(tensors)
    torch.cuda.synchronize()
    out["exact"] = _equal(dst, expected_local(spec, dst_mesh, rank, 1))
    out["received"] = report.bytes_received
    r.verify()
    fresh = _build(spec, src_mesh, rank, 3)
    with torch.no_grad():
        for p, q in zip(_params(src), _params(fresh)):
            p.data = q.data.clone()  # the sender's storage moved: peers must re-map
        for p in _params(dst):
            p.data = torch.zeros_like(p)  # and the receiver's
    r.refit()
    torch.cuda.synchronize()
    out["moved_exact"] = _equal(dst, expected_local(spec, dst_mesh, rank, 3))
    with torch.no_grad():
        for p in _params(dst)[:1]:
            p.add_(1.0)  # corrupt the destination (every rank that holds one)
    try:
        r.verify()
        out["verify_caught"] = False
    except tr.VerificationError as e:
        out["verify_caught"] = "differs" in str(e)
    r.close()
    return out


def _world(rank: int, world: int, transport: str) -> dict:
    """``"ipc:delegate"``: ipc with one copier for both ranks (``transport.delegates``, the
    default), plain ``"ipc"``: each rank copying its own, taking turns."""
    transport, _, order = transport.partition(":")
    settings.configure(delegate_copies=order == "delegate")
    torch.cuda.set_device(0)
    return {
        "tp2->tp1": _case(rank, Mesh(2, ranks=2), Mesh(1, ranks=2), transport),
        "tp1 on rank 0 -> tp2": _case(rank, Mesh(1, ranks=1), Mesh(2, ranks=2), transport),
        "large tp2->tp1": _case(rank, Mesh(2, ranks=2), Mesh(1, ranks=2), transport, LARGE),
        "moe tp1 on rank 0 -> tp1 x 2": _case(rank, Mesh(1, ranks=1), Mesh(1, ranks=2), transport, MOE),
    }


TRANSPORTS = usable_transports(cuda=True, one_sided_only=True) if torch.cuda.is_available() else ["ipc"]
TRANSPORTS += ["ipc:delegate"] if "ipc" in TRANSPORTS else []


def assert_exact_cases(results: list[dict], transport: str) -> None:
    """Every case on every rank: exact after differing, storage moves followed, a
    corruption caught by verify, through ``transport``."""
    for rank, cases in enumerate(results):
        for name, got in cases.items():
            assert got["differed"] and got["exact"], f"rank {rank} {name}: {got}"
            assert got["moved_exact"], f"rank {rank} {name}: storage moves not followed"
            assert got["verify_caught"], f"rank {rank} {name}: verify missed a corruption"
            assert got["transport"] == transport.partition(":")[0]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_one_sided_two_processes_one_gpu(transport: str) -> None:
    results = run_world(_world, 2, transport, backend="gloo", timeout=240)
    assert_exact_cases(results, transport)
    for rank, cases in enumerate(results):
        for name, got in cases.items():
            if "segments" in got and not name.startswith(("large", "moe")):  # per allocation segment, not per tensor
                # a delegated member exposes its destinations too, more of them large (a
                # segment each), about three tensors a segment. With expandable
                # segments torch shares a storage as the mapped pieces that hold it, so
                # fewer tensors share a handle
                per = 2 if transport == "ipc:delegate" or _expandable() else 4
                assert got["segments"] * per <= got["tensors"], f"rank {rank} {name}: {got}"
    for name in results[0]:
        assert results[1][name]["received"] > 0, f"{name}: nothing came through {transport} to rank 1"
    if transport == "ipc:delegate":  # rank 0 runs both ranks' copies, rank 1 none
        assert [c["large tp2->tp1"]["batched"] for c in results] == [16, 0], results
        moe = [c["moe tp1 on rank 0 -> tp1 x 2"]["batched"] for c in results]
        assert moe[0] >= 256 and moe[1] == 0, moe
        return
    if transport == "ipc":  # each rank copies its own halves of 4 row-parallel weights, pulls its peer's 4
        assert [c["large tp2->tp1"]["batched"] for c in results] == [8, 8], results
        assert [c["large tp2->tp1"]["widened"] for c in results] == [0, 0], results
    # rank 0 copies the MoE model locally (runs merged first), rank 1 pulls its 262 large
    # tensors one by one (ipc) or is written (nixl): both ranks' copies run batched
    moe = [c["moe tp1 on rank 0 -> tp1 x 2"]["batched"] for c in results]
    assert moe[0] > 0 and (moe[1] >= 256 if transport == "ipc" else True), moe


def test_ipc_stream_words_land_after_queued_work() -> None:
    """ipc's stream-written mailbox word: queuing it returns at once, and the word lands
    only after the work queued before it on the stream (a 50 ms sleep kernel): never
    earlier, and then exactly (64-bit values, past 2**32 too); on an idle stream at once."""
    import time

    from torchrefit.bench.timing import sleep_cycles_per_ms
    from torchrefit.transport.ipc import StreamWords
    from torchrefit.transport.one_sided.mailbox import Mailbox

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda", 0)
    box = Mailbox.create(2)
    write = StreamWords(box, device)
    cycles = int(50 * sleep_cycles_per_ms(device))
    for value in (3, 5, (7 << 33) + 1):
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        write(1, value)
        queued = time.perf_counter() - t0
        early = box.load(1)
        torch.cuda.synchronize(device)
        assert (box.load(0), box.load(1), box.load(2)) == (0, value, 0)
        assert early != value, f"word {value} landed before the work queued ahead of it"
        assert queued < 0.02, f"queuing the word blocked the host for {queued * 1e3:.1f} ms"
    write(2, 9)  # nothing queued: the host stores it at once
    assert box.load(2) == 9
