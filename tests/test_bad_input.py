"""Bad input: detected while planning, raised on every rank within seconds, nothing written.

Covers a destination tensor with no source, sizes that do not divide, a dtype
mismatch with no cast, duplicate names, ranks that disagree about a model's
structure, a layout that fails on one rank only, a bad rank offset, transports
(nccl, ipc) that cannot serve the tensors, a model left on the meta device on one rank
(a copy out of or into it would move nothing, silently), and ``skip=`` letting named tensors go without a
source. Each case runs on 4 real processes; each rank reports what it raised and
whether its destination changed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import torchrefit as tr
from torchrefit.testing import (
    Mesh,
    ModelSpec,
    attempt_refit,
    build_toy,
    check_failed_everywhere,
    expected_local,
    run_world,
)

WORLD = 4
DENSE = ModelSpec(layers=2)
TP3 = ModelSpec(layers=2, heads=6, groups=6, hidden=24, ffn=48, vocab=96)


def _no_source(rank):
    return build_toy(replace(DENSE, bias=False), Mesh(2, ranks=4), rank, 1), \
        build_toy(DENSE, Mesh(1, ranks=4), rank, 2), {}


def _not_divisible(rank):
    src = build_toy(replace(TP3, vocab=100), Mesh(1, ranks=4), rank, 1)
    return src, build_toy(replace(TP3, vocab=99), Mesh(3, ranks=3), rank, 2), {}


def _dtype(rank):
    return build_toy(DENSE, Mesh(2, ranks=4), rank, 1), \
        build_toy(replace(DENSE, dtype=torch.bfloat16), Mesh(1, ranks=4), rank, 2), {}


def _duplicate(rank):
    dst = build_toy(DENSE, Mesh(1, ranks=4), rank, 2)
    specs = {"decoder.final_layernorm.weight": tr.TensorSpec("w", (24,), tr.layout.whole_piece((24,))),
             "decoder.layers.0.mlp.linear_fc2.bias": tr.TensorSpec("w", (24,), tr.layout.whole_piece((24,)))}
    return build_toy(DENSE, Mesh(2, ranks=4), rank, 1), dst, {"dst_layout": tr.Explicit(specs)}


def _disagree(rank):
    spec = replace(DENSE, ffn=40) if rank == 1 else DENSE
    return build_toy(DENSE, Mesh(2, ranks=4), rank, 1), build_toy(spec, Mesh(1, ranks=4), rank, 2), {}


def _one_rank_layout(rank):
    dst = build_toy(DENSE, Mesh(1, ranks=4), rank, 2)
    if rank == 2:
        del dst.pg_collection  # rank 2 alone cannot describe its model
        return build_toy(DENSE, Mesh(2, ranks=4), rank, 1), dst, {"dst_layout": "megatron"}
    return build_toy(DENSE, Mesh(2, ranks=4), rank, 1), dst, {"dst_layout": "megatron"}


def _unnumbered_stage(rank):
    # a pipeline stage whose layers lost megatron's global layer_number: its
    # decoder.layers.0 would name the first stage's layer 0 too
    src = build_toy(DENSE, Mesh(1, pp=2, ranks=4), rank, 1)
    if rank == 3:
        for layer in src.decoder.layers.children():
            del layer.layer_number
    return src, build_toy(DENSE, Mesh(1, ranks=4), rank, 2), {}


def _offset(rank):
    return build_toy(DENSE, Mesh(2, ranks=2), rank, 1), \
        build_toy(DENSE, Mesh(1, ranks=2, offset=2), rank, 2), {"src_rank_offset": 2}


def _nccl_on_cpu(rank):
    return build_toy(DENSE, Mesh(2, ranks=4), rank, 1), \
        build_toy(DENSE, Mesh(1, ranks=4), rank, 2), {"transport": "nccl"}


def _meta_source(rank):
    # rank 3's trainer was never materialized: a copy out of it would read nothing
    src = build_toy(DENSE, Mesh(2, ranks=4), rank, 1)
    return (src.to("meta") if rank == 3 else src), build_toy(DENSE, Mesh(1, ranks=4), rank, 2), {}


def _ipc_on_cpu(rank):
    return build_toy(DENSE, Mesh(2, ranks=4), rank, 1), \
        build_toy(DENSE, Mesh(1, ranks=4), rank, 2), {"transport": "ipc"}


class _Plain(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((n, 4), float(n)))


def _replicated_shape(rank):
    # A plain (replicated) source whose shape differs from the destination's.
    return _Plain(8), _Plain(6), {}


CASES = {
    "no-source": (_no_source, tr.PlanError, "has no source tensor"),
    "not-divisible": (_not_divisible, tr.PlanError, "100 does not divide into the destination's 3 shards of 33"),
    "dtype-no-cast": (_dtype, tr.PlanError, "dtype mismatch with no cast"),
    "duplicate-names": (_duplicate, tr.LayoutError, "duplicate name"),
    "ranks-disagree": (_disagree, tr.PlanError, "destination ranks disagree about the model's structure"),
    "layout-fails-on-one-rank": (_one_rank_layout, tr.LayoutError, "rank 2"),
    "unnumbered-stage-layers": (_unnumbered_stage, tr.LayoutError,
                                "decoder.layers.0: a layer of pipeline stage 1 of 2 without"),
    "bad-offset": (_offset, tr.PlanError, "below its rank offset 2"),
    "nccl-on-cpu": (_nccl_on_cpu, tr.TransportError, "needs CUDA tensors"),
    "ipc-on-cpu": (_ipc_on_cpu, tr.TransportError, "transport 'ipc' needs CUDA tensors"),
    "meta-tensor": (_meta_source, tr.LayoutError, "on rank 3 is on the meta device"),
    "shape-mismatch": (_replicated_shape, tr.PlanError, "global shapes differ"),
}


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _world(rank: int, world: int, names: list[str]) -> dict[str, dict]:
    out = {}
    for name in names:
        make, _, _ = CASES[name]
        src, dst, kwargs = make(rank)
        out[name] = attempt_refit(src, dst, **kwargs)
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(_world, WORLD, list(CASES), timeout=300, pg_timeout=30)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_everywhere(name, results) -> None:
    _, error, text = CASES[name]
    check_failed_everywhere([per_rank[name] for per_rank in results], error, text)


def _skip_world(rank: int, world: int) -> tuple[list[str], list[str], list[str]]:
    src = build_toy(replace(DENSE, bias=False), Mesh(2, ranks=4), rank, 1)
    dst = build_toy(DENSE, Mesh(1, ranks=4), rank, 2)
    before = _snapshot(dst)
    tr.Refitter(src, dst, skip=["*.bias"]).refit()
    after = _snapshot(dst)
    want = expected_local(DENSE, Mesh(1, ranks=4), rank, 1)  # the oracle of the source's values
    kept = sorted(k for k in before if torch.equal(before[k], after[k]))
    right = sorted(k for k in before if torch.equal(after[k], want[k]))
    return kept, right, sorted(before)


def test_skip_leaves_named_tensors_untouched() -> None:
    for kept, right, names in run_world(_skip_world, WORLD, timeout=120):
        biases = [k for k in names if k.endswith(".bias")]
        assert biases and kept == biases, kept
        assert right == [k for k in names if not k.endswith(".bias")], sorted(set(names) - set(right))
