"""The trainer namings torchrefit's vLLM backend takes, rebuilt on the engine (no engine).

A trainer passes ``name_map=`` ``hf_to_vllm`` (Hugging Face names),
``torchtitan_to_vllm`` or ``megatron_to_vllm``; the engine rebuilds the map from its
own config and a JSON description of the trainer's part. Covered here, with names and
shapes only (no megatron-core, no vLLM engine):

* the description survives JSON and the rebuilt map has the trainer's ``cache_key``
  (what both sides compare at init), for torchtitan and Megatron-core maps; a map
  the backend cannot carry is refused on the trainer with the maps it takes;
* a description that is not a declared one (unknown kind, missing or extra field, a
  value of another type, heads that do not divide) is a ``PlanError`` on the engine;
* what vLLM's ``load_weights`` is fed for its packed tensors (``qkv_proj``,
  ``gate_up_proj``, stacked experts, a padded vocabulary): the Hugging Face tensors
  the Megatron-core (or torchtitan) trainer's map makes, with their global shapes; a
  trainer whose names the map does not read is named with the map to pass.
"""

from __future__ import annotations

import json

import pytest

import torchrefit as tr
from torchrefit.engines._source_maps import (
    compose,
    describe_source,
    route_maps,
    sink_tensors,
    source_map_from,
)

H, HEADS, KV, D, FF, E, MOE_FF, VOCAB, PADDED = 128, 4, 2, 32, 256, 4, 64, 256, 320
HF_CFG = {"num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": D}
MEGATRON_CFG = {"num_attention_heads": HEADS, "num_query_groups": KV, "kv_channels": D}


def _engine_map(description):
    """What an engine worker builds: vLLM's part from its config, the rest from JSON."""
    return compose(tr.maps.hf_to_vllm(HF_CFG), source_map_from(json.loads(json.dumps(description))))


@pytest.mark.parametrize("trainer_map", [
    tr.maps.megatron_to_vllm(MEGATRON_CFG),
    tr.maps.megatron_to_vllm(num_heads=HEADS, num_query_groups=KV),  # head_dim from shapes
    tr.maps.torchtitan_to_vllm(num_heads=HEADS, num_kv_heads=KV),
    tr.maps.torchtitan_to_vllm(num_heads=HEADS, num_kv_heads=KV, permute_rope=False),
    tr.maps.hf_to_vllm(HF_CFG),
], ids=["megatron", "megatron-no-head-dim", "torchtitan", "torchtitan-cos-sin", "hf"])
def test_the_engine_rebuilds_the_trainers_map(trainer_map) -> None:
    description = describe_source(trainer_map)
    assert (description is None) == isinstance(trainer_map, tr.maps.HfToVllm)
    assert _engine_map(description).cache_key() == trainer_map.cache_key()


def test_heads_that_differ_from_the_engines_config_show_in_the_key() -> None:
    trainer_map = tr.maps.megatron_to_vllm(num_heads=8, num_query_groups=KV)
    assert _engine_map(describe_source(trainer_map)).cache_key() != trainer_map.cache_key()


@pytest.mark.parametrize("name_map", [
    tr.maps.megatron_to_hf(MEGATRON_CFG),  # the map to Hugging Face, not to vLLM
    tr.maps.Rename({"a.weight": "b.weight"}),
    tr.maps.Compose(tr.maps.Rename({}), tr.maps.megatron_to_hf(MEGATRON_CFG)),
])
def test_a_map_the_backend_cannot_carry_is_refused_on_the_trainer(name_map) -> None:
    with pytest.raises(TypeError, match="torchtitan_to_vllm.*megatron_to_vllm"):
        describe_source(name_map)


@pytest.mark.parametrize("description, said", [
    ({"kind": "pickle", "data": "gASV"}, "not one the engine builds"),
    ("megatron_to_hf", "not one the engine builds"),
    ({"kind": "megatron_to_hf", "num_heads": 4, "num_query_groups": 2}, "fields"),
    ({"kind": "megatron_to_hf", "num_heads": 4, "num_query_groups": 2, "head_dim": None,
      "extra": 1}, "fields"),
    ({"kind": "torchtitan_to_hf", "num_heads": 4, "num_kv_heads": "2", "permute_rope": True},
     "num_kv_heads='2' is not int"),
    ({"kind": "torchtitan_to_hf", "num_heads": True, "num_kv_heads": 2, "permute_rope": True},
     "num_heads=True is not int"),
    ({"kind": "torchtitan_to_hf", "num_heads": 4, "num_kv_heads": 2, "permute_rope": 1},
     "permute_rope=1 is not bool"),
    ({"kind": "megatron_to_hf", "num_heads": 4, "num_query_groups": 3, "head_dim": None},
     "not a multiple"),
])
def test_an_undeclared_description_is_refused_on_the_engine(description, said) -> None:
    with pytest.raises(tr.PlanError, match=said) as e:
        source_map_from(description)
    assert e.value.rule == "source map"


# ---------------------------------------------------- what load_weights is fed
def _vllm_packed(experts: bool) -> dict[str, tuple[int, ...]]:
    """Global shapes of a vLLM model's tensors that vLLM CPU routes through load_weights."""
    out = {"model.embed_tokens.weight": (PADDED, H), "lm_head.weight": (PADDED, H),
           "model.layers.0.self_attn.qkv_proj.weight": ((HEADS + 2 * KV) * D, H),
           "model.layers.0.self_attn.o_proj.weight": (H, HEADS * D)}
    if experts:
        out["model.layers.0.mlp.experts.w13_weight"] = (E, 2 * MOE_FF, H)
        out["model.layers.0.mlp.experts.w2_weight"] = (E, H, MOE_FF)
    else:
        out["model.layers.0.mlp.gate_up_proj.weight"] = (2 * FF, H)
        out["model.layers.0.mlp.down_proj.weight"] = (H, FF)
    return out


def _megatron(experts: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """A Megatron-core GPT trainer's global tensors (local spec names)."""
    L = "decoder.layers.0."
    out = {"embedding.word_embeddings.weight": (VOCAB, H), "output_layer.weight": (VOCAB, H),
           L + "self_attention.linear_qkv.weight": ((HEADS + 2 * KV) * D, H),
           L + "self_attention.linear_proj.weight": (H, HEADS * D),
           L + "input_layernorm.weight": (H,), "decoder.final_layernorm.weight": (H,)}
    if experts:
        out[L + "mlp.router.weight"] = (E, H)
        for e in range(E):
            out[L + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * MOE_FF, H)
            out[L + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (H, MOE_FF)
    else:
        out[L + "mlp.linear_fc1.weight"] = (2 * FF, H)
        out[L + "mlp.linear_fc2.weight"] = (H, FF)
    return {n: (s, "float32") for n, s in out.items()}


@pytest.mark.parametrize("experts", [False, True], ids=["dense", "moe"])
def test_load_weights_is_fed_hugging_face_tensors_made_from_megatron_names(experts) -> None:
    name_map = _engine_map(describe_source(tr.maps.megatron_to_vllm(MEGATRON_CFG)))
    got = {n: (s, d) for n, s, d in sink_tensors(name_map, _vllm_packed(experts),
                                                  _megatron(experts))}
    want = {"model.embed_tokens.weight": (VOCAB, H), "lm_head.weight": (VOCAB, H),
            "model.layers.0.self_attn.q_proj.weight": (HEADS * D, H),
            "model.layers.0.self_attn.k_proj.weight": (KV * D, H),
            "model.layers.0.self_attn.v_proj.weight": (KV * D, H),
            "model.layers.0.self_attn.o_proj.weight": (H, HEADS * D)}
    if experts:
        want["model.layers.0.mlp.experts.gate_up_proj"] = (E, 2 * MOE_FF, H)
        want["model.layers.0.mlp.experts.down_proj"] = (E, H, MOE_FF)
    else:
        want["model.layers.0.mlp.gate_proj.weight"] = (FF, H)
        want["model.layers.0.mlp.up_proj.weight"] = (FF, H)
        want["model.layers.0.mlp.down_proj.weight"] = (H, FF)
    assert got == {n: (s, "float32") for n, s in want.items()}
    # the load_weights route refits those Hugging Face names from Megatron's
    inner = route_maps(name_map)["load_weights"]
    assert isinstance(inner, tr.maps.MegatronToHF)
    segs = inner.segments("model.layers.0.self_attn.k_proj.weight", (KV * D, H),
                          {n: _Shape(s) for n, (s, _) in _megatron(experts).items()}, {})
    assert [s.src_name for s in segs] == ["decoder.layers.0.self_attention.linear_qkv.weight"] * KV


def test_load_weights_is_fed_hugging_face_tensors_made_from_torchtitan_names() -> None:
    name_map = _engine_map(describe_source(tr.maps.torchtitan_to_vllm(
        num_heads=HEADS, num_kv_heads=KV)))
    A = "layers.0.attention."
    src = {"tok_embeddings.weight": ((VOCAB, H), "float32"),
           "lm_head.weight": ((VOCAB, H), "float32"),
           A + "qkv_linear.wqkv.weight": (((HEADS + 2 * KV) * D, H), "float32"),
           A + "wo.weight": ((H, HEADS * D), "float32")}
    dst = {n: s for n, s in _vllm_packed(False).items() if "mlp" not in n}
    got = [n for n, _, _ in sink_tensors(name_map, dst, src)]
    assert got == ["model.embed_tokens.weight", "lm_head.weight",
                   "model.layers.0.self_attn.q_proj.weight",
                   "model.layers.0.self_attn.k_proj.weight",
                   "model.layers.0.self_attn.v_proj.weight",
                   "model.layers.0.self_attn.o_proj.weight"]


def test_a_trainer_the_map_does_not_read_is_named_with_the_map_to_pass() -> None:
    """Hugging Face names under megatron_to_vllm: the vLLM tensor, the names the map
    reads and the maps to choose from."""
    name_map = _engine_map(describe_source(tr.maps.megatron_to_vllm(MEGATRON_CFG)))
    src = {"model.embed_tokens.weight": ((VOCAB, H), "float32")}
    with pytest.raises(tr.PlanError) as e:
        sink_tensors(name_map, {"model.embed_tokens.weight": (PADDED, H)}, src)
    message = str(e.value)
    assert e.value.tensor == "model.embed_tokens.weight" and e.value.rule == "no source"
    assert "'embedding.word_embeddings.weight'" in message, message
    assert "tr.maps.hf_to_vllm(config) for Hugging Face names" in message, message


def test_a_source_of_another_shape_is_named() -> None:
    name_map = _engine_map(describe_source(tr.maps.megatron_to_vllm(MEGATRON_CFG)))
    src = dict(_megatron(False))
    src["decoder.layers.0.self_attention.linear_proj.weight"] = ((H, 96), "float32")
    with pytest.raises(tr.PlanError, match=r"q_proj.weight: shapes do not fit num_heads=4.*"
                       r"linear_proj.weight \[128, 96\]"):
        sink_tensors(name_map, _vllm_packed(False), src)


class _Shape:
    def __init__(self, shape) -> None:
        self.shape = shape
