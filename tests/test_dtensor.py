"""DTensor / FSDP2 layouts: refits from and into models whose parameters are DTensors.

On one CPU, without a process group: ``placement_pieces`` against torch's own splits
(``Shard``, uneven and empty shards, two and three mesh dims on one tensor dim,
``_StridedShard`` both as FSDP2+TP writes it and as views write it, where a local
tensor is several pieces), ``Partial`` rejected, wrapper names stripped.

On 4 real processes joined by gloo, in one world: DTensor ``Shard(0)`` (via
``distribute_module``, with a replicated DTensor buffer) -> replicated; real FSDP2
(``fully_shard`` per block and root; uneven rows, one rank empty; planned while an
inference forward left the root unsharded, then a training step before the refit)
-> replicated; FSDP2 + TP on a 2x2 mesh (``_StridedShard``) -> Megatron-style TP2 and
-> replicated; DTensor ``Shard(0)`` on 4 ranks -> DTensor ``(Replicate, Shard(-1))``
on 2x2; a DTensor whose ``shard_order`` applies tp before dp -> replicated;
replicated -> FSDP2 after an inference forward, whose next forward must see
the new weights; fp32 FSDP2 (bf16 mixed precision) -> bf16 with ``cast=True``; a
refit group that is a sub-group, with a mesh on 2 of its ranks. Every case checks,
for each destination tensor, that it differed from the source's full tensor before
the refit and equals it exactly after (DTensors through ``full_tensor()``), that
non-persistent buffers stayed, that every piece the adapter claims equals the same
box of ``full_tensor()`` and shares the DTensor's storage, and that ``verify()``
passes. Bad input (a ``Partial`` placement, a dtype change without ``cast``) raises
the same error on every rank within seconds and writes nothing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import torchrefit as tr
from torchrefit.layout import TensorLayout, global_name, named_refit_tensors, placement_pieces
from torchrefit.testing import (
    attempt_refit,
    check_failed_everywhere,
    global_value,
    run_cases,
    run_world,
)
from torchrefit.testing.toy import FakeGroup, PGCollection

WORLD = 4
SRC_SEED, DST_SEED = 1, 2
H, Q, V, OUT = 8, 12, 10, 3  # V = 10 rows over 4 ranks: 3, 3, 3, 1; OUT = 3: 1, 1, 1, 0


# ----------------------------------------------------------- pure: placement_pieces
def _torch_local_indices(shape, mesh_shape, coord, placements) -> tuple[torch.Tensor, torch.Tensor]:
    """Global element indices and the local tensor DTensor cuts from them (torch's splits)."""
    full = torch.arange(math.prod(shape)).reshape(shape)
    local = full
    for m, p in enumerate(placements):
        if not isinstance(p, Replicate):
            shards, _ = p._split_tensor(local, mesh_shape[m], with_padding=False, contiguous=False)
            local = shards[coord[m]]
    return full, local


PURE_CASES = [
    ((10,), (4,), [Shard(0)]),
    ((3, 5), (4,), [Shard(0)]),  # the last rank holds nothing
    ((1, 4), (4,), [Shard(0)]),  # three ranks hold nothing
    ((7, 6), (2, 2), [Shard(0), Shard(0)]),
    ((7, 6), (2, 2), [Shard(0), Shard(1)]),
    ((5, 6), (2, 2), [Replicate(), Shard(1)]),
    ((7, 6), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP2 + TP
    ((9, 4), (2, 3), [_StridedShard(0, split_factor=3), Shard(0)]),
    ((3, 8), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    ((16,), (4,), [_StridedShard(0, split_factor=2)]),  # a flattening view: two pieces
    ((5, 7), (2, 2), [_StridedShard(1, split_factor=3), Shard(0)]),
    ((12, 3), (2, 2, 2), [_StridedShard(0, split_factor=4), _StridedShard(0, split_factor=2), Shard(0)]),
    ((6, 10), (3, 2), [Shard(1), _StridedShard(1, split_factor=2)]),
]


@pytest.mark.parametrize("shape,mesh_shape,placements", PURE_CASES,
                         ids=[f"{list(s)}-{list(m)}-{p}" for s, m, p in PURE_CASES])
def test_placement_pieces_match_torch_splits(shape, mesh_shape, placements) -> None:
    most = 0
    for coord in itertools.product(*(range(m) for m in mesh_shape)):
        full, local = _torch_local_indices(shape, mesh_shape, coord, placements)
        local_shape, pieces = placement_pieces(shape, mesh_shape, coord, placements)
        assert local_shape == tuple(local.shape), coord
        # TensorLayout checks that the pieces tile the local tensor exactly once
        TensorLayout("t", tuple(shape), "int64", local_shape, pieces)
        for p in pieces:
            assert torch.equal(local[p.local_box.slices()], full[p.box.slices()]), (coord, p)
        most = max(most, len(pieces))
    if placements == [_StridedShard(0, split_factor=2)]:
        assert most == 2  # the case exists to cover local tensors of several pieces


def test_partial_is_refused_by_name() -> None:
    with pytest.raises(tr.LayoutError, match=r"layers\.3\.w: placement Partial.* is Partial"):
        placement_pieces((4, 4), (2, 2), (0, 1), [Shard(0), Partial()], name="layers.3.w")


def test_wrapper_names_are_stripped() -> None:
    assert global_name("layers.0._checkpoint_wrapped_module._orig_mod.attn.wq.weight") == \
        "layers.0.attn.wq.weight"
    assert global_name("_orig_mod.tok_embeddings.weight") == "tok_embeddings.weight"
    assert global_name("layers.0.module.w") == "layers.0.module.w"  # real names stay


class _Marked(torch.Tensor):
    """Stands in for DTensor where ``_holds`` is asked (no process group needed)."""


def _marked_net(where: str) -> nn.Module:
    net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    inner = net[1][0]
    marked = torch.zeros(2).as_subclass(_Marked)
    if where == "parameter":
        inner._parameters["extra"] = marked
    elif where in ("buffer", "cache"):
        inner.register_buffer("extra", marked, persistent=where == "buffer")
    return net


@pytest.mark.parametrize("where, held", [("parameter", True), ("buffer", True), ("cache", False),
                                         ("nowhere", False)])
def test_dtensor_detection_reads_parameters_and_persistent_buffers(where: str, held: bool) -> None:
    from torchrefit.layout.dtensor import _holds

    net = _marked_net(where)
    assert _holds(net, _Marked) is held
    assert _holds(dict(named_refit_tensors(net)), _Marked) is held  # a mapping model, by names


# ------------------------------------------------------------------------- model
class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(H))
        self.register_buffer("scale", torch.ones(H))  # persistent: travels with the weights
        self.register_buffer("cache", torch.zeros(H), persistent=False)  # derived: stays

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight * self.scale


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(H, Q), nn.Linear(Q, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.qkv(x)))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.norm = _Attn(), _Norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.attn(x))


class _Compiled(nn.Module):
    """Names its child ``_orig_mod`` as ``torch.compile``'s wrapper does, without
    importing dynamo (about 3 s per process)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._orig_mod = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._orig_mod(x)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(H, OUT, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


SHAPES = {n: tuple(t.shape) for n, t in named_refit_tensors(_Net())}
TOKENS = torch.arange(12) % V


def _oracle(seed: int) -> dict[str, torch.Tensor]:
    return {n: global_value(n, s, seed) for n, s in SHAPES.items()}


def _net(seed: int, dtype: torch.dtype = torch.float32) -> _Net:
    net = _Net()
    with torch.no_grad():
        for name, t in named_refit_tensors(net):
            t.copy_(global_value(name, t.shape, seed))
    return net.to(dtype)


def _wrap(net: _Net) -> _Net:
    """Wrap the blocks as torchtitan does: one compiled, one activation-checkpointed."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    net.layers[0] = _Compiled(net.layers[0])
    net.layers[1] = checkpoint_wrapper(net.layers[1])
    return net


# ---------------------------------------------------------------------- builders
@dataclass
class _Ctx:
    rank: int
    mesh4: object  # 1-D, all 4 ranks
    mesh22: object  # ("dp", "tp") 2 x 2
    mesh23: object  # 1-D, ranks 2 and 3
    sub: object  # process group of ranks 1, 2, 3


@dataclass
class _Setup:
    src: object
    dst: object
    kwargs: dict = field(default_factory=dict)
    group: object = None
    before_plan: Callable | None = None  # (src, dst) -> None, before the Refitter is built
    train: Callable | None = None  # a training step on the source, between plan and refit
    forward: bool = False  # the destination's forward must match the source's values
    idle: bool = False  # this rank takes no part


def _distributed(seed: int, mesh, placements: Callable, dtype=torch.float32) -> _Net:
    """A plain module whose parameters ``distribute_module`` turns into DTensors (its
    buffers become replicated DTensors)."""
    from torch.distributed.tensor import distribute_module, distribute_tensor

    def partition(_name, module, mesh):
        for key, p in list(module._parameters.items()):
            if p is None:
                continue
            dt = distribute_tensor(p.detach(), mesh, placements(p))
            module.register_parameter(key, nn.Parameter(dt, requires_grad=p.requires_grad))

    return distribute_module(_net(seed, dtype), mesh, partition)


def _fsdp(seed: int, ctx: _Ctx, *, tp: bool = False, mp=None) -> _Net:
    """FSDP2 as torchtitan applies it: TP first (2x2 mesh), wrappers, then
    ``fully_shard`` per block and at the root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    net = _net(seed)
    mesh = ctx.mesh4
    if tp:
        tp_mesh, mesh = ctx.mesh22["tp"], ctx.mesh22["dp"]
        parallelize_module(net, tp_mesh, {"embed": RowwiseParallel(input_layouts=Replicate()),
                                          "head": ColwiseParallel()})
        for block in net.layers:
            parallelize_module(block, tp_mesh, {"attn.qkv": ColwiseParallel(),
                                                "attn.out": RowwiseParallel()})
    _wrap(net)
    kw = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
    for block in net.layers:
        fully_shard(block, **kw)
    return fully_shard(net, **kw)


def _rollout(net: nn.Module) -> None:
    """An inference forward: FSDP2 keeps the root's parameters unsharded after it."""
    with torch.no_grad():
        net(TOKENS)


def _sgd_step(net: nn.Module) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    net(TOKENS).square().mean().backward()
    opt.step()


_TP_DIMS = {"embed.weight": 0, "attn.qkv.weight": 0, "attn.qkv.bias": 0, "attn.out.weight": 1}


def _megatron_tp2(seed: int, rank: int) -> _Net:
    """Megatron-style TP2 x DP2: sharded parameters carry ``tensor_model_parallel`` and
    ``partition_dim``; the rest (and ``head``, 3 rows) are whole."""
    tp = rank % 2
    net = _net(seed)
    for name, p in list(net.named_parameters()):
        dim = _TP_DIMS.get(name.split(".", 2)[-1] if name.startswith("layers.") else name)
        if dim is None:
            continue
        *path, leaf = name.split(".")
        mod = net.get_submodule(".".join(path))
        local = nn.Parameter(torch.chunk(p.detach(), 2, dim)[tp].clone())
        local.tensor_model_parallel, local.partition_dim, local.partition_stride = True, dim, 1
        mod.register_parameter(leaf, local)
    net.pg_collection = PGCollection(tp=FakeGroup(tp, 2))
    return net


def _chunk(t: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """``torch.chunk(t, parts)[index]``, empty where torch.chunk returns fewer chunks."""
    chunks = torch.chunk(t, parts, 0)
    return chunks[index] if index < len(chunks) else t[t.shape[0]:]


def _shard_ordered(seed: int, ctx: _Ctx) -> _Net:
    """Every parameter ``(Shard(0), Shard(0))`` on the 2x2 mesh with ``shard_order`` tp
    (mesh dim 1) before dp: the order redistributions can leave a DTensor in. No public
    API builds one, so the spec is built directly; they are held as persistent buffers
    because ``nn.Parameter`` drops the shard order (torch 2.13)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta

    net = _net(seed)
    dp, tp = ctx.mesh22.get_coordinate()
    order = (ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),)
    for name, p in list(net.named_parameters()):
        *path, leaf = name.split(".")
        local = _chunk(_chunk(p.detach(), 2, tp), 2, dp).clone()
        spec = DTensorSpec(ctx.mesh22, (Shard(0), Shard(0)),
                           TensorMeta(p.shape, p.stride(), p.dtype), shard_order=order)
        mod = net.get_submodule(".".join(path))
        del mod._parameters[leaf]
        mod.register_buffer(leaf, DTensor(local, spec, requires_grad=False))
    return net


def _last_dim(p):
    return [Replicate(), Shard(p.ndim - 1)]


CASES: dict[str, Callable[[_Ctx], _Setup]] = {
    "shard0-4->replicated": lambda c: _Setup(
        _distributed(SRC_SEED, c.mesh4, lambda p: [Shard(0)]), _net(DST_SEED)),
    "fsdp2-uneven-trained->replicated": lambda c: _Setup(
        _fsdp(SRC_SEED, c), _net(DST_SEED), before_plan=lambda s, d: _rollout(s), train=_sgd_step),
    "fsdp2-tp-2x2->megatron-tp2": lambda c: _Setup(
        _fsdp(SRC_SEED, c, tp=True), _megatron_tp2(DST_SEED, c.rank)),
    "fsdp2-tp-2x2->replicated": lambda c: _Setup(_fsdp(SRC_SEED, c, tp=True), _net(DST_SEED)),
    "shard0-4->dtensor-shard-last-2x2": lambda c: _Setup(
        _distributed(SRC_SEED, c.mesh4, lambda p: [Shard(0)]),
        _distributed(DST_SEED, c.mesh22, _last_dim)),
    "shard-order-tp-then-dp-2x2->replicated": lambda c: _Setup(
        _shard_ordered(SRC_SEED, c), _net(DST_SEED)),
    "replicated->fsdp2-forward": lambda c: _Setup(
        _net(SRC_SEED), _fsdp(DST_SEED, c), before_plan=lambda s, d: _rollout(d), forward=True),
    "fsdp2-fp32-mp-bf16->bf16-cast": lambda c: _Setup(
        _fsdp(SRC_SEED, c, mp=_bf16_policy()), _net(DST_SEED, torch.bfloat16), {"cast": True}),
    "subgroup-1..3-mesh-2,3->rank1": lambda c: _subgroup(c),
}


def _bf16_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16)


def _subgroup(c: _Ctx) -> _Setup:
    """Refit group ranks 1..3 (group ranks 0..2); the source's mesh is global ranks 2, 3
    (mesh coordinates 0, 1), the destination on global rank 1 alone; rank 0 stays out."""
    if c.rank == 0:
        return _Setup(None, None, idle=True)
    src = _distributed(SRC_SEED, c.mesh23, lambda p: [Shard(0)]) if c.rank >= 2 else None
    return _Setup(src, _net(DST_SEED) if c.rank == 1 else None, group=c.sub)


# ------------------------------------------------------------------------ checks
def _full(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _pieces_wrong(model) -> list[str]:
    """Every piece the adapter claims must equal that box of ``full_tensor()``, and its
    local tensor must share the DTensor's storage. Collective over the model's meshes:
    every rank gathers every DTensor, even where describing failed, to stay in step."""
    if model is None or not tr.layout.is_dtensor_model(model):
        return []
    try:
        described, wrong = tr.layout.dtensor(model), []
    except tr.LayoutError as e:
        described, wrong = None, [str(e)]
    for key, t in named_refit_tensors(model):
        if not isinstance(t, DTensor):
            continue
        full = _full(t)
        if described is None:
            continue
        local = described.tensors[key]
        if local.untyped_storage().data_ptr() != t._local_tensor.untyped_storage().data_ptr():
            wrong.append(f"{key}: local tensor does not share the DTensor's storage")
        layout = dict(described.layout)[key]
        wrong += [f"{key} {p.box}" for p in layout.pieces
                  if not torch.equal(local[p.local_box.slices()], full[p.box.slices()])]
    return wrong


def _compare(dst, expected: dict[str, torch.Tensor]) -> list[tuple[str, bool]]:
    """(global name, equal) per destination tensor. Collective over DTensor meshes."""
    if dst is None:
        return []
    out = []
    for qualified, t in named_refit_tensors(dst):
        name = global_name(qualified)
        want = expected[name].to(t.dtype)
        if getattr(t, "tensor_model_parallel", False):  # Megatron-style TP local tensor
            want = torch.chunk(want, dst.pg_collection.tp.size(), t.partition_dim)[dst.pg_collection.tp.rank()]
        out.append((name, torch.equal(_full(t), want)))
    return out


def _caches(model) -> dict[str, torch.Tensor]:
    if model is None:
        return {}
    return {n: _full(m.cache).clone() for n, m in model.named_modules() if isinstance(m, _Norm)}


def _forward_matches(dst, expected: dict[str, torch.Tensor]) -> bool:
    ref = _Net()
    with torch.no_grad():
        for name, t in named_refit_tensors(ref):
            t.copy_(expected[name])
        got = dst(TOKENS)
        return torch.equal(got, ref(TOKENS))


def _run_case(s: _Setup) -> dict:
    if s.idle:
        return {"idle": True}
    bad_pieces = _pieces_wrong(s.src) + _pieces_wrong(s.dst)
    if s.before_plan is not None:
        s.before_plan(s.src, s.dst)
    r = tr.Refitter(s.src, s.dst, group=s.group, **s.kwargs)
    if s.train is not None:
        s.train(s.src)  # after planning: the plan must stay valid across optimizer steps
    # the source's full tensors; collocated where the source trains, else the oracle
    expected = {global_name(n): _full(t) for n, t in named_refit_tensors(s.src)} \
        if s.train is not None else _oracle(SRC_SEED)
    same_before = [n for n, eq in _compare(s.dst, expected) if eq]
    caches = _caches(s.dst)
    report = r.refit()
    r.refit()  # a second refit replays the compiled program
    after = _compare(s.dst, expected)
    moved = [n for n, c in _caches(s.dst).items() if not torch.equal(c, caches[n])]
    r.verify()
    out = {"same_before": same_before, "wrong": [n for n, eq in after if not eq], "n": len(after),
           "moved": moved, "bad_pieces": bad_pieces, "remote": report.bytes_remote}
    if s.forward:
        out["forward"] = _forward_matches(s.dst, expected)
    return out


# -------------------------------------------------------------------- bad input
def _partial(c: _Ctx):
    src = _distributed(SRC_SEED, c.mesh4, lambda p: [Shard(0)])
    bias = src.layers[0].attn.out
    # a row-parallel output before its all-reduce: every rank holds a partial sum
    bias.bias = nn.Parameter(DTensor.from_local(torch.ones(H), c.mesh4, [Partial()]))
    return src, _net(DST_SEED), {}


def _no_cast(c: _Ctx):
    return _fsdp(SRC_SEED, c), _net(DST_SEED, torch.bfloat16), {}


BAD = {
    "partial": (_partial, tr.LayoutError, "layers.0.attn.out.bias: placement Partial"),
    "fp32->bf16-without-cast": (_no_cast, tr.PlanError, "pass cast=True"),
}


def _run_bad(name: str, c: _Ctx) -> dict:
    make = BAD[name][0]
    src, dst, kwargs = make(c)
    return attempt_refit(src, dst, **kwargs)


# ------------------------------------------------------------------------- world
def _world(rank: int, world: int, names: list[str], bad: list[str]) -> dict[str, dict]:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    ctx = _Ctx(rank, init_device_mesh("cpu", (world,)),
               init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
               DeviceMesh("cpu", [2, 3]), dist.new_group([1, 2, 3]))
    out: dict[str, dict] = run_cases(names, lambda name: _run_case(CASES[name](ctx)), key=str)
    for name in bad:
        try:
            out[name] = _run_bad(name, ctx)
        except Exception as e:  # a broken builder must not leave the other ranks waiting
            out[name] = {"raised": f"{type(e).__name__} outside torchrefit", "msg": str(e)}
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict]]:
    return run_world(_world, WORLD, list(CASES), list(BAD), timeout=300, pg_timeout=60)


@pytest.mark.parametrize("name", list(CASES))
def test_dtensor_refit(name: str, results) -> None:
    held = 0
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        assert "error" not in got, f"rank {rank}: {got['error']}"
        if got.get("idle"):
            continue
        assert got["bad_pieces"] == [], f"rank {rank}: pieces differ from full_tensor(): {got['bad_pieces']}"
        assert got["same_before"] == [], f"rank {rank}: equal before the refit: {got['same_before']}"
        assert got["wrong"] == [], f"rank {rank}: differ after the refit: {got['wrong']}"
        assert got["moved"] == [], f"rank {rank}: non-persistent buffers moved: {got['moved']}"
        assert got.get("forward", True), f"rank {rank}: the destination's forward saw old weights"
        held += got["n"]
    assert held > 0, "no rank held a destination tensor"


@pytest.mark.parametrize("name", list(BAD))
def test_dtensor_bad_input_raises_everywhere(name: str, results) -> None:
    _, error, text = BAD[name]
    check_failed_everywhere([per_rank[name] for per_rank in results], error, text)


def test_most_cases_move_bytes_between_ranks(results) -> None:
    """Guards the suite: sharded sources must exercise the transport, not only local copies."""
    remote = [n for n in CASES if sum(r[n].get("remote", 0) for r in results) > 0]
    assert len(remote) >= len(CASES) - 1, remote
