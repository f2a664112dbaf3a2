"""The nvshmem transport on one GPU: one PE (NVSHMEM runs one PE per GPU without MPS).

Covers, in one process: ``transport="nvshmem"`` on a TP1 -> TP1 refit (local copies
only: one rank has no peer) exact against the toy's values and reported as nvshmem;
and the transport's own puts, PE 0 to itself through its symmetric inbox, for more
messages than the inbox has parities, each message produced on the caller's stream
behind a ~20 ms gate (``torch.cuda._sleep``): every received message must equal
what was produced, so the put waited for its producer on the stream, the receiver
for the put's signal, and each reused slot for its acknowledgement. Ranks sharing
a GPU are refused on every rank (two processes, before NVSHMEM starts). With
several GPUs, ``tests/test_gpu_layouts.py`` runs the layout suite over 8 PEs.
"""

from __future__ import annotations

import pytest
import torch

import torchrefit as tr
from torchrefit.bench.timing import sleep_cycles_per_ms
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local, run_world
from torchrefit.transport.base import transport_class

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not transport_class("nvshmem").available(), reason=f"nvshmem: {transport_class('nvshmem').available().reason}")]

SPEC = ModelSpec(layers=2, hidden=256, heads=8, groups=4, ffn=1024, vocab=4096)


def _one_pe(rank: int, world: int) -> dict:
    from torchrefit.transport.nvshmem import NvshmemTransport, plan_inbox

    torch.cuda.set_device(0)
    src = build_toy(SPEC, Mesh(1, ranks=1), rank, seed=1).cuda()
    dst = build_toy(SPEC, Mesh(1, ranks=1), rank, seed=2).cuda()
    r = tr.Refitter(src, dst, transport="nvshmem")
    report = r.refit()
    torch.cuda.synchronize()
    want = expected_local(SPEC, Mesh(1, ranks=1), rank, seed=1)
    out = {"transport": report.transport,
           "refit_wrong": [k for k, v in dst.state_dict().items() if not torch.equal(v.cpu(), want[k])]}
    t = NvshmemTransport(torch.distributed.group.WORLD, torch.device("cuda", 0))
    nbytes = 1 << 20
    t.set_inbox(plan_inbox([(0,)], [nbytes]))
    cycles = int(20 * sleep_cycles_per_ms(torch.device("cuda")))
    sent, got = [], []
    for _ in range(5):  # 5 messages through 2 parity slots
        a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        b = torch.zeros_like(a)
        torch.cuda._sleep(cycles)  # the producer runs late on the caller's stream
        a.copy_(torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda"))
        handle = t.start([(0, a)], [(0, b)])
        t.finish(handle)
        sent.append(a)
        got.append(b)
    torch.cuda.synchronize()
    out["puts_wrong"] = [k for k, (a, b) in enumerate(zip(sent, got)) if not torch.equal(a, b)]
    out["distinct"] = len({int(a[:64].sum()) for a in sent})
    return out


def test_one_pe_refit_and_puts() -> None:
    (got,) = run_world(_one_pe, 1, backend="gloo", timeout=240)
    assert got["transport"] == "nvshmem"
    assert got["refit_wrong"] == [], got
    assert got["puts_wrong"] == [], f"messages received wrong: {got['puts_wrong']}"
    assert got["distinct"] > 1  # the messages differ, so a stale slot would show


def _shared(rank: int, world: int) -> str:
    torch.cuda.set_device(0)
    src = build_toy(SPEC, Mesh(1, ranks=1), rank, seed=1)
    dst = build_toy(SPEC, Mesh(1, ranks=1, offset=1), rank, seed=2)
    try:
        tr.Refitter(src.cuda() if src is not None else None, dst.cuda() if dst is not None else None,
                    transport="nvshmem")
        return "no error"
    except tr.TransportError as e:
        return str(e)


def test_ranks_sharing_the_gpu_refused() -> None:
    for rank, err in enumerate(run_world(_shared, 2, backend="gloo", timeout=240)):
        assert "ranks [0, 1] share one GPU" in err, f"rank {rank}: {err}"
