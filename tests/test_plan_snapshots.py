"""Plans frozen on a grid of layouts: the planner's speed work must not change one plan.

Every rank's plan of each case (simulated presets with fewer layers, DeepSeek-V3-like
EP + PP, Mamba's block-interleaved pieces, uneven TP, disjoint and collocated worlds,
casts and FP8 targets) is written out field by field (``repr``: every value of every
copy, transfer and quantize step, in plan order) and hashed; the digests below were
taken from the planner before it was sped up for 16k ranks (main at eef9080). A change
that moves one byte, one peer or one region, or reorders a plan, fails here.

Where a plan change is meant (a new sharing rule, a new order), regenerate the digests
with ``PYTHONPATH=src python tests/test_plan_snapshots.py`` and say why in the commit.
"""

from __future__ import annotations

import hashlib
import sys

import pytest
import torch

from torchrefit.layout import megatron
from torchrefit.layout._types import Box, ModelLayout, Piece, TensorLayout
from torchrefit.plan.planner import Planner
from torchrefit.plan.world_plan import plan_world
from torchrefit.simulate import parse_mesh, preset, simulated_rosters
from torchrefit.testing import Mesh, ModelSpec, build_toy

#: name: (preset, overrides, src mesh, dst mesh, world)
SIMULATED = {
    "llama tp8pp4->tp4": ("llama-70b", {"layers": 4}, "tp8pp4", "tp4", 64),
    "llama tp4pp2->tp8 disjoint": ("llama-70b", {"layers": 4}, "tp4pp2@0:32", "tp8@32:64", 64),
    "deepseek pp4ep16->tp8ep8": ("deepseek-v3", {"layers": 8, "experts": 32}, "pp4ep16",
                                 "tp8ep8", 128),
    "deepseek pp2ep8 etp2->tp4ep4 disjoint": ("deepseek-v3", {"layers": 5, "experts": 16},
                                              "pp2ep8etp2@0:64", "tp4ep4@64:128", 128),
    "kimi pp2ep16->tp8ep16": ("kimi-k2", {"layers": 3, "experts": 32}, "pp2ep16",
                              "tp8ep16", 64),
    "qwen3 tp2ep4->tp4": ("qwen3-30b-a3b", {"layers": 2, "experts": 16}, "tp2ep4", "tp4", 32),
    "mamba tp2->tp4": ("gpt-4b", {"layers": 2, "mamba": True}, "tp2", "tp4", 16),
    "tied tp2pp2->tp1": ("dense-0.5b", {"layers": 4}, "tp2pp2", "tp1", 16),
}

#: name: (spec, src mesh, dst mesh, world, cast): toy GPTs described by the Megatron adapter
TOYS = {
    "toy tp3->tp2": (ModelSpec(heads=6, groups=6, hidden=24, ffn=48, vocab=96), Mesh(3, ranks=6),
                     Mesh(2, ranks=6), 6, "buffers"),
    "toy moe ep2->ep4": (ModelSpec(experts=8), Mesh(2, ep=2, etp=1, ranks=8),
                         Mesh(1, ep=4, ranks=8), 8, "buffers"),
    "toy fp32->bf16 cast": (ModelSpec(), Mesh(2, ranks=4), Mesh(1, ranks=4, offset=4), 8, True),
}

DIGESTS = {
    "llama tp8pp4->tp4": "c2c492198b718e04be8bbda7bb6871b1",
    "llama tp4pp2->tp8 disjoint": "b14e393621a0af055a816a781a4f69c3",
    "deepseek pp4ep16->tp8ep8": "c7776acd0b691000b59f2dcd7721393b",
    "deepseek pp2ep8 etp2->tp4ep4 disjoint": "0784928a987a4c718aa817f2553bcba0",
    "kimi pp2ep16->tp8ep16": "d0ca39eded1b6a0404e58fee34530057",
    "qwen3 tp2ep4->tp4": "68ce748c1494840e361b69839736c2ae",
    "mamba tp2->tp4": "c5dc4ed358ffc91ab13836a26e0cf16e",
    "tied tp2pp2->tp1": "a7111808083fefff7f7e5560a19e1f96",
    "toy tp3->tp2": "d7428f1eb6f021960629d5e1d5835077",
    "toy moe ep2->ep4": "b188ee35a04d879ed1116a7dbece6966",
    "toy fp32->bf16 cast": "647b1f160005a0948d88ccf34f4e51b4",
    "fp8 blocks": "186a5a9fb5543ed47d316371ceec370d",
}


def _digest(plans) -> str:
    h = hashlib.sha256()
    for rank in sorted(plans):
        h.update(repr(plans[rank]).encode())
    return h.hexdigest()[:32]


def _simulated(case: str) -> str:
    name, over, src, dst, world = SIMULATED[case]
    shape = preset(name).with_overrides(**over)
    s = simulated_rosters(shape, parse_mesh(src, world), world)
    d = simulated_rosters(shape, parse_mesh(dst, world), world)
    planner = Planner.from_rosters(s.rosters(), d.rosters())
    planner.validate()
    return _digest({r: planner.plan_rank(r, world, s.layout(r), d.layout(r))
                    for r in range(world)})


def _toy(case: str) -> str:
    spec, src, dst, world, cast = TOYS[case]
    dst_spec = spec if cast is not True else ModelSpec(dtype=torch.bfloat16)

    def layouts(spec, mesh):
        models = [build_toy(spec, mesh, r, 0) for r in range(world)]
        return [megatron(m).layout if m is not None else None for m in models]

    return _digest(plan_world(layouts(spec, src), layouts(dst_spec, dst), cast=cast))


def _fp8() -> str:
    """FP8 targets with block scales: aligned shards (quantized by the sender), shards that
    cut blocks (quantized on receipt), several source replicas."""
    def one(name, shape, dtype, boxes):
        pieces = tuple(Piece(b, (0,) * len(shape)) for b in boxes)
        return ((name, TensorLayout(name, shape, dtype, boxes[0].size, pieces)),)

    src = [ModelLayout(one("w", (48, 16), "bfloat16", [Box((r % 4 * 12, 0), (12, 16))])
                       + one("v", (16, 16), "bfloat16", [Box.whole((16, 16))])
                       + (one("u", (16, 16), "bfloat16", [Box((r * 8, 0), (8, 16))]) if r < 2
                          else ()))
           for r in range(8)] + [None] * 3
    dst = [None] * 8
    for a, b in [(0, 16), (16, 32), (32, 48)]:
        dst.append(ModelLayout(one("w", (48, 16), "float8_e4m3fn", [Box((a, 0), (b - a, 16))])
                               + one("w_scale_inv", (6, 2), "float32",
                                     [Box((a // 8, 0), ((b - a) // 8, 2))])
                               + one("v", (16, 16), "float8_e4m3fn", [Box.whole((16, 16))])
                               + one("v_scale_inv", (2, 2), "float32", [Box.whole((2, 2))])
                               + one("u", (16, 16), "float8_e4m3fn", [Box.whole((16, 16))])
                               + one("u_scale_inv", (2, 2), "float32", [Box.whole((2, 2))])))
    return _digest(plan_world(src, dst, fp8_block=(8, 8)))


def digest(case: str) -> str:
    if case in SIMULATED:
        return _simulated(case)
    if case in TOYS:
        return _toy(case)
    return _fp8()


@pytest.mark.parametrize("case", list(DIGESTS))
def test_plans_are_the_frozen_ones(case: str) -> None:
    assert digest(case) == DIGESTS[case], f"{case}: the plans changed (see the module docstring)"


if __name__ == "__main__":  # print the digests, to paste above where a change is meant
    for case in DIGESTS:
        print(f'    "{case}": "{digest(case)}",', file=sys.stdout, flush=True)
