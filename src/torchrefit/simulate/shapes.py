"""The one definition of a Megatron-style GPT's global tensors: presets, shapes and
what each rank of a :class:`~torchrefit.simulate.meshes.Mesh` holds.

A :class:`ModelShape` says how big a GPT is; :func:`global_tensors` lists its global
tensors with Megatron-core's canonical names and how each is sharded
(tensor-parallel dim, stride or block-interleaved parts, expert or not, which
pipeline stage); :func:`held_tensors` says which of them a rank holds and under
which local name. The simulator (``torchrefit plan``) turns them into rosters
without allocating a tensor; the toy GPT of ``torchrefit.testing`` (tests,
``torchrefit demo``, ``torchrefit bench``) builds real parameters from the same
list, so a toy's described roster is the simulator's.

Simplifications (the planner sees the same kind of tensors, not bit-exact models):

* ``fused_norms`` False (the presets): local-spec layer norm names
  (``input_layernorm``, ``pre_mlp_layernorm``); True (the toy GPT): Transformer
  Engine's ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``
  (MoE layers keep ``pre_mlp_layernorm``, MLA keeps ``input_layernorm``);
* routed experts carry no biases; the router's ``expert_bias`` is a float32 buffer;
* DeepSeek-V3: multi-latent attention has Megatron's names and shapes, the
  down projections replicated; no multi-token-prediction layers; one shared
  expert, sharded like a dense MLP;
* Mamba layers (``mamba``): the mixer of Megatron's hybrid models (block-interleaved
  ``in_proj`` and ``conv1d``) in place of attention, with the toy's small state sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..layout.megatron import TIED_OUTPUT
from .meshes import Coords, Mesh

__all__ = ["ModelShape", "GlobalTensor", "PRESETS", "preset", "global_tensors", "stage_layers",
           "TensorIndex", "held_tensors"]


@dataclass(frozen=True)
class ModelShape:
    """The size of a Megatron-style GPT (dense, or MoE where ``experts`` > 0)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int  # dense MLP width (the first ``dense_layers`` layers of an MoE model)
    vocab: int
    swiglu: bool = True
    bias: bool = False  # linear biases (attention, dense and shared-expert MLPs)
    tie: bool = False  # output layer served from the word embedding
    position_embeddings: int = 0  # learned absolute positions (rows), 0: none (RoPE)
    experts: int = 0
    expert_ffn: int = 0
    shared_expert_ffn: int = 0  # 0: no shared expert
    dense_layers: int = 0  # MoE models: the first layers keep a dense MLP
    mla: bool = False  # DeepSeek multi-latent attention instead of GQA
    dtype: str = "bfloat16"
    norm_bias: bool = False  # layer norms with a bias (LayerNorm, GPT-2 style)
    fused_norms: bool = False  # Transformer Engine names: norms inside linear_qkv / linear_fc1
    router_bias: bool = True  # MoE routers keep an ``expert_bias`` (and a token-count buffer)
    grouped_experts: bool = False  # ``linear_fc1.weightK`` names instead of ``local_experts.K``
    mamba: bool = False  # layers hold a Mamba mixer instead of attention

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab"):
            if getattr(self, f) < 1:
                raise ValueError(f"model shape: {f} must be positive, not {getattr(self, f)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"model shape: {self.heads} heads do not divide hidden {self.hidden} "
                             f"or are not a multiple of {self.kv_heads} kv heads")
        if self.experts and self.expert_ffn < 1:
            raise ValueError("model shape: an MoE model needs expert_ffn > 0")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def with_overrides(self, **kw) -> ModelShape:
        """This shape with the fields given (None values ignored), for CLI flags."""
        names = {f.name for f in fields(self)}
        return replace(self, **{k: v for k, v in kw.items() if v is not None and k in names})


PRESETS: dict[str, ModelShape] = {
    # A GPT-3-style 4 B model as Megatron-LM's refit benchmark
    # (examples/rl/benchmark_refit.py) builds it: 245 tensors, 4.46 B parameters, untied
    # output layer, learned positions. Tied, it is the 244-tensor 4.25 B model.
    "gpt-4b": ModelShape(20, 4096, 32, 32, 16384, 50304, swiglu=False, bias=True, tie=False,
                         position_embeddings=4096, norm_bias=True),
    "llama-70b": ModelShape(80, 8192, 64, 8, 28672, 128256),
    "llama-8b": ModelShape(32, 4096, 32, 8, 14336, 128256),
    # Qwen2.5-0.5B-like: the small dense model RL recipes start from (tied, 0.49 B).
    "dense-0.5b": ModelShape(24, 896, 14, 2, 4864, 151936, tie=True),
    # Qwen3-30B-A3B-like: 128 experts of ffn 768 per layer, 6144 expert tensors in
    # all. Head dim is hidden / heads here (128 with 16 heads), so attention has
    # 16 query heads where Qwen3 has 32 of 128; the experts, which are 95% of the
    # bytes, are exact. ``ffn`` is unused (no dense layers). 48 layers come to
    # 58 GB in bf16: on one GPU, benchmarks scale layers down (``--layers``).
    "qwen3-30b-a3b": ModelShape(48, 2048, 16, 4, 6144, 151936, experts=128, expert_ffn=768),
    # DeepSeek-V3's MoE layer stack as a plain GQA GPT: hidden 7168, 256 experts of
    # ffn 2048 in every layer (its 58 MoE layers), no MLA, dense layers or shared
    # expert (what toy and megatron-core local-spec models can build): 11.5 B
    # parameters and 512 expert tensors of 29-59 MB per layer, so benchmarks on one
    # GPU take one or two layers (``--layers``).
    "deepseek-v3-moe": ModelShape(58, 7168, 128, 128, 18432, 129280, experts=256, expert_ffn=2048),
    "deepseek-v3": ModelShape(61, 7168, 128, 128, 18432, 129280, experts=256, expert_ffn=2048,
                              shared_expert_ffn=2048, dense_layers=3, mla=True),
    # Kimi-K2: DeepSeek-V3's architecture with 384 experts, 64 heads, one dense layer and
    # a 163840-token vocabulary (the 1 T model of the published 256 -> 128 GPU refit).
    "kimi-k2": ModelShape(61, 7168, 64, 64, 18432, 163840, experts=384, expert_ffn=2048,
                          shared_expert_ffn=2048, dense_layers=1, mla=True),
}


def preset(name: str) -> ModelShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; use one of {sorted(PRESETS)}") from None


@dataclass(frozen=True)
class GlobalTensor:
    """A global tensor and how Megatron-core shards it.

    ``group`` is ``"tp"`` (dense tensor parallel), ``"etp"`` (expert tensor
    parallel) or ``"rep"`` (replicated); ``parts`` are the global sizes of the
    block-interleaved components each rank holds a share of (Mamba's ``in_proj``);
    ``layer`` and ``expert`` are global indices; ``stage`` is ``"first"`` /
    ``"last"`` for tensors of one pipeline end. Non-persistent buffers are held but
    never refitted.
    """

    name: str
    shape: tuple[int, ...]
    group: str = "rep"
    dim: int = 0
    stride: int = 1
    layer: int | None = None
    expert: int | None = None
    stage: str | None = None
    dtype: str | None = None  # None: the model's dtype
    buffer: bool = False
    parts: tuple[int, ...] | None = None
    persistent: bool = True


# MLA sizes of DeepSeek-V3 (q_lora_rank, kv_lora_rank, qk nope / rope head dims, v head dim).
_MLA = (1536, 512, 128, 64, 128)


def global_tensors(shape: ModelShape) -> list[GlobalTensor]:
    """Every global tensor of the model in Megatron's order (embedding, layers, head)."""
    s, H = shape, shape.hidden
    out = [GlobalTensor("embedding.word_embeddings.weight", (s.vocab, H), "tp", stage="first")]
    if s.position_embeddings:
        out.append(GlobalTensor("embedding.position_embeddings.weight",
                                (s.position_embeddings, H), stage="first"))
    for i in range(s.layers):
        out += _layer(s, i)
    out += _norm(s, "decoder.final_layernorm", None, stage="last")
    if not s.tie:
        out.append(GlobalTensor("output_layer.weight", (s.vocab, H), "tp", stage="last"))
    return out


def stage_layers(layers: int, pp: int, stage: int) -> range:
    """Global layers of a pipeline stage: as even as can be (61 over 16: 3 or 4 each)."""
    return range(layers * stage // pp, layers * (stage + 1) // pp)


def _norm(s: ModelShape, prefix: str, layer: int | None, stage: str | None = None,
          width: int | None = None, fused: bool = False) -> list[GlobalTensor]:
    """A layer norm; ``fused``: held by the linear that follows it (``prefix`` names it)."""
    w = (width or s.hidden,)
    weight, bias = (".layer_norm_weight", ".layer_norm_bias") if fused else (".weight", ".bias")
    out = [GlobalTensor(prefix + weight, w, layer=layer, stage=stage)]
    if s.norm_bias:
        out.append(GlobalTensor(prefix + bias, w, layer=layer, stage=stage))
    return out


def _linear(s: ModelShape, name: str, shape: tuple[int, int], group: str, dim: int, layer: int,
            stride: int = 1, expert: int | None = None, bias: bool | None = None) -> list[GlobalTensor]:
    out = [GlobalTensor(name + ".weight", shape, group, dim, stride, layer, expert)]
    if s.bias if bias is None else bias:
        # A column-parallel bias is cut like its rows; a row-parallel one is replicated.
        out.append(GlobalTensor(name + ".bias", shape[:1], group if dim == 0 else "rep", 0,
                                stride, layer, expert))
    return out


def _layer(s: ModelShape, i: int) -> list[GlobalTensor]:
    p = f"decoder.layers.{i}."
    if s.mamba:
        out = _mamba(s, p + "mixer.", i)
    elif s.mla:
        out = _norm(s, p + "input_layernorm", i) + _mla(s, p, i)
    elif s.fused_norms:
        out = _norm(s, p + "self_attention.linear_qkv", i, fused=True) + _gqa(s, p, i)
    else:
        out = _norm(s, p + "input_layernorm", i) + _gqa(s, p, i)
    if s.experts and i >= s.dense_layers:
        out += _norm(s, p + "pre_mlp_layernorm", i) + _moe(s, p, i)
    elif s.fused_norms:
        out += _norm(s, p + "mlp.linear_fc1", i, fused=True) + _mlp(s, p + "mlp.", s.ffn, "tp", i)
    else:
        out += _norm(s, p + "pre_mlp_layernorm", i) + _mlp(s, p + "mlp.", s.ffn, "tp", i)
    return out


def _gqa(s: ModelShape, p: str, i: int) -> list[GlobalTensor]:
    hd = s.head_dim
    qkv = ((s.heads + 2 * s.kv_heads) * hd, s.hidden)
    return (_linear(s, p + "self_attention.linear_qkv", qkv, "tp", 0, i)
            + _linear(s, p + "self_attention.linear_proj", (s.hidden, s.heads * hd), "tp", 1, i))


def _mamba(s: ModelShape, p: str, i: int) -> list[GlobalTensor]:
    """Megatron's Mamba mixer with small state sizes: ``in_proj`` and ``conv1d`` are
    block-interleaved (each rank holds its share of every component)."""
    d_inner, ng, ds, nh = 2 * s.hidden, s.kv_heads, 4, s.heads
    in_parts = (d_inner, d_inner, ng * ds, ng * ds, nh)
    conv_parts = (d_inner, ng * ds, ng * ds)
    return (_norm(s, p + "in_proj", i, fused=True)
            + [GlobalTensor(p + "in_proj.weight", (sum(in_parts), s.hidden), "tp", layer=i, parts=in_parts),
               GlobalTensor(p + "conv1d.weight", (sum(conv_parts), 1, 4), "tp", layer=i, parts=conv_parts)]
            + [GlobalTensor(p + leaf, (nh,), "tp", layer=i) for leaf in ("A_log", "D", "dt_bias")]
            + [GlobalTensor(p + "norm.weight", (d_inner,), "tp", layer=i),
               GlobalTensor(p + "out_proj.weight", (s.hidden, d_inner), "tp", 1, layer=i)])


def _mla(s: ModelShape, p: str, i: int) -> list[GlobalTensor]:
    q_rank, kv_rank, nope, rope, v = _MLA
    a, H, n = p + "self_attention.", s.hidden, s.heads
    return (_linear(s, a + "linear_q_down_proj", (q_rank, H), "rep", 0, i)
            + _norm(s, a + "q_layernorm", i, width=q_rank)
            + _linear(s, a + "linear_q_up_proj", (n * (nope + rope), q_rank), "tp", 0, i)
            + _linear(s, a + "linear_kv_down_proj", (kv_rank + rope, H), "rep", 0, i)
            + _norm(s, a + "kv_layernorm", i, width=kv_rank)
            + _linear(s, a + "linear_kv_up_proj", (n * (nope + v), kv_rank), "tp", 0, i)
            + _linear(s, a + "linear_proj", (H, n * v), "tp", 1, i))


def _mlp(s: ModelShape, p: str, ffn: int, group: str, i: int,
         expert: int | None = None) -> list[GlobalTensor]:
    fc1 = (ffn * (2 if s.swiglu else 1), s.hidden)
    bias = False if expert is not None else None
    # SwiGLU: each rank holds its part of the gate and of the up projection (stride 2).
    return (_linear(s, p + "linear_fc1", fc1, group, 0, i, 2 if s.swiglu else 1, expert, bias)
            + _linear(s, p + "linear_fc2", (s.hidden, ffn), group, 1, i, 1, expert, bias))


def _grouped_expert(s: ModelShape, p: str, i: int, e: int) -> list[GlobalTensor]:
    """TEGroupedMLP's expert ``e``: one tensor per expert, the index ends the name."""
    fc1 = (s.expert_ffn * (2 if s.swiglu else 1), s.hidden)
    return [GlobalTensor(f"{p}linear_fc1.weight{e}", fc1, "etp", 0, 2 if s.swiglu else 1, i, e),
            GlobalTensor(f"{p}linear_fc2.weight{e}", (s.hidden, s.expert_ffn), "etp", 1, 1, i, e)]


def _moe(s: ModelShape, p: str, i: int) -> list[GlobalTensor]:
    out = [GlobalTensor(p + "mlp.router.weight", (s.experts, s.hidden), layer=i)]
    if s.router_bias:
        out += [GlobalTensor(p + "mlp.router.expert_bias", (s.experts,), layer=i, dtype="float32",
                             buffer=True),
                GlobalTensor(p + "mlp.router.local_tokens_per_expert", (s.experts,), layer=i,
                             dtype="float32", buffer=True, persistent=False)]
    for e in range(s.experts):
        if s.grouped_experts:
            out += _grouped_expert(s, p + "mlp.experts.", i, e)
        else:
            out += _mlp(s, f"{p}mlp.experts.local_experts.{e}.", s.expert_ffn, "etp", i, e)
    if s.shared_expert_ffn:
        out += _mlp(s, p + "mlp.shared_experts.", s.shared_expert_ffn, "tp", i)
    return out


class TensorIndex:
    """Global tensors grouped by layer and expert, so a rank's share is found without
    scanning the 30,000 tensors of a large MoE model once per distinct rank."""

    def __init__(self, tensors: list[GlobalTensor]) -> None:
        self.outer: list[GlobalTensor] = []
        self.layers: dict[int, list[GlobalTensor]] = {}
        self.experts: dict[int, dict[int, list[GlobalTensor]]] = {}
        for t in tensors:
            if t.layer is None:
                self.outer.append(t)
            elif t.expert is None:
                self.layers.setdefault(t.layer, []).append(t)
            else:
                self.experts.setdefault(t.layer, {}).setdefault(t.expert, []).append(t)

    def held(self, layers: range, experts: range) -> list[GlobalTensor]:
        """Tensors outside layers, then each layer's own, then its experts in ``experts``."""
        out = list(self.outer)
        for i in layers:
            out += self.layers.get(i, ())
            by_expert = self.experts.get(i, {})
            for e in experts:
                out += by_expert.get(e, ())
        return out


def held_tensors(shape: ModelShape, mesh: Mesh, c: Coords,
                 index: TensorIndex | None = None) -> list[tuple[str, GlobalTensor]]:
    """(Megatron-local name, global tensor) of everything the rank at ``c`` holds, in
    module order: the toy GPT registers exactly these, the simulator describes them.

    ``index`` (of ``global_tensors(shape)``) saves rebuilding it per rank. A tied
    output layer on the last of several stages is Megatron's copy of the word
    embedding, named ``output_layer.weight``.
    """
    layers = stage_layers(shape.layers, mesh.pp, c.pp)
    per_ep = shape.experts // mesh.ep if shape.experts else 0
    index = index if index is not None else TensorIndex(global_tensors(shape))
    out = []
    for t in index.held(layers, range(c.ep * per_ep, (c.ep + 1) * per_ep)):
        key = _local_name(shape, t, mesh, c, layers, per_ep)
        if key is not None:
            out.append((key, t))
    if shape.tie and mesh.pp > 1 and c.pp == mesh.pp - 1:
        out.append((TIED_OUTPUT, GlobalTensor(TIED_OUTPUT, (shape.vocab, shape.hidden), "tp",
                                              stage="last")))
    return out


def _local_name(shape: ModelShape, t: GlobalTensor, mesh: Mesh, c: Coords, layers: range,
                per_ep: int) -> str | None:
    """The local name (layers from the stage's first, experts from the rank's first), or
    None where the rank does not hold ``t``."""
    if (t.stage == "first" and c.pp != 0) or (t.stage == "last" and c.pp != mesh.pp - 1):
        return None
    key = t.name
    if t.layer is not None:
        if t.layer not in layers:
            return None
        key = key.replace(f"layers.{t.layer}.", f"layers.{t.layer - layers.start}.", 1)
    if t.expert is not None:
        if t.expert // per_ep != c.ep:
            return None
        k = t.expert % per_ep
        if shape.grouped_experts:
            key = key[: -len(str(t.expert))] + str(k)
        else:
            key = key.replace(f"local_experts.{t.expert}.", f"local_experts.{k}.", 1)
    return key
