"""Refits between parallel layouts, on 8 real CPU processes joined by gloo.

Covers the (TP, PP, EP) pairs Megatron-core's own refit tests cover, and cases they
lack: SwiGLU (stride 2) across TP changes, TP 2->3 and 3->2, PP 3->2, EP with 8
experts 2->4, expert-TP different from TP, grouped (``weightK``) experts, tied
embeddings, persistent buffers with a dtype change, casts, virtual pipeline
chunks, and non-collocated refits with idle ranks. Every case checks, on every
rank, that each destination tensor differed from the source-derived expectation
before the refit and equals it exactly after; that non-persistent buffers did not
move; and that ``verify()`` passes. All cases run in one spawned world per
transport usable on CPU tensors here (gloo; nixl where ``nixl-cu13`` is installed: a
push transport converts through buffers of the wire dtype); ``test_gpu_layouts.py`` runs
the same cases on GPUs through every GPU transport.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
import torch
import torch.distributed as dist

import torchrefit as tr
from torchrefit.testing import (
    Mesh,
    ModelSpec,
    build_toy,
    expected_local,
    run_world,
    usable_transports,
)

WORLD = 8
SRC_SEED, DST_SEED = 1, 2


@dataclass(frozen=True)
class Case:
    id: str
    src: Mesh
    dst: Mesh
    spec: ModelSpec = ModelSpec()
    dst_spec: ModelSpec | None = None
    kwargs: dict = field(default_factory=dict)
    chunks: int = 1  # virtual pipeline chunks of the destination

    @property
    def dspec(self) -> ModelSpec:
        return self.dst_spec or self.spec


def _m(tp=1, pp=1, ep=1, etp=None, ranks=WORLD, offset=0) -> Mesh:
    return Mesh(tp=tp, pp=pp, ep=ep, etp=etp, ranks=ranks, offset=offset)


DENSE = ModelSpec()
MOE4 = ModelSpec(experts=4)
MAMBA = ModelSpec(mamba=True)
BIAS = ModelSpec(experts=4, router_bias=True)

CASES: list[Case] = [
    # Megatron-core's dense GPT pairs (TP, PP, EP); SwiGLU fc1 (stride 2) throughout.
    *[Case(f"dense-{a}->{b}", _m(*a), _m(*b), DENSE) for a, b in [
        ((2, 1), (1, 1)), ((1, 1), (2, 1)), ((2, 1), (4, 1)), ((1, 2), (1, 1)), ((1, 1), (1, 2)),
        ((2, 2), (1, 1)), ((1, 1), (2, 2)), ((2, 1), (1, 2)), ((1, 2), (2, 1)), ((1, 2), (2, 4)),
    ]],
    # Megatron-core's MoE pairs with 4 experts.
    *[Case(f"moe-{a}->{b}", _m(*a), _m(*b), MOE4) for a, b in [
        ((1, 1, 2), (1, 1, 4)), ((1, 1, 2), (1, 1, 1)), ((1, 1, 1), (1, 1, 2)), ((1, 1, 2), (1, 2, 2)),
        ((2, 1, 2), (1, 1, 1)), ((1, 1, 1), (2, 1, 2)), ((4, 1, 1), (2, 1, 2)), ((2, 1, 2), (4, 1, 1)),
        ((4, 1, 1), (1, 1, 4)), ((1, 1, 4), (4, 1, 1)),
    ]],
    # Mamba hybrid: block-interleaved partition_sizes (in_proj, conv1d), TP and PP changes.
    *[Case(f"mamba-{a}->{b}", _m(*a), _m(*b), MAMBA) for a, b in [
        ((2, 1), (1, 1)), ((1, 1), (2, 1)), ((2, 1), (4, 1)), ((1, 1), (2, 2)), ((2, 1), (1, 2)),
        ((4, 1), (2, 1)),
    ]],
    # Router expert_bias (persistent fp32 buffer) with TP and EP changes.
    *[Case(f"router-bias-tp{a[0]}ep{a[2]}->tp{b[0]}ep{b[2]}", _m(*a), _m(*b), BIAS) for a, b in [
        ((2, 1, 2), (1, 1, 1)), ((1, 1, 1), (2, 1, 2)), ((1, 1, 2), (2, 1, 2)),
    ]],
    # Beyond Megatron-core's tests.
    Case("tp2->tp3", _m(2, ranks=6), _m(3, ranks=6),
         ModelSpec(heads=6, groups=6, hidden=24, ffn=48, vocab=96)),
    Case("tp3->tp2", _m(3, ranks=6), _m(2, ranks=6),
         ModelSpec(heads=6, groups=6, hidden=24, ffn=48, vocab=96)),
    Case("tp3->tp1-dp8", _m(3, ranks=6), _m(1),
         ModelSpec(heads=6, groups=6, hidden=24, ffn=48, vocab=96)),
    Case("pp3->pp2", _m(1, 3, ranks=6), _m(2, 2), ModelSpec(layers=6)),
    Case("pp2-tp2->pp3", _m(2, 2), _m(1, 3, ranks=6), ModelSpec(layers=6)),
    Case("pp3->pp2-uneven", _m(1, 3, ranks=6), _m(2, 2), ModelSpec(layers=5)),  # layers 1+2+2 vs 2+3
    Case("ep2->ep4-8experts", _m(ep=2), _m(ep=4), ModelSpec(experts=8)),
    Case("ep4-8experts->ep2-tp2", _m(ep=4), _m(2, ep=2), ModelSpec(experts=8)),
    Case("etp1-tp2->etp2-tp1", _m(2, ep=2, etp=1), _m(1, ep=2, etp=2), MOE4),
    Case("etp2-tp4->etp1-tp2-ep4", _m(4, ep=2, etp=2), _m(2, ep=4, etp=1), MOE4),
    Case("grouped-experts-ep2->ep4", _m(ep=2), _m(ep=4), ModelSpec(experts=8, grouped_experts=True)),
    Case("tied-pp2->untied-tp2", _m(1, 2), _m(2), ModelSpec(tie=True), ModelSpec(tie=False)),
    Case("tied-pp1->untied-pp2", _m(2, 1), _m(1, 2), ModelSpec(tie=True), ModelSpec(tie=False)),
    Case("tied-tp2->tied-pp2", _m(2), _m(2, 2), ModelSpec(tie=True)),
    Case("buffer-fp32->bf16", _m(2, ep=2), _m(1, ep=4), BIAS, replace(BIAS, buffer_dtype=torch.bfloat16)),
    Case("cast-fp32->bf16", _m(2), _m(4), DENSE, replace(DENSE, dtype=torch.bfloat16), {"cast": True}),
    Case("vpp2-dst", _m(2, 2), _m(1, 2), ModelSpec(layers=8), chunks=2),
    # Non-collocated: disjoint rank sets; ranks that hold neither model pass None, None.
    Case("noncolloc-tp2(0-1)->tp2(2-3)", _m(2, ranks=2), _m(2, ranks=2, offset=2), DENSE,
         kwargs={"src_rank_offset": 0, "dst_rank_offset": 2}),
    Case("noncolloc-tp2dp2(0-3)->tp1dp4(4-7)", _m(2, ranks=4), _m(1, ranks=4, offset=4), DENSE,
         kwargs={"dst_rank_offset": 4}),
    Case("noncolloc-pp2(0-1)->tp4(2-5)-idle", _m(1, 2, ranks=2), _m(4, ranks=4, offset=2), DENSE),
    Case("noncolloc-moe-ep2(4-7)->ep4tp1(0-3)", _m(ep=2, ranks=4, offset=4), _m(ep=4, ranks=4), MOE4),
]


def _build_dst(case: Case, rank: int):
    if case.chunks == 1:
        return build_toy(case.dspec, case.dst, rank, DST_SEED)
    # Virtual pipeline: split each stage's layers into chunks that are models of their own.
    return _vpp_chunks(case, rank)


def _vpp_chunks(case: Case, rank: int):
    """Destination as ``chunks`` virtual stages: chunk j of stage p holds layers
    [(j * pp + p) * per, ...), the interleaved schedule Megatron uses."""
    c = case.dst.coords(rank)
    if c is None:
        return None
    spec, pp, v = case.dspec, case.dst.pp, case.chunks
    per = spec.layers // (pp * v)
    models = []
    for j in range(v):
        sub = replace(spec, layers=spec.layers // v)
        m = build_toy(sub, replace(case.dst, pp=pp), rank, DST_SEED)
        first = (j * pp + c.pp) * per
        _renumber_chunk(m, j, v, pp, c.pp, first, spec)
        models.append(m)
    return models


def _renumber_chunk(m, j, v, pp, stage, first, spec):
    """Give a toy chunk its global layer numbers and drop what only the first/last
    virtual stage holds, then refill its tensors with the global values."""
    from torchrefit.testing.toy import global_table, global_value
    per = spec.layers // (pp * v)
    for i in range(per):
        getattr(m.decoder.layers, str(i)).layer_number = first + i + 1
    if not (j == 0 and stage == 0) and hasattr(m, "embedding"):
        del m.embedding
    if not (j == v - 1 and stage == pp - 1):
        for name in ("output_layer",):
            if hasattr(m, name):
                delattr(m, name)
        if hasattr(m.decoder, "final_layernorm"):
            del m.decoder.final_layernorm
    table = global_table(spec)
    with torch.no_grad():
        for name, p in m.named_parameters():
            gname = name
            if name.startswith("decoder.layers."):
                local = int(name.split(".")[2])
                gname = name.replace(f"decoder.layers.{local}.", f"decoder.layers.{first + local}.", 1)
            d = table[gname]
            p.copy_(global_value(gname, d.shape, DST_SEED)[tuple(slice(0, s) for s in p.shape)])


def _expected(case: Case, rank: int) -> dict[str, torch.Tensor]:
    if case.chunks == 1:
        return expected_local(case.dspec, case.dst, rank, SRC_SEED, value_spec=case.spec)
    from torchrefit.testing.toy import global_value
    models = _vpp_chunks(case, rank) or []
    out = {}
    for j, m in enumerate(models):
        for name, p in m.state_dict().items():
            gname = name
            if name.startswith("decoder.layers."):
                layer = m.decoder.layers
                local = int(name.split(".")[2])
                g = getattr(layer, str(local)).layer_number - 1
                gname = name.replace(f"decoder.layers.{local}.", f"decoder.layers.{g}.", 1)
            out[f"{j}/{name}"] = global_value(gname, p.shape, SRC_SEED, case.spec).to(p.dtype)
    return out


def _state(dst) -> dict[str, torch.Tensor]:
    if dst is None:
        return {}
    if isinstance(dst, list):
        return {f"{j}/{k}": v for j, m in enumerate(dst) for k, v in m.state_dict(keep_vars=True).items()}
    return dict(dst.state_dict(keep_vars=True))


def _non_persistent(dst) -> dict[str, torch.Tensor]:
    models = dst if isinstance(dst, list) else ([dst] if dst is not None else [])
    out = {}
    for j, m in enumerate(models):
        for mod_name, mod in m.named_modules():
            for b in mod._non_persistent_buffers_set:
                out[f"{j}/{mod_name}.{b}"] = getattr(mod, b).clone()
    return out


def _to(model, device: str):
    if model is None or device == "cpu":
        return model
    return [m.to(device) for m in model] if isinstance(model, list) else model.to(device)


def _run_case(case: Case, rank: int, device: str = "cpu", transport: str = "auto") -> dict:
    src = _to(build_toy(case.spec, case.src, rank, SRC_SEED), device)
    dst = _to(_build_dst(case, rank), device)
    expected = {k: v.to(device) for k, v in _expected(case, rank).items()}
    state = _state(dst)
    if set(state) != set(expected):
        return {"error": f"toy bug: keys {sorted(set(state) ^ set(expected))[:4]}"}
    same_before = [k for k, v in state.items() if v.numel() and torch.equal(v.detach(), expected[k])]
    frozen = _non_persistent(dst)
    r = tr.Refitter(src, dst, transport=transport, **case.kwargs)
    report = r.refit()
    r.refit()  # a second refit replays the compiled program
    wrong = [k for k, v in state.items() if not torch.equal(v.detach(), expected[k])]
    moved = [k for k, v in _non_persistent(dst).items() if not torch.equal(v, frozen[k])]
    r.verify()
    return {"same_before": same_before, "wrong": wrong, "moved": moved, "n": len(state),
            "remote": report.bytes_remote, "version": r.version}


def _world_cases(rank: int, world: int, cases: list[Case], on_gpus: bool = False, transport: str = "auto",
                 one_gpu: bool = False) -> dict[str, dict]:
    """Every case in this world: on CPU, on GPU ``rank`` (``on_gpus``) or all ranks on
    GPU 0 (``one_gpu``)."""
    device = "cpu"
    if on_gpus or one_gpu:
        gpu = 0 if one_gpu else rank
        torch.cuda.set_device(gpu)
        device = f"cuda:{gpu}"
    out = {}
    for case in cases:
        try:
            out[case.id] = _run_case(case, rank, device, transport)
        except Exception as e:  # recorded per case; errors are agreed, so no rank hangs
            out[case.id] = {"error": f"{type(e).__name__}: {e}"}
        dist.barrier()
    return out


@pytest.fixture(scope="module", params=usable_transports(cuda=False))
def results(request) -> tuple[str, list[dict[str, dict]]]:
    return request.param, run_world(_world_cases, WORLD, CASES, False, request.param, timeout=900)


def check_case(case: Case, results) -> None:
    held = 0
    for rank, per_rank in enumerate(results):
        got = per_rank[case.id]
        assert "error" not in got, f"rank {rank}: {got['error']}"
        assert got["same_before"] == [], f"rank {rank}: already equal before the refit: {got['same_before']}"
        assert got["wrong"] == [], f"rank {rank}: differ after the refit: {got['wrong'][:5]}"
        assert got["moved"] == [], f"rank {rank}: non-persistent buffers moved: {got['moved']}"
        assert got["version"] == 2
        held += got["n"]
    assert held > 0, "no rank held a destination tensor"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_layout_case(case: Case, results) -> None:
    check_case(case, results[1])


def test_some_cases_move_bytes_between_ranks(results) -> None:
    """Guards the suite itself: most cases must exercise the transport, not only local copies."""
    _, results = results
    remote = [c.id for c in CASES if sum(r[c.id].get("remote", 0) for r in results) > 0]
    assert len(remote) >= len(CASES) * 3 // 4, remote
