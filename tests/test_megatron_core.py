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
every rank holding the whole Hugging Face model. The layouts RL trainers run split the
model further: pipeline parallel PP2 (Qwen2 with two layers a stage, Mixtral with one;
a stage's ``decoder.layers.K`` is a global layer further on), PP2 x TP2 on four ranks,
and expert parallel EP2 (two of the four experts on each rank, ``local_experts.0`` and
``.1`` being global experts 2 and 3 on the second). There megatron-core's forward runs
stage by stage (``set_input_tensor``), the way its schedules do.

The oracle's fairness: the Hugging Face model's logits differ from megatron-core's
before the refit, after swapping the two layers either side of the middle (one from
each pipeline stage), after swapping the two experts either side of the middle (one
from each expert-parallel rank), and after swapping its ``k_proj`` and ``v_proj``
weights. Each rank is checked to hold only its stage and experts, and megatron-core's
forward across stages and expert ranks to equal its forward without them on the same
weights.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace

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
    megatron_pp_logits,
)

QWEN2_DEEP = replace(QWEN2, layers=4)  # two layers a pipeline stage


@dataclass(frozen=True)
class Case:
    """One megatron-core trainer layout: ``shape`` at these parallel sizes, on
    ``tp * pp * ep`` gloo ranks (expert parallelism over the data-parallel ranks)."""

    shape: GptShape
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.ep


CASES = {
    "qwen2-tp1": Case(QWEN2_DEEP), "llama-tp1": Case(LLAMA), "mixtral-tp1": Case(MIXTRAL),
    "qwen2-tp2": Case(QWEN2_DEEP, tp=2), "llama-tp2": Case(LLAMA, tp=2),
    "mixtral-tp2": Case(MIXTRAL, tp=2),
    "qwen2-pp2": Case(QWEN2_DEEP, pp=2), "mixtral-pp2": Case(MIXTRAL, pp=2),
    "mixtral-ep2": Case(MIXTRAL, ep=2),
    "qwen2-pp2-tp2": Case(QWEN2_DEEP, tp=2, pp=2),
}
TOL = 1e-4  # relative to the largest logit: float32 forwards of the same weights


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _swap(model, a: str, b: str, rows: tuple[int, int] | None = None) -> None:
    """Exchange the values of two same-shaped parameters of ``model`` (or, with ``rows``,
    two rows of dim 0 of parameter ``a``)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        if rows is not None:
            x = params[a]
            x[list(rows)] = x[list(reversed(rows))].clone()
            return
        tmp = params[a].clone()
        params[a].copy_(params[b])
        params[b].copy_(tmp)


def _swap_layers(dst, a: int, b: int) -> None:
    for n, _ in dst.named_parameters():
        if n.startswith(f"model.layers.{a}."):
            _swap(dst, n, n.replace(f"layers.{a}.", f"layers.{b}.", 1))


def _swap_experts(dst, layer: int, a: int, b: int) -> None:
    for n, _ in dst.named_parameters():
        if n.startswith(f"model.layers.{layer}.mlp.experts."):
            _swap(dst, n, n, rows=(a, b))


def _held(src) -> dict[str, int]:
    """What this rank's megatron-core model holds: its layers and its layer-0 experts."""
    names = [n for n, _ in src.named_parameters()]
    layers = {n.split(".")[2] for n in names if n.startswith("decoder.layers.")}
    experts = {n.split(".")[6] for n in names if n.startswith("decoder.layers.0.mlp.experts.")}
    return {"held layers": len(layers), "held experts": len(experts),
            "held embedding": int("embedding.word_embeddings.weight" in names),
            "held output": int("output_layer.weight" in names)}


def _case(case: Case, tokens: torch.Tensor) -> dict:
    shape = case.shape
    src = build_gpt(shape, tp=case.tp, seed=1, pp=case.pp, ep=case.ep)
    dst = hf_model(shape, seed=2)
    if case.pp > 1:
        want = megatron_pp_logits(src, tokens, shape.hidden)
    else:
        want = megatron_logits(src, tokens)
    # a list: a tensor would cross to the parent process through shared memory its
    # sender frees when it exits
    out = {"megatron logits": want.tolist(), **_held(src), "before": _err(hf_logits(dst, tokens), want)}
    name_map = tr.maps.megatron_to_hf(num_heads=shape.heads, num_query_groups=shape.groups)
    tr.Refitter(src, dst, name_map=name_map).refit()
    out["refit"] = _err(hf_logits(dst, tokens), want)
    # the two layers either side of the middle: of two pipeline stages, one from each
    a, b = shape.layers // 2 - 1, shape.layers // 2
    _swap_layers(dst, a, b)
    out["swapped layers"] = _err(hf_logits(dst, tokens), want)
    _swap_layers(dst, a, b)
    if shape.experts:
        # the two experts either side of the middle: of two expert-parallel ranks, one each
        e = shape.experts // 2
        _swap_experts(dst, shape.layers - 1, e - 1, e)
        out["swapped experts"] = _err(hf_logits(dst, tokens), want)
        _swap_experts(dst, shape.layers - 1, e - 1, e)
    kv = ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight")
    _swap(dst, *kv)
    out["swapped k/v"] = _err(hf_logits(dst, tokens), want)
    return out


def _world(rank: int, world: int) -> dict[str, dict]:
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    return {name: _case(c, tokens) for name, c in CASES.items() if c.world == world}


class _Results:
    """Each case's per-rank results; a world size's cases run together (one process per
    rank) when the first of them is asked for, so a selection (``-k``) runs only its worlds."""

    def __init__(self) -> None:
        self._done: dict[str, list[dict]] = {}
        self._failed: dict[int, Exception] = {}

    def __getitem__(self, case: str) -> list[dict]:
        world = CASES[case].world
        if world in self._failed:  # one failure per world, not one run per test asking
            raise self._failed[world]
        if case not in self._done:
            try:
                by_rank = run_world(_world, world, timeout=300)
            except Exception as e:
                self._failed[world] = e
                raise
            for name in by_rank[0]:
                self._done[name] = [r[name] for r in by_rank]
        return self._done[case]


@pytest.fixture(scope="module")
def results() -> _Results:
    return _Results()


@pytest.mark.parametrize("case", list(CASES))
def test_hf_logits_equal_megatron_forward_after_refit(results, case: str) -> None:
    for rank, err in enumerate(results[case]):
        assert err["before"] > 0.1, f"rank {rank}: the Hugging Face model already matched"
        assert err["refit"] < TOL, f"rank {rank}: logits differ by {err['refit']:.2e} (relative)"


@pytest.mark.parametrize("case", list(CASES))
def test_oracle_catches_swapped_layers_experts_and_kv(results, case: str) -> None:
    for rank, err in enumerate(results[case]):
        for broken in ("swapped layers", "swapped experts", "swapped k/v"):
            if broken in err:
                assert err[broken] > 100 * TOL, (
                    f"rank {rank}: {broken} still matched ({err[broken]:.2e})")


SPLIT = [n for n, c in CASES.items() if c.pp > 1 or c.ep > 1]


def _unsplit(case: str) -> str:
    """The case of the same shape and tensor parallelism without stages or expert ranks."""
    c = CASES[case]
    return next(n for n, o in CASES.items() if o == Case(c.shape, tp=c.tp))


@pytest.mark.parametrize("case", SPLIT)
def test_each_rank_holds_its_stage_and_experts_only(results, case: str) -> None:
    c = CASES[case]
    for rank, held in enumerate(results[case]):
        stage = rank // (c.tp * c.ep)  # megatron-core's rank order: tp, ep (data), then pp
        assert held["held layers"] == c.shape.layers // c.pp, f"rank {rank}: {held}"
        assert held["held experts"] == c.shape.experts // c.ep, f"rank {rank}: {held}"
        assert held["held embedding"] == (stage == 0), f"rank {rank}: {held}"
        assert held["held output"] == (stage == c.pp - 1), f"rank {rank}: {held}"


@pytest.mark.parametrize("case", SPLIT)
def test_megatron_forward_across_stages_and_expert_ranks_equals_unsplit(
        results, case: str) -> None:
    """The oracle's own check: pipeline stages (one forward each, hidden states sent
    between them) and expert-parallel ranks give the logits megatron-core gives without
    them, holding the same weights (every tensor seeded by its global name)."""
    want = torch.tensor(results[_unsplit(case)][0]["megatron logits"])
    for rank, out in enumerate(results[case]):
        err = _err(torch.tensor(out["megatron logits"]), want)
        assert err < TOL, f"rank {rank}: megatron-core's forward differs by {err:.2e}"
