"""A Megatron-like toy GPT: real parameter names and sharding attributes, tiny sizes.

``build_toy(spec, mesh, rank, seed)`` builds the model one rank holds in a given
parallel layout (TP, PP, EP, expert-TP, DP), with its local tensors cut from
deterministic global values by an *oracle* written with plain torch ops
(``torch.chunk`` / ``torch.split``), independently of torchrefit's layout code.
``expected_local`` gives what a destination rank must hold after a refit, from
the same oracle. Dense models (no PP, MoE or Mamba) also run a tensor-parallel
forward pass, so trainer and inference logits can be compared.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..simulate.meshes import Coords, Mesh
from ..simulate.shapes import stage_layers

__all__ = ["ModelSpec", "TensorDef", "global_table", "global_value", "build_toy", "expected_local",
           "FakeGroup", "PGCollection"]


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a toy GPT; every size stays small enough for 8 CPU processes."""

    layers: int = 4
    hidden: int = 24
    heads: int = 4
    groups: int = 2  # query groups (GQA)
    ffn: int = 48
    vocab: int = 96
    swiglu: bool = True
    bias: bool = True
    experts: int = 0
    expert_ffn: int = 24
    grouped_experts: bool = False  # ``linear_fc1.weightK`` names instead of ``local_experts.K``
    router_bias: bool = False  # persistent fp32 ``expert_bias`` buffer
    mamba: bool = False  # layers hold a Mamba mixer (block-interleaved in_proj) instead of attention
    tie: bool = False
    dtype: torch.dtype = torch.float32
    buffer_dtype: torch.dtype = torch.float32

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class TensorDef:
    """A global tensor and how Megatron shards it."""

    shape: tuple[int, ...]
    group: str = "rep"  # "tp" (dense TP), "etp" (expert TP), "rep" (replicated)
    dim: int = 0
    stride: int = 1
    parts: tuple[int, ...] | None = None  # global sizes of block-interleaved components
    layer: int | None = None
    expert: int | None = None
    stage: str | None = None  # "first" / "last" pipeline stage only
    buffer: bool = False
    persistent: bool = True
    attrs: dict = field(default_factory=dict, compare=False)


def global_table(spec: ModelSpec) -> dict[str, TensorDef]:
    """Every global tensor of the model, by canonical (global) name."""
    H, hd = spec.hidden, spec.head_dim
    t: dict[str, TensorDef] = {
        "embedding.word_embeddings.weight": TensorDef((spec.vocab, H), "tp", stage="first"),
        "decoder.final_layernorm.weight": TensorDef((H,), stage="last"),
    }
    if not spec.tie:
        t["output_layer.weight"] = TensorDef((spec.vocab, H), "tp", stage="last")
    for i in range(spec.layers):
        p = f"decoder.layers.{i}."
        if spec.mamba:
            _mamba(t, p, spec, i)
        else:
            t[p + "self_attention.linear_qkv.layer_norm_weight"] = TensorDef((H,), layer=i)
            t[p + "self_attention.linear_qkv.weight"] = TensorDef(
                ((spec.heads + 2 * spec.groups) * hd, H), "tp", layer=i)
            t[p + "self_attention.linear_proj.weight"] = TensorDef((H, spec.heads * hd), "tp", 1, layer=i)
            if spec.bias:
                t[p + "self_attention.linear_qkv.bias"] = TensorDef(
                    ((spec.heads + 2 * spec.groups) * hd,), "tp", layer=i)
                t[p + "self_attention.linear_proj.bias"] = TensorDef((H,), layer=i)
        if spec.experts:
            _moe(t, p, spec, i)
        else:
            _mlp(t, p, spec, i)
    return t


def _mlp(t, p, spec, i):
    H, fc1 = spec.hidden, spec.ffn * (2 if spec.swiglu else 1)
    stride = 2 if spec.swiglu else 1
    t[p + "mlp.linear_fc1.layer_norm_weight"] = TensorDef((H,), layer=i)
    t[p + "mlp.linear_fc1.weight"] = TensorDef((fc1, H), "tp", 0, stride, layer=i)
    t[p + "mlp.linear_fc2.weight"] = TensorDef((H, spec.ffn), "tp", 1, layer=i)
    if spec.bias:
        t[p + "mlp.linear_fc1.bias"] = TensorDef((fc1,), "tp", 0, stride, layer=i)
        t[p + "mlp.linear_fc2.bias"] = TensorDef((H,), layer=i)


def _moe(t, p, spec, i):
    H, E = spec.hidden, spec.experts
    t[p + "pre_mlp_layernorm.weight"] = TensorDef((H,), layer=i)
    t[p + "mlp.router.weight"] = TensorDef((E, H), layer=i)
    if spec.router_bias:
        t[p + "mlp.router.expert_bias"] = TensorDef((E,), layer=i, buffer=True)
        t[p + "mlp.router.local_tokens_per_expert"] = TensorDef((E,), layer=i, buffer=True,
                                                                persistent=False)
    fc1 = spec.expert_ffn * (2 if spec.swiglu else 1)
    for e in range(E):
        if spec.grouped_experts:
            a, b = f"mlp.experts.linear_fc1.weight{e}", f"mlp.experts.linear_fc2.weight{e}"
        else:
            a = f"mlp.experts.local_experts.{e}.linear_fc1.weight"
            b = f"mlp.experts.local_experts.{e}.linear_fc2.weight"
        t[p + a] = TensorDef((fc1, H), "etp", 0, 2 if spec.swiglu else 1, layer=i, expert=e)
        t[p + b] = TensorDef((H, spec.expert_ffn), "etp", 1, layer=i, expert=e)


def _mamba(t, p, spec, i):
    H = spec.hidden
    d_inner, ng, ds, nh = 2 * H, spec.groups, 4, spec.heads
    conv = d_inner + 2 * ng * ds
    t[p + "mixer.in_proj.layer_norm_weight"] = TensorDef((H,), layer=i)
    t[p + "mixer.in_proj.weight"] = TensorDef(
        (2 * d_inner + 2 * ng * ds + nh, H), "tp", 0, parts=(d_inner, d_inner, ng * ds, ng * ds, nh), layer=i)
    t[p + "mixer.conv1d.weight"] = TensorDef((conv, 1, 4), "tp", 0, parts=(d_inner, ng * ds, ng * ds), layer=i)
    t[p + "mixer.A_log"] = TensorDef((nh,), "tp", layer=i)
    t[p + "mixer.D"] = TensorDef((nh,), "tp", layer=i)
    t[p + "mixer.dt_bias"] = TensorDef((nh,), "tp", layer=i)
    t[p + "mixer.norm.weight"] = TensorDef((d_inner,), "tp", layer=i)
    t[p + "mixer.out_proj.weight"] = TensorDef((H, d_inner), "tp", 1, layer=i)


def global_value(name: str, shape: tuple[int, ...], seed: int, spec: ModelSpec | None = None) -> torch.Tensor:
    """Deterministic float32 values of a global tensor (tied output = word embedding)."""
    if spec is not None and spec.tie and name == "output_layer.weight":
        name = "embedding.word_embeddings.weight"
    gen = torch.Generator().manual_seed((zlib.crc32(name.encode()) * 1000003 + seed) % (1 << 62))
    return torch.randn(shape, generator=gen)


# ------------------------------------------------------------------------ oracle
def _oracle_shard(g: torch.Tensor, d: TensorDef, rank: int, size: int) -> torch.Tensor:
    """The local block of a global tensor, the way Megatron cuts it (torch ops only)."""
    if d.group == "rep" or size == 1:
        return g.clone()
    if d.parts is not None:
        comps = torch.split(g, list(d.parts), d.dim)
        return torch.cat([torch.chunk(c, size, d.dim)[rank] for c in comps], d.dim)
    chunks = torch.chunk(g, size * d.stride, d.dim)
    return torch.cat(chunks[rank::size], d.dim)


def _layers_of(spec: ModelSpec, mesh: Mesh, c: Coords) -> range:
    """The stage's global layers: the one pipeline split (uneven where PP does not
    divide the layers, never dropping one)."""
    return stage_layers(spec.layers, mesh.pp, c.pp)


def _held(spec: ModelSpec, mesh: Mesh, c: Coords, name: str, d: TensorDef) -> str | None:
    """The local name under which rank ``c`` holds global tensor ``name``, or None."""
    if d.stage == "first" and c.pp != 0:
        return None
    if d.stage == "last" and c.pp != mesh.pp - 1:
        return None
    local = name
    if d.layer is not None:
        layers = _layers_of(spec, mesh, c)
        if d.layer not in layers:
            return None
        local = local.replace(f"decoder.layers.{d.layer}.", f"decoder.layers.{d.layer - layers[0]}.", 1)
    if d.expert is not None:
        n_local = spec.experts // mesh.ep
        if d.expert // n_local != c.ep:
            return None
        k = d.expert % n_local
        if spec.grouped_experts:
            local = local[: -len(str(d.expert))] + str(k)
        else:
            local = local.replace(f"local_experts.{d.expert}.", f"local_experts.{k}.")
    return local


def _table_for(spec: ModelSpec, mesh: Mesh) -> dict[str, TensorDef]:
    table = global_table(spec)
    if spec.tie and mesh.pp > 1:  # Megatron keeps a copy of the embedding on the last stage
        table["output_layer.weight"] = TensorDef((spec.vocab, spec.hidden), "tp", stage="last")
    return table


def _local_shape(d: TensorDef, size: int) -> tuple[int, ...]:
    if d.group == "rep" or size == 1:
        return d.shape
    return d.shape[: d.dim] + (d.shape[d.dim] // size,) + d.shape[d.dim + 1:]


def _local_tensors(spec: ModelSpec, mesh: Mesh, c: Coords, seed: int, value_spec: ModelSpec,
                   device: torch.device | str | None = None, random_init: bool = False,
                   ) -> dict[str, tuple[str, TensorDef, torch.Tensor]]:
    """Local name -> (global name, definition, local tensor) for what rank ``c`` holds.

    ``random_init`` fills local tensors with random values on ``device`` directly (fast,
    for benchmarks); otherwise they are cut from the global values by the oracle.
    """
    gen = None
    if random_init:
        gen = torch.Generator(device=device or "cpu").manual_seed(seed * 7919 + c.tp * 131 + c.pp * 17 + c.ep)
    out = {}
    for name, d in _table_for(spec, mesh).items():
        local = _held(spec, mesh, c, name, d)
        if local is None:
            continue
        rank, size = (c.etp, mesh.etp) if d.group == "etp" else (c.tp, mesh.tp)
        dtype = spec.buffer_dtype if d.buffer else spec.dtype
        if random_init:
            value = torch.empty(_local_shape(d, size), dtype=dtype, device=device)
            value.normal_(generator=gen)
        else:
            g = global_value(name, d.shape, seed, value_spec)
            value = _oracle_shard(g, d, rank, size).to(dtype=dtype, device=device)
        out[local] = (name, d, value)
    return out


def expected_local(spec: ModelSpec, mesh: Mesh, rank: int, seed: int,
                   value_spec: ModelSpec | None = None) -> dict[str, torch.Tensor]:
    """What rank ``rank`` of a model laid out as ``mesh`` holds when its values come
    from seed ``seed`` of a model shaped (tied or not) like ``value_spec``.
    Non-persistent buffers are left out: refits do not move them."""
    c = mesh.coords(rank)
    if c is None:
        return {}
    got = _local_tensors(spec, mesh, c, seed, value_spec or spec)
    return {k: v for k, (_, d, v) in got.items() if d.persistent}


# ------------------------------------------------------------------------- model
class FakeGroup:
    """A process-group stand-in that only knows this rank's index and the size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"FakeGroup({self._rank}/{self._size})"


@dataclass
class PGCollection:
    tp: object = None
    pp: object = None
    ep: object = None
    dp: object = None
    expt_tp: object = None


@dataclass
class _Config:
    num_moe_experts: int | None


class ToyGPT(nn.Module):
    """The toy model one rank holds; ``forward`` runs for dense TP-only layouts."""

    def __init__(self, spec: ModelSpec, mesh: Mesh, coords: Coords, pg: PGCollection,
                 tp_group=None) -> None:
        super().__init__()
        self.spec, self.mesh, self.coords, self.pg_collection = spec, mesh, coords, pg
        self.config = _Config(spec.experts or None)
        self.share_embeddings_and_output_weights = spec.tie
        self._tp_group = tp_group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return _forward(self, tokens)


def build_toy(spec: ModelSpec, mesh: Mesh, rank: int, seed: int, *, tp_group=None,
              device: torch.device | str | None = None, random_init: bool = False) -> ToyGPT | None:
    """The model rank ``rank`` holds in layout ``mesh`` (None outside the mesh's ranks).

    Groups are :class:`FakeGroup`s (only rank and size are read by layout code);
    pass a real ``tp_group`` to run :meth:`ToyGPT.forward`. ``random_init`` skips the
    oracle and fills tensors with random values on ``device`` (for benchmarks).
    """
    c = mesh.coords(rank)
    if c is None:
        return None
    pg = PGCollection(tp=FakeGroup(c.tp, mesh.tp), pp=FakeGroup(c.pp, mesh.pp),
                      ep=FakeGroup(c.ep, mesh.ep), dp=FakeGroup(mesh.dp_index(rank), mesh.dp),
                      expt_tp=FakeGroup(c.etp, mesh.etp))
    model = ToyGPT(spec, mesh, c, pg, tp_group)
    layers = _layers_of(spec, mesh, c)
    for local, (_, d, value) in _local_tensors(spec, mesh, c, seed, spec, device, random_init).items():
        _register(model, local, value, d)
    for i, module in enumerate(_layer_modules(model)):
        module.layer_number = layers[0] + i + 1
    return model


def _register(model: nn.Module, local: str, value: torch.Tensor, d: TensorDef) -> None:
    *path, leaf = local.split(".")
    mod = model
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if d.buffer:
        mod.register_buffer(leaf, value, persistent=d.persistent)
        return
    param = nn.Parameter(value)
    if d.group != "rep":
        param.tensor_model_parallel = True
        param.partition_dim = d.dim
        param.partition_stride = d.stride
        if d.parts is not None:
            param.partition_sizes = [p // (1 if d.group == "rep" else _size_of(model, d)) for p in d.parts]
    if d.expert is not None:
        param.allreduce = False
    mod.register_parameter(leaf, param)


def _size_of(model: ToyGPT, d: TensorDef) -> int:
    return model.mesh.etp if d.group == "etp" else model.mesh.tp


def _layer_modules(model: nn.Module) -> list[nn.Module]:
    decoder = getattr(model, "decoder", None)
    layers = getattr(decoder, "layers", None) if decoder is not None else None
    if layers is None:
        return []
    return [getattr(layers, str(i)) for i in range(len(list(layers.children())))]


# ----------------------------------------------------------------------- forward
def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _forward(m: ToyGPT, tokens: torch.Tensor) -> torch.Tensor:
    spec, c, group = m.spec, m.coords, m._tp_group
    if m.mesh.pp > 1 or spec.experts or spec.mamba:
        raise NotImplementedError("the toy forward runs dense tensor-parallel layouts only")
    emb = m.embedding.word_embeddings.weight
    start = c.tp * emb.shape[0]
    inside = (tokens >= start) & (tokens < start + emb.shape[0])
    h = emb[(tokens - start).clamp(0, emb.shape[0] - 1)] * inside[:, None]
    h = _all_reduce(h, group)
    for layer in _layer_modules(m):
        h = h + _attention(layer.self_attention, h, spec, group)
        h = h + _mlp_forward(layer.mlp, h, spec, group)
    h = _rms(h, m.decoder.final_layernorm.weight)
    out = emb if spec.tie else m.output_layer.weight
    logits = h @ out.t()
    if group is None or m.mesh.tp == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(m.mesh.tp)]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, -1)


def _attention(a: nn.Module, h: torch.Tensor, spec: ModelSpec, group) -> torch.Tensor:
    T, hd = h.shape[0], spec.head_dim
    qpg = spec.heads // spec.groups
    x = _rms(h, a.linear_qkv.layer_norm_weight)
    qkv = F.linear(x, a.linear_qkv.weight, getattr(a.linear_qkv, "bias", None))
    qkv = qkv.view(T, -1, qpg + 2, hd)
    q = qkv[:, :, :qpg].reshape(T, -1, hd)
    k = qkv[:, :, qpg].repeat_interleave(qpg, dim=1)
    v = qkv[:, :, qpg + 1].repeat_interleave(qpg, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, -1)
    o = _all_reduce(o @ a.linear_proj.weight.t(), group)
    bias = getattr(a.linear_proj, "bias", None)
    return o + bias if bias is not None else o


def _mlp_forward(mlp: nn.Module, h: torch.Tensor, spec: ModelSpec, group) -> torch.Tensor:
    x = _rms(h, mlp.linear_fc1.layer_norm_weight)
    y = F.linear(x, mlp.linear_fc1.weight, getattr(mlp.linear_fc1, "bias", None))
    if spec.swiglu:
        gate, up = y.chunk(2, -1)
        y = F.silu(gate) * up
    else:
        y = F.gelu(y)
    z = _all_reduce(y @ mlp.linear_fc2.weight.t(), group)
    bias = getattr(mlp.linear_fc2, "bias", None)
    return z + bias if bias is not None else z
