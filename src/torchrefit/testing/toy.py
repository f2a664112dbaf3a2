"""A Megatron-like toy GPT: real parameter names and sharding attributes, tiny sizes.

``build_toy(spec, mesh, rank, seed)`` builds the model one rank holds in a given
parallel layout (TP, PP, EP, expert-TP, DP): the tensors are the simulator's
(``simulate.shapes.held_tensors`` of ``spec.shape()``, Transformer Engine names),
the mesh is ``simulate.meshes.Mesh``. Its local tensors are cut from
deterministic global values by an *oracle* written with plain torch ops
(``torch.chunk`` / ``torch.split``), independently of torchrefit's layout code.
``expected_local`` gives what a destination rank must hold after a refit, from
the same oracle. Dense models (no PP, MoE or Mamba) also run a tensor-parallel
forward pass, so trainer and inference logits can be compared.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..simulate.meshes import Coords, Mesh
from ..simulate.shapes import GlobalTensor, ModelShape, global_tensors, held_tensors, stage_layers

__all__ = ["ModelSpec", "global_table", "global_value", "build_toy", "expected_local",
           "FakeGroup", "PGCollection"]


@dataclass(frozen=True)
class ModelSpec:
    """A toy GPT: small default sizes (8 CPU processes hold it) and torch dtypes for
    its values; which tensors it has is :meth:`shape`'s, the simulator's table."""

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
    router_bias: bool = False  # ``expert_bias`` buffer (and a non-persistent token count)
    mamba: bool = False  # layers hold a Mamba mixer (block-interleaved in_proj) instead of attention
    tie: bool = False
    dtype: torch.dtype = torch.float32
    buffer_dtype: torch.dtype = torch.float32

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def shape(self) -> ModelShape:
        """The model's shape in the simulator's terms: its tensors are that shape's."""
        return ModelShape(
            self.layers, self.hidden, self.heads, self.groups, self.ffn, self.vocab,
            swiglu=self.swiglu, bias=self.bias, tie=self.tie, experts=self.experts,
            expert_ffn=self.expert_ffn, dtype=str(self.dtype).removeprefix("torch."),
            fused_norms=True, router_bias=self.router_bias, grouped_experts=self.grouped_experts,
            mamba=self.mamba)


def global_table(spec: ModelSpec) -> dict[str, GlobalTensor]:
    """Every global tensor of the model, by canonical (global) name."""
    return {t.name: t for t in global_tensors(spec.shape())}


def global_value(name: str, shape: tuple[int, ...], seed: int, spec: ModelSpec | None = None) -> torch.Tensor:
    """Deterministic float32 values of a global tensor (tied output = word embedding)."""
    if spec is not None and spec.tie and name == "output_layer.weight":
        name = "embedding.word_embeddings.weight"
    gen = torch.Generator().manual_seed((zlib.crc32(name.encode()) * 1000003 + seed) % (1 << 62))
    return torch.randn(shape, generator=gen)


# ------------------------------------------------------------------------ oracle
def _oracle_shard(g: torch.Tensor, d: GlobalTensor, rank: int, size: int) -> torch.Tensor:
    """The local block of a global tensor, the way Megatron cuts it (torch ops only)."""
    if d.group == "rep" or size == 1:
        return g.clone()
    if d.parts is not None:
        comps = torch.split(g, list(d.parts), d.dim)
        return torch.cat([torch.chunk(c, size, d.dim)[rank] for c in comps], d.dim)
    chunks = torch.chunk(g, size * d.stride, d.dim)
    return torch.cat(chunks[rank::size], d.dim)


def _local_shape(d: GlobalTensor, size: int) -> tuple[int, ...]:
    if d.group == "rep" or size == 1:
        return d.shape
    return d.shape[: d.dim] + (d.shape[d.dim] // size,) + d.shape[d.dim + 1:]


def _local_tensors(spec: ModelSpec, mesh: Mesh, c: Coords, seed: int, value_spec: ModelSpec,
                   device: torch.device | str | None = None, random_init: bool = False,
                   ) -> dict[str, tuple[GlobalTensor, torch.Tensor]]:
    """Local name -> (global tensor, local tensor) for what rank ``c`` holds.

    ``random_init`` fills local tensors with random values on ``device`` directly (fast,
    for benchmarks); otherwise they are cut from the global values by the oracle.
    """
    gen = rep_gen = None
    if random_init:
        gen = torch.Generator(device=device or "cpu").manual_seed(seed * 7919 + c.tp * 131 + c.pp * 17 + c.ep)
        # replicated tensors: the same values on every TP rank, as a trainer keeps them
        # (verify() counts each source element once and would see replicas disagree)
        rep_gen = torch.Generator(device=device or "cpu").manual_seed(seed * 7919 + c.pp * 17 + c.ep + 1)
    out = {}
    for local, d in held_tensors(spec.shape(), mesh, c):
        rank, size = (c.etp, mesh.etp) if d.group == "etp" else (c.tp, mesh.tp)
        dtype = spec.buffer_dtype if d.buffer else spec.dtype
        if random_init:
            value = torch.empty(_local_shape(d, size), dtype=dtype, device=device)
            value.normal_(generator=rep_gen if d.group == "rep" else gen)
        else:
            g = global_value(d.name, d.shape, seed, value_spec)
            value = _oracle_shard(g, d, rank, size).to(dtype=dtype, device=device)
        out[local] = (d, value)
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
    return {k: v for k, (d, v) in got.items() if d.persistent}


def load_seed(model: nn.Module | None, spec: ModelSpec, mesh: Mesh, rank: int, seed: int) -> None:
    """Write seed ``seed``'s values into ``model`` (built by :func:`build_toy` for the
    same spec, mesh and rank) in place, as an optimizer step changes weights without
    moving them. No-op for None (a rank outside the mesh)."""
    if model is None:
        return
    values = expected_local(spec, mesh, rank, seed)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name in values:
                t.copy_(values[name])


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
    layers = stage_layers(spec.layers, mesh.pp, c.pp)
    for local, (d, value) in _local_tensors(spec, mesh, c, seed, spec, device, random_init).items():
        _register(model, local, value, d)
    for i, module in enumerate(_layer_modules(model)):
        module.layer_number = layers[0] + i + 1
    return model


def _register(model: nn.Module, local: str, value: torch.Tensor, d: GlobalTensor) -> None:
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


def _size_of(model: ToyGPT, d: GlobalTensor) -> int:
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
