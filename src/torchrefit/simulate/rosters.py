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
from .shapes import GlobalTensor, ModelShape, TensorIndex, global_tensors, held_tensors

__all__ = ["SimulatedRosters", "simulated_rosters", "layout_of"]


@dataclass
class SimulatedRosters:
    """One role (source or destination) of a simulated world.

    ``class_of[rank]`` indexes ``classes`` (None: the rank holds no such model);
    layouts and roster bytes are built per class on first use.
    """

    shape: ModelShape
    mesh: Mesh
    world: int
    classes: list[Coords]
    class_of: list[int | None]
    _tensors: TensorIndex | None = field(default=None, repr=False)
    _layouts: dict[int, ModelLayout] = field(default_factory=dict, repr=False)
    _blobs: dict[int, bytes] = field(default_factory=dict, repr=False)

    def layout(self, rank: int) -> ModelLayout | None:
        cid = self.class_of[rank]
        if cid is None:
            return None
        got = self._layouts.get(cid)
        if got is None:
            if self._tensors is None:
                self._tensors = TensorIndex(global_tensors(self.shape))
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


def simulated_rosters(shape: ModelShape, mesh: Mesh, world: int) -> SimulatedRosters:
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
    return SimulatedRosters(shape, mesh, world, classes, class_of)


def _check_fits(shape: ModelShape, mesh: Mesh) -> None:
    if mesh.pp > shape.layers:
        raise ValueError(f"{mesh.describe()}: PP {mesh.pp} exceeds {shape.layers} layers")
    if shape.experts and shape.experts % mesh.ep:
        raise ValueError(f"{mesh.describe()}: EP {mesh.ep} does not divide {shape.experts} experts")


def layout_of(shape: ModelShape, mesh: Mesh, c: Coords, tensors: TensorIndex | None = None) -> ModelLayout:
    """What a rank at ``c`` holds: Megatron-local keys, global names and pieces, as the
    Megatron adapter describes the toy GPT built from the same tensors (non-persistent
    buffers are held, never refitted)."""
    out = [(key, _tensor_layout(shape, t, mesh, c))
           for key, t in held_tensors(shape, mesh, c, tensors) if t.persistent]
    aliases = ((TIED_OUTPUT, WORD_EMBEDDING),) if shape.tie else ()
    return ModelLayout(tuple(out), aliases)


@lru_cache(maxsize=4096)  # many tensors share a cut: shapes repeat per layer and expert
def _cut(local: tuple[int, ...], dim: int, rank: int, size: int, stride: int,
         parts: tuple[int, ...] | None) -> tuple[tuple[int, ...], tuple[Piece, ...]]:
    sizes = None if parts is None else [p // size for p in parts]
    return shard_pieces(local, dim, rank, size, stride=stride, sizes=sizes)


def _tensor_layout(shape: ModelShape, t: GlobalTensor, mesh: Mesh, c: Coords) -> TensorLayout:
    rank, size = {"tp": (c.tp, mesh.tp), "etp": (c.etp, mesh.etp)}.get(t.group, (0, 1))
    extent = t.shape[t.dim]
    if extent % (size * t.stride):
        raise ValueError(f"{t.name}: dim {t.dim} of {list(t.shape)} does not divide into "
                         f"{size} shards (stride {t.stride}) of {mesh.describe()}")
    local = t.shape[:t.dim] + (extent // size,) + t.shape[t.dim + 1:]
    gshape, pieces = _cut(local, t.dim, rank, size, t.stride, t.parts)
    assert gshape == t.shape, (t.name, gshape, t.shape)
    return TensorLayout(t.name, t.shape, t.dtype or shape.dtype, local, pieces, t.buffer)
