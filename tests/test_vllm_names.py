"""vLLM's names and tensors as ``hf_to_vllm`` and ``vllm_tp_specs`` see them (no engine).

* vLLM's engine state (attention ``_k_scale`` / ``_v_scale`` / ``_q_scale`` /
  ``_prob_scale``, rotary ``cos_sin_cache``) is fed nothing and left as it is by a real
  refit, with no ``skip`` given;
* vLLM 0.32's stacked experts under ``experts.routed_experts.`` come from
  transformers 5's fused ``mlp.experts.gate_up_proj`` / ``down_proj``;
* a tensor vLLM emptied (its CPU build's packed linears: a ``[0]`` parameter) is named
  as emptied by ``vllm_tp_specs``, not reported as a name-map problem;
* ``vllm_tp_shards`` cuts whole tensors into the shards ``vllm_tp_specs`` reads back,
  each element on exactly one rank (a kv head on several where TP exceeds the kv heads).
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

import torchrefit as tr
from torchrefit.errors import LayoutError
from torchrefit.layout.vllm_tp import local_shape, vllm_tp_shards, vllm_tp_specs
from torchrefit.maps.hf_vllm import is_engine_state

SCALES = ["model.layers.0.self_attn.attn._k_scale", "model.layers.0.self_attn.attn._v_scale",
          "model.layers.0.self_attn.attn._q_scale", "model.layers.0.self_attn.attn._prob_scale",
          "model.layers.0.self_attn.rotary_emb.cos_sin_cache"]


@pytest.fixture
def world_of_one():
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_engine_state_names():
    assert all(is_engine_state(n) for n in SCALES)
    assert not any(is_engine_state(n) for n in ("model.layers.0.self_attn.qkv_proj.weight",
                                                "model.norm.weight", "lm_head.weight"))


def test_refit_leaves_engine_state_alone(world_of_one):
    torch.manual_seed(0)
    q, k, v = torch.randn(8, 4), torch.randn(4, 4), torch.randn(4, 4)
    src = {"model.layers.0.self_attn.q_proj.weight": q,
           "model.layers.0.self_attn.k_proj.weight": k,
           "model.layers.0.self_attn.v_proj.weight": v}
    dst = {"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(16, 4)}
    dst.update({n: torch.full((), 7.0) for n in SCALES[:4]})
    dst[SCALES[4]] = torch.full((16, 8), 3.0)
    r = tr.Refitter(src, dst, name_map=tr.maps.hf_to_vllm(num_heads=2, num_kv_heads=1),
                    cast=True)  # no skip=
    r.refit()
    assert torch.equal(dst["model.layers.0.self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
    assert all(float(dst[n]) == 7.0 for n in SCALES[:4])
    assert torch.equal(dst[SCALES[4]], torch.full((16, 8), 3.0))


def test_routed_experts_from_fused_transformers5_names():
    m = tr.maps.hf_to_vllm(num_heads=4, num_kv_heads=2)
    src = {"model.layers.1.mlp.experts.gate_up_proj": torch.empty(4, 64, 32, device="meta"),
           "model.layers.1.mlp.experts.down_proj": torch.empty(4, 32, 32, device="meta")}
    w13 = m.segments("model.layers.1.mlp.experts.routed_experts.w13_weight", (4, 64, 32), src, {})
    w2 = m.segments("model.layers.1.mlp.experts.routed_experts.w2_weight", (4, 32, 32), src, {})
    assert [s.src_name for s in w13] == ["model.layers.1.mlp.experts.gate_up_proj"]
    assert [s.src_name for s in w2] == ["model.layers.1.mlp.experts.down_proj"]
    with pytest.raises(tr.PlanError, match="w2_weight"):
        m.segments("model.layers.1.mlp.experts.routed_experts.w2_weight", (4, 32, 16), src, {})


def test_an_emptied_tensor_is_named_as_emptied():
    tensors = {"model.layers.0.self_attn.qkv_proj.weight": torch.empty(0),
               "model.norm.weight": torch.ones(8)}
    with pytest.raises(LayoutError, match=r"qkv_proj\.weight: vLLM has emptied this tensor"):
        vllm_tp_specs(tensors, 0, 2, num_heads=4, num_kv_heads=2)


WHOLE = {"model.embed_tokens.weight": (256, 64), "model.layers.0.self_attn.q_proj.weight": (128, 64),
         "model.layers.0.self_attn.q_proj.bias": (128,), "model.layers.0.self_attn.k_proj.weight": (64, 64),
         "model.layers.0.self_attn.v_proj.bias": (64,), "model.layers.0.self_attn.o_proj.weight": (64, 128),
         "model.layers.0.mlp.up_proj.weight": (96, 64), "model.layers.0.mlp.down_proj.weight": (64, 96),
         "model.layers.0.input_layernorm.weight": (64,), "lm_head.weight": (256, 64)}


@pytest.mark.parametrize("tp", [2, 4])
def test_whole_tensors_cut_into_the_shards_vllm_tp_specs_reads(tp):
    """4 heads, 2 kv heads of 32 rows: at TP4 each kv head is held by two ranks."""
    covered = {n: torch.zeros(shape, dtype=torch.int64) for n, shape in WHOLE.items()}
    for rank in range(tp):
        specs = vllm_tp_shards(WHOLE, rank, tp, num_heads=4, num_kv_heads=2)
        assert "model.layers.0.input_layernorm.weight" not in specs  # whole on every rank
        local = {n: torch.empty(local_shape(spec)) for n, spec in specs.items()}
        assert vllm_tp_specs(local, rank, tp, num_heads=4, num_kv_heads=2) == specs
        for n, spec in specs.items():
            for p in spec.pieces:
                covered[n][p.box.slices()] += 1
    del covered["model.layers.0.input_layernorm.weight"]
    for n, c in covered.items():
        want = 2 if tp == 4 and (".k_proj." in n or ".v_proj." in n) else 1
        assert bool((c == want).all()), (n, c.unique())


def test_a_whole_tensor_that_does_not_cut_is_named():
    with pytest.raises(LayoutError, match=r"q_proj\.weight: a whole tensor of shape \[130, 64\]"):
        vllm_tp_shards({"model.layers.0.self_attn.q_proj.weight": (130, 64)}, 0, 4,
                       num_heads=4, num_kv_heads=2)
