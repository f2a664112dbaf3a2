"""torchtitan trainers refit into Hugging Face models and a vLLM-style engine:
``tr.maps.torchtitan_to_hf`` and ``torchtitan_to_vllm``, checked against torchtitan's
own converter.

The trainers are real torchtitan models built with torchtitan's own config builders
(2 layers, float32, CPU): Llama 3 with the fused ``qkv_linear.wqkv`` and with the
unfused ``qkv_linear.wq/wk/wv`` (grouped-query attention), Qwen 3 (q/k norms),
Qwen 3 MoE (stacked experts, router) and DeepSeek V3 (multi-head latent attention
with and without q LoRA, a dense and a MoE layer, shared experts, ``expert_bias_E``,
grouped routing).

The oracle is torchtitan's ``state_dict_adapter.to_hf(model.state_dict())``, its
per-expert tensors stacked as ``transformers`` 5 holds them (``torch.stack`` /
``torch.cat`` here). It is fair: loaded with ``load_state_dict(strict=True)`` into
the ``transformers`` model its logits equal torchtitan's forward, and with two
layers swapped they do not.

In one spawned world of 2 gloo ranks (one process pair for every case):

* whole: each rank refits whole trainers into whole ``transformers`` models over a
  group of its own (the models split between the two ranks); every destination
  tensor equals the oracle bit for bit (same dtype), and the model's logits equal
  torchtitan's forward on the same tokens (FlexAttention compiled on CPU; the
  grouped experts, which torchtitan computes in bfloat16, run in float32 here);
* FSDP2 (``fully_shard`` per block and root) over both ranks into whole
  ``transformers`` models on each rank, every tensor equal to the oracle;
* trainers sharded by torchtitan's own ``parallelize_*`` functions (its sharding
  configs set, the ``partial_dtensor`` backend: with the default ``spmd_types``
  torch 2.13's ``fully_shard`` rejects the annotated plain tensors): Llama 3 with FSDP2 + TP2 (the fused ``wqkv`` split by rows across
  ranks), Qwen 3 MoE and DeepSeek V3 with FSDP2 + EP2 (experts split across ranks),
  into whole ``transformers`` models, every tensor equal to the oracle;
* trainers sharded by the default ``spmd_types`` backend (``model.parallelize``, the
  step before ``fully_shard``): Llama 3 TP2 and Qwen 3 MoE EP2, plain local shards
  annotated with their cut, read by the ``spmd_annotated`` layout: every tensor equal
  to the oracle and to ``to_hf`` of the tensors torchtitan's own
  ``plain_tensor_to_dtensor_state_dict`` gathers; the same trainer parallelized on the
  meta device and ``to_empty()``-ed (annotations dropped) is refused with the same
  ``LayoutError`` on every rank, the destination untouched;
* FSDP2 into a vLLM-style TP2 engine (``vllm_tp_layout`` over plain modules) through
  ``torchtitan_to_vllm``, every shard equal to the oracle's;
* a trainer whose modules are named another way: every rank raises the same
  ``PlanError`` naming the names the map expected and those the trainer holds, the
  destination untouched; the name added to ``HF_FROM_TORCHTITAN``, the refit is exact.
* pipeline-parallel trainers split by torchtitan's own ``pipeline_llm`` (stage modules
  keep the whole model's names; other stages' modules removed or None), Llama 3 and
  Qwen 3 MoE with PP2, one stage per rank (``1F1B``) and two (``Interleaved1F1B``, the
  rank's parts passed as a list), into whole ``transformers`` models on each rank,
  every tensor equal to the oracle; each rank refitting its stage alone raises a
  ``PlanError`` naming the absent layers and modules as a missing stage, the
  destination untouched.

In a world of 4 gloo ranks of its own: PP2 x FSDP2 (each stage ``fully_shard``-ed by
torchtitan's ``parallelize_*`` over its 2 ``dp_shard`` ranks), every tensor exact.

In the test process: maps built from torchtitan's config objects equal those built
from the ``transformers`` configs, and ``Compose`` over parts of intermediate
tensors raises a ``PlanError`` saying how to adapt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import torchrefit as tr
from torchrefit.layout.vllm_tp import vllm_tp_layout
from torchrefit.testing import run_world

transformers = pytest.importorskip("transformers")
try:
    from torchtitan.models import deepseek_v3 as tt_deepseek
    from torchtitan.models import llama3 as tt_llama
    from torchtitan.models import qwen3 as tt_qwen
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
except Exception as e:  # torchtitan, or one of its imports (spmd_types, triton), is absent
    pytest.skip(f"torchtitan is not importable: {type(e).__name__}: {e}", allow_module_level=True)

WORLD = 2
SEED, DST_SEED = 1, 2
VOCAB, DIM, LAYERS, HEADS, KV, HEAD_DIM = 128, 64, 2, 4, 2, 16
EXPERTS, TOP_K, EXPERT_FF = 4, 2, 32
TOKENS = torch.tensor([[3, 17, 42, 5, 88, 1, 60, 33, 101, 7, 64, 90, 12, 127, 0, 55]])
VOCAB_PAD = 136  # the vLLM-style engine pads its vocabulary


@dataclass(frozen=True)
class Case:
    id: str
    family: str  # "llama3" | "qwen3" | "qwen3_moe" | "deepseek_v3"
    fused: bool = True
    q_lora_rank: int = 0  # DeepSeek V3: q through wq_a / q_norm / wq_b


CASES = [Case("llama3-fused", "llama3"), Case("llama3-unfused", "llama3", fused=False),
         Case("qwen3", "qwen3"), Case("qwen3-moe", "qwen3_moe"),
         Case("deepseek-v3", "deepseek_v3"), Case("deepseek-v3-q-lora", "deepseek_v3", q_lora_rank=24)]
VLLM_CASES = ["llama3-fused", "qwen3-moe"]
# torchtitan's own parallelize functions: (kind, case index, (TP, EP) degrees)
PARALLEL = [("fsdp2-tp2", 0, (2, 1)), ("fsdp2-ep2", 3, (1, 2)), ("fsdp2-ep2", 5, (1, 2))]
WANT_SHARDED = {"fsdp2-tp2": "layers.0.attention.qkv_linear.wqkv.weight",
                "fsdp2-ep2": "layers.1.moe.routed_experts.inner_experts.w1_EFD"}


# ------------------------------------------------------------- the two models
def titan_config(case: Case):
    """torchtitan's model config, from torchtitan's own builders."""
    if case.family == "llama3":
        rope = ComplexRoPE.Config(dim=HEAD_DIM, max_seq_len=64, theta=500000.0)
        return tt_llama.Llama3Model.Config(
            dim=DIM, vocab_size=VOCAB,
            tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                            param_init=tt_llama._EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=DIM, param_init=tt_llama._NORM_INIT),
            lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                                  param_init=tt_llama._output_linear_init(DIM)),
            layers=tt_llama._build_llama3_layers(
                n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV, hidden_dim=96,
                rope=rope, fuse_qkv=case.fused, attn_backend="flex"))
    if case.family in ("qwen3", "qwen3_moe"):
        rope = CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=64, theta=1000000.0)
        common = dict(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV, head_dim=HEAD_DIM,
                      fuse_qkv=case.fused, attn_backend="flex", rope=rope)
        if case.family == "qwen3":
            layers = tt_qwen._build_qwen3_layers(hidden_dim=96, **common)
        else:
            layers = tt_qwen._build_qwen3_moe_layers(
                moe_hidden_dim=EXPERT_FF, num_experts=EXPERTS, top_k=TOP_K,
                moe_comm_backend="standard", **common)
        return tt_qwen.Qwen3Model.Config(
            vocab_size=VOCAB, dim=DIM, norm=tt_qwen._qwen3_norm(DIM),
            tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                            param_init=tt_qwen._EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                                  param_init=tt_qwen._LINEAR_INIT),
            layers=layers)
    layers = tt_deepseek._build_dsv3_layers(
        n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=case.q_lora_rank,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mscale=1.0,
        dense_hidden_dim=96, moe_hidden_dim=EXPERT_FF, num_experts=EXPERTS,
        num_shared_experts=1, router_top_k=TOP_K, router_score_func="sigmoid",
        router_num_expert_groups=2, router_num_limited_groups=1, router_route_norm=True,
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=64, theta=10000.0))
    return tt_deepseek.DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init=tt_deepseek._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=tt_deepseek._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init=tt_deepseek._LINEAR_INIT),
        layers=layers, mtp_layers=[])


def hf_config(case: Case):
    """The ``transformers`` config of the same model."""
    T = transformers
    common = dict(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, tie_word_embeddings=False)
    if case.family == "llama3":
        return T.LlamaConfig(intermediate_size=96, num_key_value_heads=KV, head_dim=HEAD_DIM,
                             rms_norm_eps=1e-5, rope_theta=500000.0, **common)
    if case.family == "qwen3":
        return T.Qwen3Config(intermediate_size=96, num_key_value_heads=KV, head_dim=HEAD_DIM,
                             rms_norm_eps=1e-6, rope_theta=1000000.0, **common)
    if case.family == "qwen3_moe":
        return T.Qwen3MoeConfig(intermediate_size=96, num_key_value_heads=KV, head_dim=HEAD_DIM,
                                rms_norm_eps=1e-6, rope_theta=1000000.0,
                                moe_intermediate_size=EXPERT_FF, num_experts=EXPERTS,
                                num_experts_per_tok=TOP_K, norm_topk_prob=True,
                                decoder_sparse_step=1, **common)
    return T.DeepseekV3Config(
        intermediate_size=96, num_key_value_heads=HEADS, rms_norm_eps=1e-5,
        moe_intermediate_size=EXPERT_FF, n_routed_experts=EXPERTS, n_shared_experts=1,
        num_experts_per_tok=TOP_K, n_group=2, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=1.0, first_k_dense_replace=1, q_lora_rank=case.q_lora_rank or None,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        rope_theta=10000.0, **common)


def adapter(case: Case, config):
    cls = {"llama3": tt_llama.Llama3StateDictAdapter, "qwen3": tt_qwen.Qwen3StateDictAdapter,
           "qwen3_moe": tt_qwen.Qwen3StateDictAdapter,
           "deepseek_v3": tt_deepseek.DeepSeekV3StateDictAdapter}[case.family]
    return cls(config, None)


def titan_model(case: Case, config):
    """The trainer: torchtitan's init, then every tensor drawn at random (norms and
    DeepSeek's expert bias too, so a misplaced one shows)."""
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        # the module's own tensors: state_dict() holds copies of a fused wqkv's rows
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("norm.weight"):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=gen))
            elif name.endswith("expert_bias_E"):  # Qwen 3 MoE's HF model has none: keep zeros
                if case.family == "deepseek_v3":
                    t.copy_(0.05 * torch.randn(t.shape, generator=gen))
            elif not name.endswith("rope.cache"):
                t.copy_(0.15 * torch.randn(t.shape, generator=gen))
    return model


def oracle(case: Case, config, model) -> dict[str, torch.Tensor]:
    """torchtitan's converter output, per-expert tensors stacked as transformers 5 does."""
    hf = {n: t.detach().clone() for n, t in adapter(case, config).to_hf(model.state_dict()).items()}
    out = {n: t for n, t in hf.items() if not re.search(r"\.experts\.\d+\.", n)}
    for i in range(LAYERS):
        p = f"model.layers.{i}.mlp.experts."
        if f"{p}0.gate_proj.weight" in hf:
            out[p + "gate_up_proj"] = torch.stack([torch.cat(
                [hf[f"{p}{e}.gate_proj.weight"], hf[f"{p}{e}.up_proj.weight"]]) for e in range(EXPERTS)])
            out[p + "down_proj"] = torch.stack([hf[f"{p}{e}.down_proj.weight"] for e in range(EXPERTS)])
    return out


def hf_model(case: Case, seed: int):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(
        hf_config(case), attn_implementation="eager").eval()


def _experts_in_float32(self, x, num_tokens_per_expert):
    """torchtitan's grouped experts, one expert at a time in the input's dtype (its own
    forward computes in bfloat16)."""
    out, start = [], 0
    for e, n in enumerate(num_tokens_per_expert.tolist()):
        h = x[start:start + n]
        start += n
        out.append((torch.nn.functional.silu(h @ self.w1_EFD[e].T) * (h @ self.w3_EFD[e].T))
                   @ self.w2_EDF[e].T)
    return torch.cat(out)


def titan_logits(model) -> torch.Tensor:
    from torchtitan.models.common.moe import GroupedExperts

    GroupedExperts.forward = _experts_in_float32
    positions = torch.arange(TOKENS.shape[1]).unsqueeze(0)
    with torch.no_grad():
        return model(TOKENS, positions, model.get_attention_masks(positions))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def _swap_layers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layers 0 and 1 exchanged where they hold the same tensor (DeepSeek's dense layer 0
    and MoE layer 1 share only attention and norms)."""
    out = dict(sd)
    for n, t in sd.items():
        other = re.sub(r"^model\.layers\.([01])\.", lambda m: f"model.layers.{1 - int(m[1])}.", n)
        if other != n and other in sd and sd[other].shape == t.shape:
            out[other] = t
    return out


def _differing(dst, want: dict[str, torch.Tensor]) -> list[str]:
    got = dst.state_dict()
    assert set(got) == set(want), set(got) ^ set(want)
    return [n for n, t in want.items() if got[n].dtype != t.dtype or not torch.equal(got[n], t)]


# ------------------------------------------------------------ one rank's runs
def _run_whole(case: Case, group) -> dict:
    config = titan_config(case)
    src = titan_model(case, config)
    want = oracle(case, config, src)
    ref = hf_model(case, DST_SEED)
    ref.load_state_dict(want, strict=True)
    swapped = hf_model(case, DST_SEED)
    swapped.load_state_dict(_swap_layers(want), strict=True)
    dst = hf_model(case, DST_SEED)
    titan = titan_logits(src)
    before = logits(dst)
    r = tr.Refitter(src, dst, group=group, name_map=tr.maps.torchtitan_to_hf(config))
    r.refit()
    got = logits(dst)
    return {"wrong": _differing(dst, want), "n": len(want),
            "err": float((got - titan).abs().max()), "before": float((before - titan).abs().max()),
            "oracle_err": float((logits(ref) - titan).abs().max()),
            "swapped_err": float((logits(swapped) - titan).abs().max())}


def _fsdp2(case: Case, config):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = titan_model(case, config)
    want = oracle(case, config, model)
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh), want


def _titan_parallel(case: Case, config, tp: int, ep: int):
    """The trainer as torchtitan's own ``parallelize_*`` function shards it (FSDP2 with
    TP or EP over both ranks), built on the meta device as torchtitan's trainer builds
    it, then filled with the whole trainer's tensors."""
    import tempfile

    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims

    whole = titan_model(case, config)
    want = oracle(case, config, whole)
    parallel_dims_module.device_type = "cpu"  # torchtitan asks for CUDA where it finds no GPU
    # spmd_types, the default, stops in fully_shard on torch 2.13 (docs/torchtitan.md)
    backend = "partial_dtensor"
    dims = ParallelDims(dp_replicate=1, dp_shard=WORLD // tp, cp=1, tp=tp, pp=1, ep=ep,
                        world_size=WORLD, spmd_backend=backend)
    dims.build_mesh()
    config = titan_config(case)  # the sharding setters below write into the config
    if case.family == "llama3":
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config
        set_llama3_sharding_config(config, enable_sp=False)
        parallelize = tt_llama.parallelize_llama
    elif case.family == "qwen3_moe":
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
        set_qwen3_sharding_config(config, enable_sp=False, enable_ep=ep > 1)
        parallelize = tt_qwen.parallelize_qwen3
    else:
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
        set_deepseek_v3_sharding_config(config, enable_sp=False, enable_ep=ep > 1)
        parallelize = tt_deepseek.parallelize_deepseekv3
    with torch.device("meta"):
        model = config.build()
    model = parallelize(
        model, parallel_dims=dims, training=TrainingConfig(),
        parallelism=ParallelismConfig(tensor_parallel_degree=tp, expert_parallel_degree=ep,
                                      spmd_backend=backend),
        compile_config=CompileConfig(), ac_config=None, dump_folder=tempfile.gettempdir())
    model.to_empty(device="cpu")
    full = dict([*whole.named_parameters(), *whole.named_buffers()])
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            value = full[name]
            if isinstance(t, DTensor):
                value = distribute_tensor(value, t.device_mesh, t.placements)
            t.copy_(value)
    placements = {n: str(getattr(t, "placements", "")) for n, t in model.named_parameters()}
    return model, want, placements


PP_CASES = [0, 3]  # Llama 3 (fused wqkv) and Qwen 3 MoE
# torchtitan's schedules: one stage per rank, and two (the rank's model parts as a list)
PP_SCHEDULES = {"1F1B": 1, "Interleaved1F1B": 2}


def _titan_pp(case: Case, schedule: str, dp_shard: int = 1):
    """The trainer as torchtitan's trainer builds it with pipeline parallelism: on the
    meta device, split by torchtitan's own ``pipeline_llm`` (its stage FQNs, its
    ``parallelize_*`` applied to each part: FSDP2 over ``dp_shard`` ranks of a stage,
    the ``partial_dtensor`` backend as above), ``to_empty``, then filled with the
    whole trainer's tensors. Returns this rank's model parts (the schedule is built
    but never run)."""
    import tempfile

    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    whole = titan_model(case, titan_config(case))
    parallel_dims_module.device_type = "cpu"
    backend, pp = "partial_dtensor", 2
    dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=1, pp=pp, ep=1,
                        world_size=pp * dp_shard, spmd_backend=backend)
    dims.build_mesh()
    config = _sharded_config(case, ep=1)
    parallelize = {"llama3": tt_llama.parallelize_llama,
                   "qwen3_moe": tt_qwen.parallelize_qwen3}[case.family]
    with torch.device("meta"):
        model = config.build()
    compile_config = CompileConfig()
    _, parts, _, _ = pipeline_llm(
        model, parallel_dims=dims, training=TrainingConfig(),
        parallelism=ParallelismConfig(pipeline_parallel_degree=pp, spmd_backend=backend,
                                      pipeline_parallel_schedule=schedule),
        compile_config=compile_config, ac_config=None, dump_folder=tempfile.gettempdir(),
        device=torch.device("cpu"), model_config=config, parallelize_fn=parallelize,
        loss_fn=CrossEntropyLoss.Config().build(compile_config=compile_config))
    full = dict([*whole.named_parameters(), *whole.named_buffers()])
    with torch.no_grad():
        for part in parts:
            part.to_empty(device="cpu")
            part.init_weights(buffer_device=None)
            for name, t in [*part.named_parameters(), *part.named_buffers()]:
                value = full[name]
                if isinstance(t, DTensor):
                    value = distribute_tensor(value, t.device_mesh, t.placements)
                t.copy_(value)
    return parts


def _stage_of(parts) -> list[str]:
    """The modules this rank's stages hold: top-level ones and layers."""
    return sorted({n.split(".")[0] if not n.startswith("layers.") else ".".join(n.split(".")[:2])
                   for part in parts for n, _ in part.named_parameters()})


def _run_pp(case: Case, schedule: str, dp_shard: int = 1) -> dict:
    """A pipeline-parallel trainer (each rank its stages) into a whole ``transformers``
    model on every rank."""
    parts = _titan_pp(case, schedule, dp_shard)
    config = titan_config(case)
    want = oracle(case, config, titan_model(case, config))
    dst = hf_model(case, DST_SEED)
    r = tr.Refitter(parts if len(parts) > 1 else parts[0], dst,
                    name_map=tr.maps.torchtitan_to_hf(config))
    r.refit()
    r.verify()
    sharded = [n for part in parts for n, t in part.named_parameters()
               if "Shard(dim=0)" in str(getattr(t, "placements", ""))
               and t.device_mesh.size() == dp_shard]
    return {"wrong": _differing(dst, want), "parts": len(parts), "stage": _stage_of(parts),
            "remote": r.plan.bytes_sent + r.plan.bytes_received, "fsdp_sharded": len(sharded)}


def _run_pp_one_stage(case: Case, group) -> dict:
    """Each rank refits only its own stage (a group of one rank): the other stage's
    modules are on no source rank."""
    parts = _titan_pp(case, "1F1B")
    dst = hf_model(case, DST_SEED)
    before = {n: t.clone() for n, t in dst.state_dict().items()}
    try:
        tr.Refitter(parts[0], dst, group=group,
                    name_map=tr.maps.torchtitan_to_hf(titan_config(case)))
    except tr.PlanError as e:
        return {"raised": str(e), "detail": e.detail, "rule": e.rule,
                "unchanged": all(torch.equal(t, before[n]) for n, t in dst.state_dict().items())}
    return {"raised": None}


def _spmd_dims(tp: int, ep: int):
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.distributed import ParallelDims

    parallel_dims_module.device_type = "cpu"
    dist_utils.set_spmd_backend("spmd_types")  # as torchtitan's trainer does
    dims = ParallelDims(dp_replicate=1, dp_shard=WORLD // tp, cp=1, tp=tp, pp=1, ep=ep,
                        world_size=WORLD, spmd_backend="spmd_types")
    dims.build_mesh()
    return dims


def _sharded_config(case: Case, ep: int):
    config = titan_config(case)
    if case.family == "llama3":
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config
        set_llama3_sharding_config(config, enable_sp=False)
    else:
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
        set_qwen3_sharding_config(config, enable_sp=False, enable_ep=ep > 1)
    return config


def _titan_spmd(case: Case, tp: int, ep: int):
    """The trainer as torchtitan's default ``spmd_types`` backend shards it: the first
    step of its ``parallelize_*`` functions (``validate_config``, ``model.parallelize``),
    run on a model built on the CPU (the next step, ``fully_shard`` over the annotated
    tensors, needs a torch that translates them: see docs/torchtitan.md). Its tensors
    are plain local shards carrying ``spmd_types`` annotations."""
    from torchtitan.distributed.full_dtensor import validate_config

    whole_config = titan_config(case)
    whole = titan_model(case, whole_config)
    want = oracle(case, whole_config, whole)
    dims = _spmd_dims(tp, ep)
    model = titan_model(case, _sharded_config(case, ep))  # the same draws as ``whole``
    validate_config(dims, model)
    model.parallelize(dims)
    return model, dims, want


def _gathered_by_torchtitan(case: Case, model, dims) -> dict[str, torch.Tensor]:
    """``to_hf`` of the trainer's tensors gathered as torchtitan's RL weight sync reads
    them: each local tensor wrapped as a DTensor by its declared layout
    (``plain_tensor_to_dtensor_state_dict``), then ``full_tensor()``."""
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed.spmd_types import plain_tensor_to_dtensor_state_dict

    layouts = {f"{prefix}.{n}" if prefix else n: layout for prefix, m in model.named_modules()
               for n, layout in getattr(getattr(m, "_sharding_config", None), "state_shardings",
                                        {}).items()}
    local = {n: t.detach() for n, t in model.named_parameters()}
    wrapped = plain_tensor_to_dtensor_state_dict(local, state_dict_layouts=layouts,
                                                 parallel_dims=dims)
    config = titan_config(case)
    whole = titan_model(case, config)
    with torch.no_grad():
        for n, t in whole.named_parameters():
            w = wrapped[n]
            t.copy_(w.full_tensor() if isinstance(w, DTensor) else w)
    return oracle(case, config, whole)


def _run_spmd(case: Case, tp: int, ep: int, sharded: str) -> dict:
    from spmd_types.runtime import get_local_type, get_partition_spec

    model, dims, want = _titan_spmd(case, tp, ep)
    t = dict(model.named_parameters())[sharded]
    annotation = f"{type(t).__name__} {list(t.shape)} {get_local_type(t)} {get_partition_spec(t)}"
    gathered = _gathered_by_torchtitan(case, model, dims)
    dst = hf_model(case, DST_SEED)
    r = tr.Refitter(model, dst, name_map=tr.maps.torchtitan_to_hf(titan_config(case)))
    r.refit()
    return {"wrong": _differing(dst, want), "gathered_wrong": _differing(dst, gathered),
            "kind": r._kinds[0], "annotation": annotation,
            "remote": r.plan.bytes_sent + r.plan.bytes_received}


def _run_spmd_lost(case: Case, ep: int) -> dict:
    """``Module.parallelize`` on the meta device, then ``to_empty()``: the parameters'
    annotations are gone."""
    from torchtitan.distributed.full_dtensor import validate_config

    dims = _spmd_dims(1, ep)
    with torch.device("meta"):
        model = _sharded_config(case, ep).build()
    validate_config(dims, model)
    model.parallelize(dims)
    model.to_empty(device="cpu")
    dst = hf_model(case, DST_SEED)
    before = {n: t.clone() for n, t in dst.state_dict().items()}
    try:
        tr.Refitter(model, dst, name_map=tr.maps.torchtitan_to_hf(titan_config(case)))
    except tr.RefitError as e:
        return {"raised": f"{type(e).__name__}: {e}",
                "unchanged": all(torch.equal(t, before[n]) for n, t in dst.state_dict().items())}
    return {"raised": None}


def _run_fsdp2(case: Case, parallel: tuple[int, int] | None = None) -> dict:
    """FSDP2 alone (``fully_shard`` per block and root), or torchtitan's parallelize
    function with ``parallel`` = (TP, EP) degrees."""
    config = titan_config(case)
    placements = {}
    if parallel is None:
        src, want = _fsdp2(case, config)
    else:
        src, want, placements = _titan_parallel(case, config, *parallel)
    dst = hf_model(case, DST_SEED)
    r = tr.Refitter(src, dst, name_map=tr.maps.torchtitan_to_hf(config))
    r.refit()
    r.verify()
    return {"wrong": _differing(dst, want), "n": len(want), "placements": placements,
            "remote": r.plan.bytes_sent + r.plan.bytes_received}


def _run_vllm(case: Case, rank: int) -> dict:
    from test_maps_engines import _vllm_engine, vllm_reference
    from test_maps_hf import _module

    config = titan_config(case)
    src, want_hf = _fsdp2(case, config)
    want_full = vllm_reference(want_hf, VOCAB_PAD)
    gen = torch.Generator().manual_seed(DST_SEED)
    start = {n: torch.randn(t.shape, generator=gen) for n, t in want_full.items()}
    spec = _Spec(HEADS, KV)
    dst = _module(_vllm_engine(start, rank, spec))
    want = _vllm_engine({n: torch.where(t.isnan(), start[n], t) for n, t in want_full.items()},
                        rank, spec)
    r = tr.Refitter(src, dst, name_map=tr.maps.torchtitan_to_vllm(config),
                    dst_layout=vllm_tp_layout(rank, WORLD, num_heads=HEADS, num_kv_heads=KV))
    r.refit()
    wrong = [n for n, p in dst.named_parameters() if not torch.equal(p.detach(), want[n])]
    return {"wrong": wrong, "n": len(want), "names": sorted(want)}


@dataclass(frozen=True)
class _Spec:  # what _vllm_engine reads of a model's geometry
    heads: int
    groups: int


def _run_renamed(case: Case) -> dict:
    """The fused projection moved to ``attention.qkv`` (a later torchtitan's name, say)."""
    config = titan_config(case)
    src, want = _fsdp2(case, config)
    for block in src.layers.values():
        block.attention.qkv = block.attention.qkv_linear
        del block.attention.qkv_linear
    dst = hf_model(case, DST_SEED)
    before = {n: t.clone() for n, t in dst.state_dict().items()}
    out: dict = {"raised": None}
    try:
        tr.Refitter(src, dst, name_map=tr.maps.torchtitan_to_hf(config))
    except tr.PlanError as e:
        out = {"raised": str(e), "rule": e.rule, "tensor": e.tensor,
               "unchanged": all(torch.equal(t, before[n]) for n, t in dst.state_dict().items())}
    q = "model.layers.{}.self_attn.{}_proj.weight"
    table = tr.maps.HF_FROM_TORCHTITAN
    saved = {x: table[q.format("{}", x)] for x in "qkv"}
    try:  # the rename as a table edit
        for x, (rule, names) in saved.items():
            table[q.format("{}", x)] = (rule, names + ("layers.{}.attention.qkv.wqkv.weight",))
        r = tr.Refitter(src, dst, name_map=tr.maps.torchtitan_to_hf(config))
        r.refit()
        out["wrong_after_edit"] = _differing(dst, want)
    finally:
        table.update({q.format("{}", x): v for x, v in saved.items()})
    return out


def _world(rank: int, world: int) -> dict[str, dict]:
    torch.set_num_threads(1)
    out: dict[str, dict] = {}
    own = [dist.new_group([r]) for r in range(world)]  # a one-rank group per rank
    runs = [(f"whole/{c.id}", lambda c=c: _run_whole(c, own[rank]))
            for i, c in enumerate(CASES) if i % world == rank]
    runs += [(f"fsdp2/{c.id}", lambda c=c: _run_fsdp2(c)) for c in CASES]
    runs += [(f"{kind}/{CASES[i].id}", lambda i=i, p=p: _run_fsdp2(CASES[i], parallel=p))
             for kind, i, p in PARALLEL]
    runs += [(f"vllm/{c.id}", lambda c=c: _run_vllm(c, rank))
             for c in CASES if c.id in VLLM_CASES]
    runs += [("renamed", lambda: _run_renamed(CASES[0]))]
    runs += [(f"spmd/{CASES[i].id}", lambda i=i, p=p, w=WANT_SHARDED[kind]: _run_spmd(CASES[i], *p, w))
             for kind, i, p in PARALLEL[:2]]
    runs += [("spmd-lost", lambda: _run_spmd_lost(CASES[3], 2))]
    runs += [(f"pp2-{sched}/{CASES[i].id}", lambda i=i, s=sched: _run_pp(CASES[i], s))
             for i in PP_CASES for sched in PP_SCHEDULES]
    runs += [("pp2-one-stage", lambda: _run_pp_one_stage(CASES[0], own[rank]))]
    for key, run in runs:
        try:
            out[key] = run()
        except Exception as e:  # recorded per case; the next case still runs on every rank
            import traceback
            out[key] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        if not key.startswith("whole/"):
            dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict]]:
    return run_world(_world, WORLD, timeout=600, pg_timeout=300)


def _pp_fsdp_world(rank: int, world: int) -> dict[str, dict]:
    torch.set_num_threads(1)
    out: dict[str, dict] = {}
    for i in PP_CASES:
        try:
            out[f"pp2-fsdp2/{CASES[i].id}"] = _run_pp(CASES[i], "1F1B", dp_shard=world // 2)
        except Exception as e:  # recorded per case; the next case still runs on every rank
            import traceback
            out[f"pp2-fsdp2/{CASES[i].id}"] = {"error": f"{type(e).__name__}: {e}\n"
                                                        f"{traceback.format_exc()}"}
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def pp_fsdp_results() -> list[dict[str, dict]]:
    """A world of its own: PP2 x FSDP2 needs 4 ranks."""
    return run_world(_pp_fsdp_world, 2 * WORLD, timeout=600, pg_timeout=300)


def _one(results, key: str) -> list[tuple[int, dict]]:
    got = [(rank, r[key]) for rank, r in enumerate(results) if key in r]
    assert got, f"{key}: no rank ran it"
    for rank, g in got:
        assert "error" not in g, f"rank {rank}: {g['error']}"
    return got


# -------------------------------------------------------------------- the tests
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_whole_trainer_refits_exactly_as_torchtitans_converter(case: Case, results) -> None:
    for rank, got in _one(results, f"whole/{case.id}"):
        assert got["wrong"] == [], f"rank {rank}: differ from to_hf: {got['wrong']}"
        assert got["oracle_err"] < 5e-5, f"the oracle's own logits differ by {got['oracle_err']}"
        assert got["swapped_err"] > 1e-2, "two swapped layers give the same logits: unfair oracle"
        assert got["before"] > 1e-2, "logits equal before the refit: the test proves nothing"
        assert got["err"] < 5e-5, f"logits differ from torchtitan's by {got['err']}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fsdp2_trainer_refits_exactly(case: Case, results) -> None:
    for rank, got in _one(results, f"fsdp2/{case.id}"):
        assert got["wrong"] == [], f"rank {rank}: differ from to_hf: {got['wrong']}"
        assert got["remote"] > 0, "the refit moved nothing between ranks"


@pytest.mark.parametrize("kind,i,parallel", PARALLEL, ids=[f"{k}-{CASES[i].id}" for k, i, _ in PARALLEL])
def test_trainer_parallelized_by_torchtitan_refits_exactly(kind, i, parallel, results) -> None:
    for rank, got in _one(results, f"{kind}/{CASES[i].id}"):
        assert got["wrong"] == [], f"rank {rank}: differ from to_hf: {got['wrong']}"
        assert got["remote"] > 0, "the refit moved nothing between ranks"
        sharded = WANT_SHARDED[kind]
        # two mesh dims (FSDP and TP or EP), each splitting dim 0
        assert got["placements"].get(sharded, "").count("Shard(dim=0") == 2, (
            f"{sharded} is not sharded as {kind} shards it: {got['placements'].get(sharded)}")


@pytest.mark.parametrize("case_id", VLLM_CASES)
def test_fsdp2_trainer_refits_a_tp2_vllm_engine(case_id: str, results) -> None:
    for rank, got in _one(results, f"vllm/{case_id}"):
        assert got["wrong"] == [], f"rank {rank}: {got['wrong']}"
        assert any(n.endswith("qkv_proj.weight") for n in got["names"])
        if case_id == "qwen3-moe":
            assert any(n.endswith("experts.w13_weight") for n in got["names"])


def test_another_naming_is_named_on_every_rank_and_a_table_edit_fixes_it(results) -> None:
    got = _one(results, "renamed")
    first = got[0][1]["raised"]
    assert first is not None, "a trainer with other names refit without error"
    for rank, g in got:
        assert g["raised"] == first, f"rank {rank} raised another error: {g['raised']}"
        assert g["rule"] == "naming" and g["unchanged"], g
        assert g["wrong_after_edit"] == [], g["wrong_after_edit"]
    assert "'layers.0.attention.qkv_linear.wqkv.weight'" in first, first
    assert "the trainer holds layers.0.attention.qkv.wqkv.weight" in first, first
    assert "HF_FROM_TORCHTITAN" in first, first


@pytest.mark.parametrize("kind,i", [(k, i) for k, i, _ in PARALLEL[:2]],
                         ids=[f"{k.split('-')[1]}-{CASES[i].id}" for k, i, _ in PARALLEL[:2]])
def test_trainer_sharded_by_the_spmd_types_backend_refits_exactly(kind, i, results) -> None:
    """torchtitan's default backend: plain local shards with spmd_types annotations."""
    for rank, got in _one(results, f"spmd/{CASES[i].id}"):
        assert got["kind"] == "spmd_annotated", got["kind"]
        # the cut tensor is a plain half, annotated varying over the axis its spec names
        assert got["annotation"].startswith("Parameter ") and ": V}" in got["annotation"], got
        assert "PartitionSpec(" in got["annotation"], got["annotation"]
        assert got["wrong"] == [], f"rank {rank}: differ from to_hf: {got['wrong']}"
        assert got["gathered_wrong"] == [], f"rank {rank}: differ from torchtitan's gather"
        assert got["remote"] > 0, "the refit moved nothing between ranks"


def test_spmd_types_shards_without_annotations_are_refused_on_every_rank(results) -> None:
    got = _one(results, "spmd-lost")
    first = got[0][1]["raised"]
    assert first is not None, "shards whose annotations were dropped refit as whole tensors"
    for _, g in got:
        assert g["raised"] == first and g["unchanged"], g
    assert first.startswith("LayoutError: ") and "rank 1: " in first, first
    assert "carries no spmd_types annotation" in first, first
    assert 'spmd_backend="partial_dtensor"' in first, first


@pytest.mark.parametrize("schedule", PP_SCHEDULES)
@pytest.mark.parametrize("i", PP_CASES, ids=[CASES[i].id for i in PP_CASES])
def test_pipeline_parallel_trainer_refits_exactly(i: int, schedule: str, results) -> None:
    """torchtitan's own split: the first stage holds tok_embeddings, the last norm and
    lm_head, each its layers under their whole-model names."""
    stages = {("1F1B", 0): ["layers.0", "tok_embeddings"],
              ("1F1B", 1): ["layers.1", "lm_head", "norm"],
              ("Interleaved1F1B", 0): ["layers.1", "tok_embeddings"],
              ("Interleaved1F1B", 1): ["layers.0", "lm_head", "norm"]}
    for rank, got in _one(results, f"pp2-{schedule}/{CASES[i].id}"):
        assert got["parts"] == PP_SCHEDULES[schedule], got["parts"]
        assert got["stage"] == stages[schedule, rank], f"rank {rank} holds {got['stage']}"
        assert got["wrong"] == [], f"rank {rank}: differ from to_hf: {got['wrong']}"
        assert got["remote"] > 0, "the refit moved nothing between ranks"


@pytest.mark.parametrize("i", PP_CASES, ids=[CASES[i].id for i in PP_CASES])
def test_pipeline_parallel_fsdp2_trainer_refits_exactly(i: int, pp_fsdp_results) -> None:
    """PP2 x FSDP2 on 4 ranks: each stage fully_shard-ed over its 2 dp_shard ranks."""
    for rank, got in _one(pp_fsdp_results, f"pp2-fsdp2/{CASES[i].id}"):
        assert got["stage"][0] == ("layers.0" if rank < 2 else "layers.1"), got["stage"]
        assert got["fsdp_sharded"] > 0, f"rank {rank}: no parameter sharded over dp_shard"
        assert got["wrong"] == [], f"rank {rank}: differ from to_hf: {got['wrong']}"
        assert got["remote"] > 0, "the refit moved nothing between ranks"


def test_a_stage_refit_without_the_other_stage_names_what_is_absent(results) -> None:
    """Each rank refits its own stage alone: the other stage's tensors are on no source
    rank, which the error says (not a renamed trainer), the destination untouched."""
    got = dict(_one(results, "pp2-one-stage"))
    for rank, g in got.items():
        assert g["raised"] is not None, f"rank {rank}: half a pipeline refit without error"
        assert g["unchanged"], f"rank {rank}: the destination changed"
        assert "A pipeline-parallel trainer refits with a rank of every stage" in g["raised"], g
    # rank 0 (tok_embeddings, layers.0) lacks lm_head and norm, and layer 1
    assert got[0]["raised"].startswith("lm_head.weight: ") and got[0]["rule"] == "naming"
    assert "no 'lm_head' module (their modules: layers, tok_embeddings)" in got[0]["raised"]
    assert ("model.layers.1.self_attn.q_proj.weight: torchtitan_to_hf reads it from "
            "'layers.1.attention.qkv_linear.wq.weight' or "
            "'layers.1.attention.qkv_linear.wqkv.weight' or 'layers.1.attention.wq.weight', "
            "which no source rank holds; the source ranks hold it for layers 0 only"
            ) in got[0]["detail"], got[0]["detail"]
    # rank 1 (layers.1, norm, lm_head) lacks the embedding and layer 0
    assert got[1]["raised"].startswith("model.embed_tokens.weight: "), got[1]["raised"]
    assert "hold it for layers 1 only" in got[1]["detail"], got[1]["detail"]


# --------------------------------------------------------- in the test process
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_map_from_torchtitan_config_equals_map_from_transformers_config(case: Case) -> None:
    a = tr.maps.torchtitan_to_hf(titan_config(case))
    b = tr.maps.torchtitan_to_hf(hf_config(case))
    assert a.cache_key() == b.cache_key()
    assert a.permute_rope == (case.family == "llama3")


def test_a_tensor_the_trainer_may_lack_is_left_to_the_planner() -> None:
    """DeepSeek's expert bias exists only with load balancing: no source (``skip=``
    may allow it), where a renamed projection is a naming error."""
    m = tr.maps.torchtitan_to_hf(titan_config(CASES[4]))
    src = {"layers.1.moe.router.gate.weight": _Shape((EXPERTS, DIM))}
    assert m.segments("model.layers.1.mlp.gate.e_score_correction_bias", (EXPERTS,), src, {}) is None
    with pytest.raises(tr.PlanError, match="reads it from .layers.1.moe.router.gate.weight., which no source rank holds; the trainer holds layers.1.moe.router.weight"):
        m.segments("model.layers.1.mlp.gate.weight", (EXPERTS, DIM), {
            "layers.1.moe.router.weight": _Shape((EXPERTS, DIM))}, {})


def test_compose_over_parts_of_intermediate_tensors_says_how_to_adapt() -> None:
    config = titan_config(CASES[1])  # unfused: q_proj's rows are one region each
    inner = tr.maps.Rename({"layers.{}.attention.qkv_linear.wq.weight": "layers.{}.attention.q.weight"})
    m = tr.maps.Compose(tr.maps.torchtitan_to_hf(config), inner)
    src = {"layers.0.attention.q.weight": _Shape((HEADS * HEAD_DIM, DIM))}
    with pytest.raises(tr.PlanError, match=r"Compose\(outer, inner\) needs .* Adapt: ") as e:
        m.segments("model.layers.0.self_attn.q_proj.weight", (HEADS * HEAD_DIM, DIM), src, {})
    assert e.value.rule == "compose" and "layers.0.attention.qkv_linear.wq.weight" in str(e.value)


@dataclass(frozen=True)
class _Shape:
    shape: tuple[int, ...]
