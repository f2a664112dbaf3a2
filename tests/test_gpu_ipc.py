"""The CUDA IPC transport on a real GPU: two processes sharing one GPU (gloo group).

Covers, in one world: collocated TP2 -> TP1 (each rank copies its own half locally
and maps the other half from its peer) and TP1 on rank 0 -> TP2 (rank 1 maps its
half from rank 0). Each case asserts the destination
differed before and is exact after, ``verify()`` passes, a storage move on the
sender (new handles must be exported and mapped) and on the receiver is followed,
and ``verify()`` catches a corrupted destination on every rank.
"""

from __future__ import annotations

import pytest
import torch

import torchrefit as tr
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local, run_world

pytestmark = pytest.mark.gpu

SPEC = ModelSpec(layers=2, hidden=256, heads=8, groups=4, ffn=1024, vocab=4096)


def _equal(model, expected) -> bool:
    return model is None or all(torch.equal(v.cpu(), expected[k]) for k, v in model.state_dict().items())


def _build(mesh: Mesh, rank: int, seed: int):
    model = build_toy(SPEC, mesh, rank, seed=seed)
    return None if model is None else model.cuda()


def _params(model) -> list:
    return [] if model is None else list(model.parameters())


def _case(rank: int, src_mesh: Mesh, dst_mesh: Mesh) -> dict:
    src, dst = _build(src_mesh, rank, 1), _build(dst_mesh, rank, 2)
    out = {"differed": dst is None or not _equal(dst, expected_local(SPEC, dst_mesh, rank, 1))}
    r = tr.Refitter(src, dst, transport="ipc")
    report = r.refit()
    torch.cuda.synchronize()
    out["exact"] = _equal(dst, expected_local(SPEC, dst_mesh, rank, 1))
    out["received"] = report.bytes_received
    r.verify()
    fresh = _build(src_mesh, rank, 3)
    with torch.no_grad():
        for p, q in zip(_params(src), _params(fresh)):
            p.data = q.data.clone()  # the sender's storage moved: peers must re-map
        for p in _params(dst):
            p.data = torch.zeros_like(p)  # and the receiver's
    r.refit()
    torch.cuda.synchronize()
    out["moved_exact"] = _equal(dst, expected_local(SPEC, dst_mesh, rank, 3))
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


def _world(rank: int, world: int) -> dict:
    torch.cuda.set_device(0)
    return {
        "tp2->tp1": _case(rank, Mesh(2, ranks=2), Mesh(1, ranks=2)),
        "tp1 on rank 0 -> tp2": _case(rank, Mesh(1, ranks=1), Mesh(2, ranks=2)),
    }


def test_ipc_two_processes_one_gpu() -> None:
    results = run_world(_world, 2, backend="gloo", timeout=240)
    for rank, cases in enumerate(results):
        for name, got in cases.items():
            assert got["differed"] and got["exact"], f"rank {rank} {name}: {got}"
            assert got["moved_exact"], f"rank {rank} {name}: storage moves not followed"
            assert got["verify_caught"], f"rank {rank} {name}: verify missed a corruption"
    for name in results[0]:
        assert results[1][name]["received"] > 0, f"{name}: nothing came through ipc to rank 1"
