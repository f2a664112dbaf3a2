"""megatron-core ``GPTModel``s of a benchmark's shape, when megatron-core is installed.

Local layer spec (no Transformer Engine), built on the current GPU in the
benchmark's dtype; both models live in the one parallel state megatron-core keeps,
so comparisons run where source and destination layouts are equal.
"""

from __future__ import annotations

import torch

from ..testing.toy import ModelSpec

__all__ = ["megatron_available", "build_megatron_gpt", "megatron_swap"]


def megatron_available() -> bool:
    try:
        import megatron.core.resharding.refit  # noqa: F401
    except Exception:
        return False
    return True


def build_megatron_gpt(spec: ModelSpec, tp: int = 1, pp: int = 1, seed: int = 1234, device: str = "cuda"):
    """A megatron-core ``GPTModel`` of ``spec`` on the current GPU, or on the CPU
    (``device="cpu"``: megatron-core's CPU initialization, for host-work benchmarks)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    cpu = device == "cpu"
    if cpu:
        torch.manual_seed(seed)
    else:
        model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
        num_query_groups=spec.groups, ffn_hidden_size=spec.ffn, gated_linear_unit=spec.swiglu,
        params_dtype=spec.dtype, bf16=spec.dtype == torch.bfloat16, fp16=spec.dtype == torch.float16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        # the preset's biases: megatron-core's default (add_bias_linear=True) gives every
        # linear, each expert's too, a bias Llama, Qwen3 and DeepSeek do not have (twice
        # the expert tensors of the preset)
        add_bias_linear=spec.bias,
        num_moe_experts=spec.experts or None,
        moe_ffn_hidden_size=spec.expert_ffn if spec.experts else None,
        use_cpu_initialization=cpu,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=spec.experts or None),
        vocab_size=spec.vocab, max_sequence_length=4096,
        share_embeddings_and_output_weights=spec.tie,
    )
    return model if cpu else model.cuda()


def megatron_swap(src, dst, method: str) -> None:
    from megatron.core.resharding.refit import swap_model_weights

    swap_model_weights(src, dst, refit_method=method)
