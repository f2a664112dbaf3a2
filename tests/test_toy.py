"""The toy GPT that tests and benchmarks build: its pipeline split is the simulator's.

Where PP does not divide the layer count, the stages together still hold every
layer exactly once (the split is ``simulate.shapes.stage_layers``, as even as can
be), and each stage numbers its layers from its first global layer.
"""

from __future__ import annotations

import pytest

from torchrefit.simulate.shapes import stage_layers
from torchrefit.testing import Mesh, ModelSpec, build_toy


@pytest.mark.parametrize("layers,pp", [(5, 2), (4, 3), (7, 4), (3, 3), (8, 2)])
def test_pipeline_stages_hold_every_layer_once(layers: int, pp: int) -> None:
    spec = ModelSpec(layers=layers, hidden=8, heads=2, groups=1, ffn=8, vocab=16)
    held = []
    for stage in range(pp):
        model = build_toy(spec, Mesh(1, pp, ranks=pp), stage, seed=1)
        numbers = [m.layer_number for m in model.decoder.layers.children()]
        assert [n - 1 for n in numbers] == list(stage_layers(layers, pp, stage))
        held += numbers
    assert sorted(held) == list(range(1, layers + 1))
