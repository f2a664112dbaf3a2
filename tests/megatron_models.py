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

Every parameter is then refilled from a generator seeded by its name (and, for a
tensor-parallel shard, its TP rank), so norms and biases are not ones and zeros and
a tensor put in the wrong place changes the logits. Replicated tensors get the same
values on every TP rank, as megatron-core requires.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from unittest import mock

import torch
from torch import nn

__all__ = ["GptShape", "QWEN2", "LLAMA", "MIXTRAL", "build_gpt", "megatron_logits", "hf_model", "hf_logits"]


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

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2"


QWEN2 = GptShape("qwen2")
LLAMA = GptShape("llama", groups=1)
MIXTRAL = GptShape("mixtral", experts=4)


def build_gpt(shape: GptShape, tp: int, seed: int) -> nn.Module:
    """A megatron-core ``GPTModel`` of ``shape`` at tensor parallel ``tp`` on this rank.

    ``torch.distributed`` must be initialized (gloo) over ``tp`` ranks.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
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
        hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, **moe,
    )
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=shape.experts or None, normalization="RMSNorm"),
        vocab_size=shape.vocab, max_sequence_length=64, position_embedding_type="rope",
        rotary_base=int(shape.rope_base), share_embeddings_and_output_weights=False,
        parallel_output=False,
    )
    _refill(model, seed, ps.get_tensor_model_parallel_rank())
    return model.eval()


def _refill(model: nn.Module, seed: int, tp_rank: int) -> None:
    """Every parameter from a generator seeded by its name (and its TP rank where sharded)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
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
