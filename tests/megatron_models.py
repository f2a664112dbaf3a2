"""Small megatron-core ``GPTModel``s on the CPU, and the ``transformers`` models they refit into.

The models are real megatron-core (local layer spec: no Transformer Engine, no apex),
float32, built inside megatron's own parallel state, so tests refit what a Megatron
trainer holds. Three settings keep megatron-core 0.16 off CUDA on a CPU-only torch:

* ``use_cpu_initialization``: weights are made on the host, each TP rank its slice;
* the inference RNG tracker (``initialize_rng_tracker(inference_rng_tracker=True)``):
  attention dropout forks no CUDA RNG state;
* an explicit causal mask: the default one is made on ``device="cuda"``.

Two calls still ask CUDA: RoPE moves its ``inv_freq``, and the MoE router its weight, to
``torch.cuda.current_device()`` on the first forward, so :func:`megatron_logits` answers
that call with the host. MoE models use the ``allgather`` token dispatcher (``alltoall``
makes a CUDA stream when built), and megatron-core 0.16.1 without Transformer Engine
never defines the ``te_general_gemm`` its router gating reads, so
:func:`build_gpt` sets it to None, the value meant for that case.

Every parameter is then refilled from a generator seeded by its global name (and, for
a tensor-parallel shard, its TP rank), so norms and biases are not ones and zeros and
a tensor put in the wrong place changes the logits. Replicated tensors get the same
values on every TP rank, as megatron-core requires. The global name is worked out
here from the config alone, not from megatron-core's modules nor torchrefit: a pipeline
stage holds ``layers // pp`` layers, stage ``r`` from global layer ``r * layers // pp``
on (megatron-core's even split), and an expert-parallel rank ``e`` holds experts
``e * experts // ep`` on. So a stage's ``decoder.layers.0`` gets the values of the global
layer it is, and a one-stage model of the same seed holds the same weights.

:func:`megatron_pp_logits` is megatron-core's own forward across pipeline stages:
each stage runs ``GPTModel.forward`` on the hidden states the stage before it sent
(``set_input_tensor``, as megatron's schedules do), and the last stage's logits are
broadcast to the whole pipeline.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from unittest import mock

import torch
from torch import nn

__all__ = [
    "GptShape", "QWEN2", "LLAMA", "MIXTRAL", "build_gpt", "megatron_logits", "megatron_pp_logits",
    "hf_model", "hf_logits", "stage_layer_offset",
]


@dataclass(frozen=True)
class GptShape:
    """One decoder-only model's shape, in both megatron-core's and transformers' terms."""

    family: str  # "qwen2", "llama" or "mixtral": the transformers class (and its biases)
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    groups: int = 2  # query groups = key/value heads
    ffn: int = 96
    vocab: int = 128
    eps: float = 1e-6
    rope_base: float = 10000.0
    experts: int = 0  # MoE (Mixtral-shaped): experts per layer, each of expert_ffn, top-k routed
    expert_ffn: int = 32
    topk: int = 2
    qk_norm: bool = False  # an RMSNorm over each head's queries and keys (Qwen 3)

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2"


QWEN2 = GptShape("qwen2")
LLAMA = GptShape("llama", groups=1)
MIXTRAL = GptShape("mixtral", experts=4)


def stage_layer_offset(shape: GptShape, pp: int, pp_rank: int) -> int:
    """The global index of pipeline stage ``pp_rank``'s first layer (an even split)."""
    assert shape.layers % pp == 0, f"{shape.layers} layers do not split over {pp} stages"
    return pp_rank * (shape.layers // pp)


def build_gpt(shape: GptShape, tp: int, seed: int, pp: int = 1, ep: int = 1) -> nn.Module:
    """This rank's megatron-core ``GPTModel`` of ``shape``: its pipeline stage (of ``pp``),
    tensor-parallel shard (of ``tp``) and experts (of ``ep`` expert-parallel ranks).

    ``torch.distributed`` must be initialized (gloo) over ``tp * pp * data-parallel`` ranks;
    megatron-core's parallel state is (re)made for these sizes.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.transformer_config import TransformerConfig

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    moe = {}
    if shape.experts:
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
        moe = dict(num_moe_experts=shape.experts, moe_ffn_hidden_size=shape.expert_ffn,
                   moe_router_topk=shape.topk, moe_token_dispatcher_type="allgather",
                   moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    config = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.groups, ffn_hidden_size=shape.ffn,
        gated_linear_unit=True, activation_func=nn.functional.silu, normalization="RMSNorm",
        layernorm_epsilon=shape.eps, add_bias_linear=False, add_qkv_bias=shape.qkv_bias,
        params_dtype=torch.float32, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        expert_model_parallel_size=ep,
        hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, qk_layernorm=shape.qk_norm, **moe,
    )
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=shape.experts or None, qk_layernorm=shape.qk_norm,
            normalization="RMSNorm"),
        vocab_size=shape.vocab, max_sequence_length=64, position_embedding_type="rope",
        rotary_base=int(shape.rope_base), share_embeddings_and_output_weights=False,
        parallel_output=False, pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    layer_offset = stage_layer_offset(shape, pp, ps.get_pipeline_model_parallel_rank())
    expert_offset = ps.get_expert_model_parallel_rank() * (shape.experts // ep)
    _refill(model, seed, ps.get_tensor_model_parallel_rank(), layer_offset, expert_offset)
    return model.eval()


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _global_name(name: str, layer_offset: int, expert_offset: int) -> str:
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)
    return _EXPERT.sub(lambda m: f".local_experts.{int(m.group(1)) + expert_offset}.", name)


def _refill(model: nn.Module, seed: int, tp_rank: int, layer_offset: int,
            expert_offset: int) -> None:
    """Every parameter from a generator seeded by its global name (and its TP rank where
    sharded)."""
    with torch.no_grad():
        for local_name, p in model.named_parameters():
            name = _global_name(local_name, layer_offset, expert_offset)
            sharded = getattr(p, "tensor_model_parallel", False)
            g = torch.Generator().manual_seed(
                seed * 1_000_003 + zlib.crc32(name.encode()) + (7919 * tp_rank if sharded else 0))
            values = torch.randn(p.shape, generator=g, dtype=p.dtype)
            p.copy_(1.0 + 0.1 * values if "layernorm" in name else 0.1 * values)


def megatron_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """megatron-core's own forward: ``[batch, seq, vocab]`` logits, gathered over TP."""
    seq = tokens.shape[1]
    positions = torch.arange(seq).expand_as(tokens)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad(), mock.patch("torch.cuda.current_device", return_value="cpu"):
        return model(tokens, positions, attention_mask=causal)


def megatron_pp_logits(model: nn.Module, tokens: torch.Tensor, hidden: int) -> torch.Tensor:
    """megatron-core's forward through every pipeline stage (``hidden`` wide), stage by
    stage over point-to-point sends; the last stage's logits on every stage."""
    from megatron.core import parallel_state as ps

    dist = torch.distributed
    if not ps.is_pipeline_first_stage():
        h = torch.empty(tokens.shape[1], tokens.shape[0], hidden)  # [seq, batch, hidden]
        dist.recv(h, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(h)
    out = megatron_logits(model, tokens)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        out = torch.empty(*tokens.shape, model.vocab_size)
    dist.broadcast(out, src=ps.get_pipeline_model_parallel_last_rank(),
                   group=ps.get_pipeline_model_parallel_group())
    return out


def hf_model(shape: GptShape, seed: int) -> nn.Module:
    """The ``transformers`` model of ``shape`` (Qwen2, Llama or Mixtral ForCausalLM), float32,
    with random weights of its own (``seed``) until a refit fills it."""
    import transformers

    common = dict(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.groups, rms_norm_eps=shape.eps, tie_word_embeddings=False,
        max_position_embeddings=64, rope_theta=shape.rope_base,
    )
    if shape.family == "qwen2":
        cls, config = transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**common)
    elif shape.family == "mixtral":
        cls = transformers.MixtralForCausalLM
        config = transformers.MixtralConfig(
            **{**common, "intermediate_size": shape.expert_ffn}, num_local_experts=shape.experts,
            num_experts_per_tok=shape.topk)
    else:
        cls = transformers.LlamaForCausalLM
        config = transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return cls(config).float().eval()


def hf_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits
