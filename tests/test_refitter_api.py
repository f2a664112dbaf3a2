"""Refitter options and lifecycle on 2 real CPU processes (gloo).

Covers: ``share_storage`` (whole destination tensors alias source storage, the rest
is still copied), recompiling when a tensor's storage moves between refits
(``param.data = ...`` on either side), ``swap_model_weights`` caching its plan per
model pair, ``verify()`` catching a corrupted destination on every rank, the
report's byte counts, ``cuda_graph=True`` being accepted on CPU (no-op), and a refit over a
sub-group (group ranks translated to global ranks) within a small message-pool budget, and
small local copies of mixed dtypes (fp32 norms, bf16 rest) grouped one dtype pair per
``_foreach_copy_``.
"""

from __future__ import annotations

import torch

import torchrefit as tr
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local, run_world

SPEC = ModelSpec(layers=2)


def _equal(model, expected) -> bool:
    return all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


def _share_storage(rank: int, world: int) -> dict:
    out = {}
    src = build_toy(SPEC, Mesh(2, ranks=2), rank, 1)
    dst = build_toy(SPEC, Mesh(2, ranks=2), rank, 2)
    report = tr.Refitter(src, dst, share_storage=True).refit()
    pairs = list(zip(src.parameters(), dst.parameters()))
    out["all_shared"] = all(a.data_ptr() == b.data_ptr() for a, b in pairs)
    out["shared_tensors"] = report.shared_tensors
    with torch.no_grad():
        next(src.parameters()).add_(1.0)  # aliasing: the engine sees the trainer's writes
    out["sees_writes"] = torch.equal(next(src.parameters()), next(dst.parameters()))
    # TP2 -> TP1: split tensors cannot alias and are copied; replicated ones alias.
    src2 = build_toy(SPEC, Mesh(2, ranks=2), rank, 1)
    dst2 = build_toy(SPEC, Mesh(1, ranks=2), rank, 2)
    r2 = tr.Refitter(src2, dst2, share_storage=True)
    rep2 = r2.refit()
    out["mixed_ok"] = _equal(dst2, expected_local(SPEC, Mesh(1, ranks=2), rank, 1))
    out["mixed_shared"] = rep2.shared_tensors
    out["mixed_total"] = len(list(dst2.parameters()))
    r2.verify()
    return out


def test_share_storage() -> None:
    for got in run_world(_share_storage, 2, timeout=120):
        assert got["all_shared"] and got["shared_tensors"] > 0 and got["sees_writes"]
        assert got["mixed_ok"]
        assert 0 < got["mixed_shared"] < got["mixed_total"]


def _storage_moves(rank: int, world: int) -> dict:
    out = {}
    mesh_s, mesh_d = Mesh(2, ranks=2), Mesh(1, ranks=2)
    src = build_toy(SPEC, mesh_s, rank, 1)
    dst = build_toy(SPEC, mesh_d, rank, 2)
    r = tr.Refitter(src, dst, cuda_graph=True)
    first = r.refit()
    with torch.no_grad():
        for p in dst.parameters():  # an engine that freed and re-allocated its weights
            p.data = torch.zeros_like(p)
    r.refit()
    out["dst_moved_ok"] = _equal(dst, expected_local(SPEC, mesh_d, rank, 1))
    fresh = build_toy(SPEC, mesh_s, rank, 3)
    with torch.no_grad():
        for p, q in zip(src.parameters(), fresh.parameters()):
            p.data = q.data.clone()  # the trainer's storage moved too
    r.refit()
    out["src_moved_ok"] = _equal(dst, expected_local(SPEC, mesh_d, rank, 3))
    out["bytes"] = (first.bytes_local, first.bytes_sent, first.bytes_received)
    out["plan_bytes"] = (r.plan.bytes_local, r.plan.bytes_sent, r.plan.bytes_received)
    out["version"] = r.version
    out.update(_mixed_dtype_small_copies(rank))
    return out


def _mixed_dtype_small_copies(rank: int) -> dict:
    """megatron-core keeps layer norms in fp32 next to bf16 biases; one foreach over both
    falls back to a kernel per tensor, so small copies are grouped by dtype pair."""
    mesh = Mesh(1, ranks=2)
    spec = ModelSpec(layers=2, dtype=torch.bfloat16)
    models = [build_toy(spec, mesh, rank, seed) for seed in (1, 2)]
    with torch.no_grad():
        for m in models:
            for name, p in m.named_parameters():
                if "norm" in name:
                    p.data = p.data.float()
    r = tr.Refitter(*models)
    r.refit()
    groups = r._program.local.small
    return {
        "mixed_exact": all(torch.equal(a, b) for a, b in zip(models[0].state_dict().values(),
                                                             models[1].state_dict().values())),
        "group_dtypes": sorted({(str(g.dst[0].dtype), str(g.src[0].dtype)) for g in groups}),
        "groups_uniform": all(len({(d.dtype, s.dtype) for d, s in zip(g.dst, g.src)}) == 1
                              for g in groups),
    }


def test_recompiles_when_storage_moves() -> None:
    results = run_world(_storage_moves, 2, timeout=120)
    for got in results:
        assert got["dst_moved_ok"] and got["src_moved_ok"] and got["version"] == 3
        assert got["mixed_exact"] and got["groups_uniform"]
        assert got["group_dtypes"] == [("torch.bfloat16", "torch.bfloat16"), ("torch.float32", "torch.float32")]
        assert got["bytes"] == got["plan_bytes"]
    sent = sum(g["bytes"][1] for g in results)
    assert sent == sum(g["bytes"][2] for g in results) > 0


def _swap_and_verify(rank: int, world: int) -> dict:
    out = {}
    src = build_toy(SPEC, Mesh(2, ranks=2), rank, 1)
    dst = build_toy(SPEC, Mesh(1, ranks=2), rank, 2)
    a = tr.swap_model_weights(src, dst, refit_method="gloo")
    b = tr.swap_model_weights(src, dst, refit_method="gloo")
    out["cached"] = (a.compiled, b.compiled, b.version)
    out["ok"] = _equal(dst, expected_local(SPEC, Mesh(1, ranks=2), rank, 1))
    r = tr.Refitter(src, dst)
    r.refit()
    if rank == 1:
        with torch.no_grad():
            getattr(dst.decoder.layers, "0").mlp.linear_fc2.weight[0, 0] += 1  # corrupt one element
    try:
        r.verify()
        out["verify"] = None
    except tr.VerificationError as e:
        out["verify"] = str(e)
    tr.clear_caches()
    return out


def test_swap_model_weights_caches_and_verify_catches_corruption() -> None:
    for got in run_world(_swap_and_verify, 2, timeout=120):
        assert got["cached"] == (True, False, 2) and got["ok"]
        assert got["verify"] is not None and "decoder.layers.0.mlp.linear_fc2.weight" in got["verify"]
        assert "rank 1" in got["verify"]


def _subgroup_and_budget(rank: int, world: int) -> dict:
    """Ranks 1-3 of a 4-rank world refit over their own sub-group (rank 0 stays out), with a
    message-pool budget small enough to force many rounds of packed, non-contiguous messages."""
    import torch.distributed as dist

    group = dist.new_group([1, 2, 3])
    if rank == 0:
        return {}
    g = dist.get_rank(group)
    spec = ModelSpec(layers=2, hidden=48, ffn=96, vocab=96)
    src = build_toy(spec, Mesh(1, ranks=1), g, 1)  # group rank 0 (world rank 1) holds the source
    dst = build_toy(spec, Mesh(2, ranks=2, offset=1), g, 2)  # TP2 on group ranks 1-2
    budget = 64 << 10
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # group rank 2: the deprecated name
        warnings.simplefilter("always")
        budgets = {"staging_bytes": budget} if g == 2 else {"pool_bytes": budget}
        r = tr.Refitter(src, dst, group=group, **budgets)
        report = r.refit()
        old_field = report.staging_bytes
    deprecated = sorted({str(w.message).split(":")[0] for w in caught if w.category is DeprecationWarning})
    ok = dst is None or _equal(dst, expected_local(spec, Mesh(2, ranks=2, offset=1), g, 1))
    r.verify()
    return {"ok": ok, "rounds": report.rounds, "pools": report.pool_bytes, "budget": budget,
            "sent": report.bytes_sent, "received": report.bytes_received, "old_field": old_field,
            "deprecated": deprecated}


def test_subgroup_ranks_and_pool_budget() -> None:
    results = run_world(_subgroup_and_budget, 4, timeout=120)
    assert results[0] == {}
    for got in results[1:]:
        assert got["ok"]
        assert got["pools"] <= got["budget"] and got["old_field"] == got["pools"], got
    # the old argument and report field still work, and say they are deprecated
    assert results[3]["deprecated"] == ["RefitReport.staging_bytes is deprecated",
                                        "Refitter(staging_bytes=) is deprecated"], results[3]
    assert results[1]["deprecated"] == ["RefitReport.staging_bytes is deprecated"], results[1]
    assert results[1]["sent"] > 2 * results[1]["budget"] and results[1]["rounds"] > 4, results[1]
    assert results[1]["sent"] == results[2]["received"] + results[3]["received"]
