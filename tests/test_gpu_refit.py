"""The CUDA-graph local-copy path on a real GPU (one process, NCCL).

What the CPU suite cannot reach: the captured graph (large copies on parallel
branches, small copies grouped one dtype pair per ``_foreach_copy_`` on a stream of
their own) must copy exactly, with fp32 layer norms mixed into a bf16 model as
megatron-core builds them, and must be re-captured when a tensor's storage moves
on either side (``param.data = ...``) so no refit writes through stale views.
Expert tensors the caching allocator put back to back on both models are copied
as merged runs (``execute.runs``: byte views across tensors of one allocation),
exactly, also after the source's storage moved. With ``settings.sm_copy_below`` the
large copies run as elementwise kernels inside the graph, exactly; by default this
model's few large copies stay memcpy nodes (``execute.kernels.elementwise_copies.mostly_mid_sized``
wants 256 or more).
"""

from __future__ import annotations

import pytest
import torch

import torchrefit as tr
from torchrefit import settings
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local, run_world

pytestmark = pytest.mark.gpu

# hidden 1024: the 1024x4096 MLP weights (8 MB) are large copies, norms and biases small
SPEC = ModelSpec(layers=2, hidden=1024, heads=8, groups=4, ffn=4096, vocab=4096, dtype=torch.bfloat16)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _models(seed: int) -> torch.nn.Module:
    model = build_toy(SPEC, Mesh(1, ranks=1), 0, seed=seed).cuda()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.data = p.data.float()  # megatron-core's fp32 norms next to bf16 weights
    return model


def _graph_path(rank: int, world: int, batched: str = "all", sm_below: int | None = 0) -> dict:
    settings.configure(batched_copy=batched, sm_copy_below=sm_below)
    torch.cuda.set_device(0)
    src, dst = _models(1), _models(2)
    r = tr.Refitter(src, dst, transport="nccl", cuda_graph=True)
    differed = not _same(src, dst)
    r.refit()
    torch.cuda.synchronize()
    out = {"differed": differed, "exact": _same(src, dst), "graph": r._program.local.graph is not None,
           "large": len(r._program.local.big),
           "kernels": sum(w is not None for w in r._program.local.words),
           "batched": len(r._program.local.batch.dst) if r._program.local.batch else 0,
           "groups": sorted({(str(g.dst[0].dtype), str(g.src[0].dtype)) for g in r._program.local.small})}
    r.verify()
    with torch.no_grad():
        for p in dst.parameters():  # the engine re-allocated its weights
            p.data = torch.zeros_like(p)
        fresh = _models(3)
        for p, q in zip(src.parameters(), fresh.parameters()):
            p.data = q.data.clone()  # and the trainer's storage moved too
    r.refit()
    torch.cuda.synchronize()
    out["after_moves_exact"] = _same(dst, fresh)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.0)
    r.refit()  # the re-captured graph keeps working
    torch.cuda.synchronize()
    out["again_exact"] = _same(src, dst)
    return out


# a threshold above every copy, not 16 MB: with expandable segments the allocator puts the
# 8 MB weights back to back and they merge into runs longer than 16 MB (seen on an H100)
@pytest.mark.parametrize("sm_below", [1 << 40, None])
def test_graph_path_with_large_copies_as_kernels_or_not(sm_below: int | None) -> None:
    """The 8 MB weights (merged or not) as elementwise kernels inside the captured graph
    with the switch; by default none (too few large copies); exact either way, also after
    both sides' storage moved (re-captured)."""
    (got,) = run_world(_graph_path, 1, "none", sm_below, backend="nccl", timeout=180)
    assert got["graph"] and got["large"] > 0, got
    assert got["kernels"] == 0 if sm_below is None else got["kernels"] > 0, got
    assert got["differed"] and got["exact"] and got["after_moves_exact"] and got["again_exact"], got


@pytest.mark.parametrize("batched", ["all", "none"])
def test_graph_path_exact_mixed_dtypes_and_storage_moves(batched: str) -> None:
    """With every plain aligned copy batched (``batched_copy="all"``) and with none (``"none"``)."""
    (got,) = run_world(_graph_path, 1, batched, backend="nccl", timeout=180)
    assert got["graph"] and got["large"] + got["batched"] > 0
    pairs = {(d, d) for d in ("torch.bfloat16", "torch.float32", "torch.uint8")}
    if batched == "none":  # one group per dtype pair; uint8: small runs merged (execute.runs)
        assert got["large"] > 0 and got["batched"] == 0
        assert {("torch.bfloat16",) * 2, ("torch.float32",) * 2} <= set(got["groups"]) <= pairs
    else:  # every copy here is a plain aligned one below 32 MB: one batch, no groups left
        assert got["batched"] > 0 and set(got["groups"]) <= pairs
    assert got["differed"] and got["exact"]
    assert got["after_moves_exact"] and got["again_exact"]


# 8 experts of 4 MB (fc1) and 2 MB (fc2): the caching allocator carves them out of
# shared 20 MB segments in build order, the same on both models, so runs merge
MOE = ModelSpec(layers=2, hidden=1024, heads=8, groups=4, ffn=4096, vocab=4096, experts=8,
                expert_ffn=1024, dtype=torch.bfloat16)


def _merged_runs(rank: int, world: int) -> dict:
    torch.cuda.set_device(0)
    mesh = Mesh(1, ranks=1)
    src, dst = (build_toy(MOE, mesh, 0, seed=s).cuda() for s in (1, 2))
    r = tr.Refitter(src, dst, transport="nccl")
    r.refit()
    torch.cuda.synchronize()
    p = r._program
    names = [n for _, _, n in p.local.copies()]
    expected = expected_local(MOE, mesh, 0, 1)  # the oracle's values, cut on the CPU
    out = {"merged": sum("in one copy" in n for n in names), "copies": len(names),
           "planned": len(r.plan.local), "graph": p.local.graph is not None,
           "exact": all(torch.equal(v.cpu(), expected[k].to(v.dtype)) for k, v in dst.state_dict().items())}
    r.verify()
    with torch.no_grad():
        for q in src.parameters():
            q.data = q.data.clone() + 1  # the trainer's storage moved: merged views re-made
    r.refit()
    torch.cuda.synchronize()
    out["after_move_exact"] = _same(src, dst)
    return out


def test_merged_expert_runs_exact_on_gpu() -> None:
    (got,) = run_world(_merged_runs, 1, backend="nccl", timeout=180)
    assert got["graph"] and got["merged"] > 0 and got["copies"] < got["planned"]
    assert got["exact"] and got["after_move_exact"]
