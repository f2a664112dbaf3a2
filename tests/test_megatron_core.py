"""Real megatron-core trainers refit into ``transformers`` models through ``tr.maps.megatron_to_hf``.

Skipped where megatron-core is not installed. Each case builds a megatron-core
``GPTModel`` (local spec, float32, CPU; ``tests/megatron_models.py``) and a
``transformers`` model of the same shape holding other random weights, refits the
first into the second with the layout detected from megatron-core's own attributes
and process groups, and compares the logits of both forwards on the same tokens:
megatron-core's forward is the oracle, independent of torchrefit. Qwen2-shaped
(SwiGLU ``linear_fc1``, RMSNorm, GQA, qkv biases, untied embeddings) and
Llama-shaped (no biases, one key/value head) and Mixtral-shaped (4 experts, top-2,
``local_experts.K`` into transformers' stacked ``experts.gate_up_proj`` / ``down_proj``),
each at TP1 in one process and TP2 over two gloo ranks (experts tensor-parallel too),
every rank holding the whole Hugging Face model.

The oracle's fairness: the Hugging Face model's logits differ from megatron-core's
before the refit, after swapping its two layers, and after swapping its ``k_proj``
and ``v_proj`` weights.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import torchrefit as tr
from torchrefit.testing import run_world

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("megatron-core and transformers are not both installed", allow_module_level=True)

from megatron_models import (  # noqa: E402
    LLAMA,
    MIXTRAL,
    QWEN2,
    GptShape,
    build_gpt,
    hf_logits,
    hf_model,
    megatron_logits,
)

SHAPES = {"qwen2": QWEN2, "llama": LLAMA, "mixtral": MIXTRAL}
TPS = (1, 2)
TOL = 1e-4  # relative to the largest logit: float32 forwards of the same weights


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _swap(model, a: str, b: str) -> None:
    """Exchange the values of two same-shaped parameters of ``model``."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        tmp = params[a].clone()
        params[a].copy_(params[b])
        params[b].copy_(tmp)


def _case(shape: GptShape, tokens: torch.Tensor) -> dict[str, float]:
    src = build_gpt(shape, tp=torch.distributed.get_world_size(), seed=1)
    dst = hf_model(shape, seed=2)
    want = megatron_logits(src, tokens)
    out = {"before": _err(hf_logits(dst, tokens), want)}
    name_map = tr.maps.megatron_to_hf(num_heads=shape.heads, num_query_groups=shape.groups)
    tr.Refitter(src, dst, name_map=name_map).refit()
    out["refit"] = _err(hf_logits(dst, tokens), want)
    layer0 = [n for n, _ in dst.named_parameters() if n.startswith("model.layers.0.")]
    for n in layer0:
        _swap(dst, n, n.replace("layers.0.", "layers.1.", 1))
    out["swapped layers"] = _err(hf_logits(dst, tokens), want)
    for n in layer0:
        _swap(dst, n, n.replace("layers.0.", "layers.1.", 1))
    kv = ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight")
    _swap(dst, *kv)
    out["swapped k/v"] = _err(hf_logits(dst, tokens), want)
    return out


def _world(rank: int, world: int) -> dict[str, dict[str, float]]:
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    return {family: _case(shape, tokens) for family, shape in SHAPES.items()}


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict[str, dict[str, float]]]]:
    return {tp: run_world(_world, tp, timeout=240) for tp in TPS}


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("family", list(SHAPES))
def test_hf_logits_equal_megatron_forward_after_refit(results, family: str, tp: int) -> None:
    for rank, out in enumerate(results[tp]):
        err = out[family]
        assert err["before"] > 0.1, f"rank {rank}: the Hugging Face model already matched"
        assert err["refit"] < TOL, f"rank {rank}: logits differ by {err['refit']:.2e} (relative)"


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("family", list(SHAPES))
def test_oracle_catches_swapped_layers_and_kv(results, family: str, tp: int) -> None:
    for rank, out in enumerate(results[tp]):
        err = out[family]
        for broken in ("swapped layers", "swapped k/v"):
            assert err[broken] > 100 * TOL, f"rank {rank}: {broken} still matched ({err[broken]:.2e})"
