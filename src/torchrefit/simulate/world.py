"""A simulated world: what every rank would hold of a model shape in two layouts, as the
rosters the real ranks would gather, without processes, GPUs or tensors.

Ranks with the same holdings (data-parallel replicas, identical engines) share one
:class:`Coords`, one :class:`ModelLayout` and one roster ``bytes`` object, so a
1024-rank world costs what its distinct holdings cost. Pieces are cut by
:func:`shard_pieces`, as the Megatron adapter cuts a real model's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from ..layout._types import ModelLayout, Piece, TensorLayout
from ..layout.megatron import TIED_OUTPUT, WORD_EMBEDDING
from ..layout.sharding import shard_pieces
from ..plan.roster import encode_roster
from .meshes import Coords, Mesh
from .shapes import GlobalTensor, ModelShape, global_tensors, stage_layers

__all__ = ["SimulatedRole", "simulated_role", "layout_of"]


@dataclass
class SimulatedRole:
    """One role (source or destination) of a simulated world.

    ``class_of[rank]`` indexes ``classes`` (None: the rank holds no such model);
    layouts and roster bytes are built per class on first use.
    """

    shape: ModelShape
    mesh: Mesh
    world: int
    classes: list[Coords]
    class_of: list[int | None]
    _tensors: _ByLayer | None = field(default=None, repr=False)
    _layouts: dict[int, ModelLayout] = field(default_factory=dict, repr=False)
    _blobs: dict[int, bytes] = field(default_factory=dict, repr=False)

    def layout(self, rank: int) -> ModelLayout | None:
        cid = self.class_of[rank]
        if cid is None:
            return None
        got = self._layouts.get(cid)
        if got is None:
            if self._tensors is None:
                self._tensors = _ByLayer(global_tensors(self.shape))
            got = self._layouts[cid] = layout_of(self.shape, self.mesh, self.classes[cid],
                                                 self._tensors)
        return got

    def roster(self, cid: int) -> bytes:
        blob = self._blobs.get(cid)
        if blob is None:
            rank = self.class_of.index(cid)
            blob = self._blobs[cid] = encode_roster(self.layout(rank))
        return blob

    def rosters(self) -> list[bytes | None]:
        """Every rank's roster bytes (replicas share one object), as the gather returns them."""
        return [None if c is None else self.roster(c) for c in self.class_of]


def simulated_role(shape: ModelShape, mesh: Mesh, world: int) -> SimulatedRole:
    """Group the mesh's ranks by what they hold (cheap: no layouts built yet)."""
    if mesh.end > world:
        raise ValueError(f"{mesh.describe()} does not fit a world of {world} ranks")
    _check_fits(shape, mesh)
    index: dict[Coords, int] = {}
    classes: list[Coords] = []
    class_of: list[int | None] = []
    for rank in range(world):
        c = mesh.coords(rank)
        if c is None:
            class_of.append(None)
            continue
        if not shape.experts:
            c = Coords(c.tp, c.pp, 0, 0)  # expert indices do not change a dense model's holdings
        cid = index.get(c)
        if cid is None:
            cid = index[c] = len(classes)
            classes.append(c)
        class_of.append(cid)
    return SimulatedRole(shape, mesh, world, classes, class_of)


def _check_fits(shape: ModelShape, mesh: Mesh) -> None:
    if mesh.pp > shape.layers:
        raise ValueError(f"{mesh.describe()}: PP {mesh.pp} exceeds {shape.layers} layers")
    if shape.experts and shape.experts % mesh.ep:
        raise ValueError(f"{mesh.describe()}: EP {mesh.ep} does not divide {shape.experts} experts")


class _ByLayer:
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


def layout_of(shape: ModelShape, mesh: Mesh, c: Coords, tensors: _ByLayer | None = None) -> ModelLayout:
    """What a rank at ``c`` holds: Megatron-local keys, global names and pieces."""
    layers = stage_layers(shape.layers, mesh.pp, c.pp)
    per_ep = shape.experts // mesh.ep if shape.experts else 0
    index = tensors if tensors is not None else _ByLayer(global_tensors(shape))
    out = []
    for t in index.held(layers, range(c.ep * per_ep, (c.ep + 1) * per_ep)):
        key = _local_key(t, c, mesh, layers, per_ep)
        if key is not None:
            out.append((key, _tensor_layout(shape, t, mesh, c)))
    if shape.tie and mesh.pp > 1 and c.pp == mesh.pp - 1:
        # Megatron keeps a copy of the word embedding on the last stage as the output layer.
        emb = GlobalTensor(TIED_OUTPUT, (shape.vocab, shape.hidden), "tp")
        out.append((TIED_OUTPUT, _tensor_layout(shape, emb, mesh, c)))
    aliases = ((TIED_OUTPUT, WORD_EMBEDDING),) if shape.tie else ()
    return ModelLayout(tuple(out), aliases)


def _local_key(t: GlobalTensor, c: Coords, mesh: Mesh, layers: range, per_ep: int) -> str | None:
    """The local parameter name, or None where this rank does not hold ``t``."""
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
        key = key.replace(f"local_experts.{t.expert}.", f"local_experts.{t.expert % per_ep}.", 1)
    return key


@lru_cache(maxsize=4096)  # many tensors share a cut: shapes repeat per layer and expert
def _cut(local: tuple[int, ...], dim: int, rank: int, size: int,
         stride: int) -> tuple[tuple[int, ...], tuple[Piece, ...]]:
    return shard_pieces(local, dim, rank, size, stride=stride)


def _tensor_layout(shape: ModelShape, t: GlobalTensor, mesh: Mesh, c: Coords) -> TensorLayout:
    rank, size = {"tp": (c.tp, mesh.tp), "etp": (c.etp, mesh.etp)}.get(t.group, (0, 1))
    extent = t.shape[t.dim]
    if extent % (size * t.stride):
        raise ValueError(f"{t.name}: dim {t.dim} of {list(t.shape)} does not divide into "
                         f"{size} shards (stride {t.stride}) of {mesh.describe()}")
    local = t.shape[:t.dim] + (extent // size,) + t.shape[t.dim + 1:]
    gshape, pieces = _cut(local, t.dim, rank, size, t.stride)
    assert gshape == t.shape, (t.name, gshape, t.shape)
    return TensorLayout(t.name, t.shape, t.dtype or shape.dtype, local, pieces, t.buffer)
