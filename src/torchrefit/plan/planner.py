"""The planner: a pure function from gathered rosters to one rank's plan.

Every rank builds the same :class:`Planner` from the same rosters, validates the
whole refit (so that bad input raises the same :class:`PlanError` on every rank
before any byte moves), then plans only its own transfers. Validation visits
every destination tensor once but checks each distinct geometry (shapes, dtypes,
held boxes) once; a rank's own plan costs what it sends and receives plus what
the holder sets it works with hold: never world size times parameters.

Choosing among source replicas: a destination rank that holds the region as a
source copies it locally. The others are shared among the holders by bytes (see
:mod:`.shares`): every region a holder set holds, in the regions' canonical order
(:attr:`Region.order`), so each replica sends an equal share and every rank
derives the same choice from the rosters alone. Sender and receiver name a region
by value (:attr:`Region.id`), never by its position in a list.
"""

from __future__ import annotations

import difflib
import fnmatch
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from .._util.gc_pause import gc_paused
from ..errors import PlanError
from ..layout._types import Box, ModelLayout, TensorLayout, dtype_from_name
from ..maps import Identity, NameMap, Segment, relocate
from ..maps.base import held_name
from ..transforms.fp8 import (
    FP8_DTYPE,
    Target,
    check_targets,
    fp8_targets,
    scale_cells,
    whole_blocks,
)
from .holdings import Holdings, TensorInfo
from .shares import ClassBlock, ShareLine
from .types import LocalCopy, Quantize, RankPlan, Transfer, fp8_send_keys, itemsize, shadow_key

__all__ = ["Region", "RegionId", "Planner", "CastPolicy"]

CastPolicy = bool | str  # True: any dtype change; "buffers": buffers only; False: none

#: tensors without a source whose error suggests close source names: difflib compares a
#: name with every source name, 0.13 s a tensor for a toy GPT on a loaded CPU, and an
#: error lists up to 21 problems (every rank computes them)
_HINTED = 3


@dataclass(frozen=True, slots=True)
class _Problem:
    """One thing :meth:`Planner.validate` found wrong: the destination tensor, its
    destination ranks, the rule broken (``"no source"``, ``"coverage"``, ...), a line."""

    tensor: str
    ranks: tuple[int, ...]
    rule: str
    message: str


RegionId = tuple[str, Box, Box]  # (destination tensor, destination box held, region's box)


@dataclass(frozen=True, slots=True)
class Region:
    """Part ``dst_box`` of the box ``dst_piece`` that destination classes ``dst_classes``
    hold of ``dst_name``, filled from ``src_box`` of ``src_name``, which the source
    classes ``holders`` hold. Every rank builds the same regions from the rosters."""

    dst_name: str
    dst_piece: Box
    dst_classes: tuple[int, ...]
    dst_box: Box
    src_name: str
    src_box: Box
    holders: tuple[int, ...]

    @property
    def id(self) -> RegionId:
        """What names this region on every rank (the regions of a destination box do
        not overlap, so their offsets tell them apart)."""
        return (self.dst_name, self.dst_piece, self.dst_box)

    @property
    def order(self) -> tuple:
        """The canonical order of regions that every rank sorts by."""
        return (self.dst_name, self.dst_piece.offset, self.dst_piece.size, self.dst_box.offset)

    @property
    def rows(self) -> int:
        """Rows (dim 0) of the region: the unit in which replicas share it."""
        return self.dst_box.size[0] if self.dst_box.ndim else 1


class Planner:
    """Planning over the gathered rosters of all ranks (see the module docstring)."""

    def __init__(
        self,
        src: Holdings,
        dst: Holdings,
        name_map: NameMap | None = None,
        *,
        cast: CastPolicy = "buffers",
        skip: Sequence[str] = (),
        sides: str = "",
        fp8_block: tuple[int, int] = (128, 128),
        sender_transforms: bool = True,
    ) -> None:
        if cast not in (True, False, "buffers"):
            raise ValueError(f"cast must be True, False or 'buffers', not {cast!r}")
        self.src = src
        self.dst = dst
        self.name_map = name_map or Identity()
        self.cast = cast
        self.skip = tuple(skip)
        self.sides = sides  # how each side's layout was detected, for error messages
        self.fp8_block = _block(fp8_block)
        # FP8 destinations (transforms.fp8) are quantized on the sender where whole blocks
        # of one source piece fill them (see fp8_at_source), else received in the source's
        # dtype and quantized on the receiver; their scale tensors are derived, never
        # mapped from a source. One-sided transports move bytes as they are, with no
        # sender step before them: sender_transforms=False quantizes their remote
        # regions on the receiver.
        self.fp8 = fp8_targets(dst.tensors)
        self._derived = frozenset(t.scale for t in self.fp8.values())
        self.sender_transforms = sender_transforms
        self._at_source: dict[tuple[str, Box, int], bool] = {}
        # Memos, each filled on first use from the rosters alone (so every rank that asks
        # gets the same answer): what the name map says per destination tensor; the
        # regions of each held destination box; who reads each source tensor.
        self._segments: dict[str, list[Segment] | None] = {}
        self._regions: dict[tuple[str, Box], list[Region]] = {}
        self._consumers: dict[str, list[str]] | None = None
        # Per (destination classes, holder set): the destination ranks that do not hold
        # the region as a source. Per holder set of 2+ ranks: its share line.
        self._receivers: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
        self._share_lines: dict[tuple[int, ...], ShareLine] = {}
        # Geometries found valid: layers and experts repeat the same few, so validating
        # 30,000 tensors costs what their distinct shapes and box sets cost.
        self._valid: set[tuple] = set()

    @classmethod
    def from_rosters(
        cls,
        src: Sequence[bytes | None],
        dst: Sequence[bytes | None],
        name_map: NameMap | None = None,
        *,
        cast: CastPolicy = "buffers",
        skip: Sequence[str] = (),
        sides: str = "",
        fp8_block: tuple[int, int] = (128, 128),
        sender_transforms: bool = True,
    ) -> Planner:
        """The planner over every rank's gathered roster bytes (None: the rank holds no
        such model), as each rank builds it after the gather."""
        return cls(Holdings("source", src), Holdings("destination", dst), name_map,
                   cast=cast, skip=skip, sides=sides, fp8_block=fp8_block,
                   sender_transforms=sender_transforms)

    # ----------------------------------------------------------------- validation
    @gc_paused
    def validate(self) -> None:
        """Check the whole refit; raise one :class:`PlanError` listing what is wrong.

        Deterministic: every rank checks the same rosters in the same order.
        """
        problems = [_Problem(p.partition(":")[0], (), "fp8", p)
                    for p in check_targets(self.fp8, self.dst, self.fp8_block)]
        # Who reads each source tensor, as consumers() builds it: this pass computes
        # every tensor's segments anyway (a second pass cost 30,000 lookups at 16k ranks).
        readers: dict[str, list[str]] = {}
        whole = type(self.name_map).segments is NameMap.segments
        for name in sorted(self.dst.tensors):
            if name in self._derived:
                continue  # an FP8 scale: written by the quantizer
            info = self.dst.tensors[name]
            if whole:  # each tensor whole from one source tensor (Identity, Rename): its
                # geometry and its source's decide, without building its segments
                key = self._whole_key(info, readers)
                if key in self._valid:
                    continue
            try:
                segs = self.segments(name)
            except PlanError as e:  # a name map that finds the shapes do not fit its rule
                ranks = self._dst_rank_tuple(info)
                problems.append(_Problem(name, ranks, e.rule or "name map",
                                         f"{e} (dst ranks {_rank_list(ranks)})"))
                continue
            if segs is None:
                if not self._skipped(name):
                    hinted = sum(p.rule == "no source" for p in problems) < _HINTED
                    problems.append(self._no_source(info, hinted))
                continue
            if not whole:
                _add_reader(readers, segs, name)
                key = self._geometry(info, segs)
                if key in self._valid:
                    continue
            problem = self._check_segments(info, segs) or self._check_coverage(info)
            if problem:
                problems.append(problem)
            else:
                self._valid.add(key)
            if len(problems) > 20:
                break
        if problems:
            raise self._error(problems)
        if self._consumers is None:
            self._consumers = readers

    def _error(self, problems: list[_Problem]) -> PlanError:
        """One short line (the first problem, how many more, what to do where tensors
        have no source); every problem in ``detail``; the first's parts as attributes."""
        first = problems[0]
        more = (f" (and {len(problems) - 1} more; err.detail lists them)"
                if len(problems) > 1 else "")
        advice = (self._no_source_advice() if any(p.rule == "no source" for p in problems)
                  else "")
        return PlanError(first.message + more + advice, tensor=first.tensor, ranks=first.ranks,
                         rule=first.rule,
                         detail="\n".join(p.message for p in problems) + advice)

    def _skipped(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.skip)

    def _dst_rank_tuple(self, info: TensorInfo) -> tuple[int, ...]:
        return self.dst.ranks(sorted({c for cs in info.boxes.values() for c in cs}))

    def _no_source(self, info: TensorInfo, hinted: bool) -> _Problem:
        ranks = self._dst_rank_tuple(info)
        wanted = self.name_map.wanted(info.name) or (info.name,)
        close = (difflib.get_close_matches(wanted[0], sorted(self.src.tensors), n=3, cutoff=0.4)
                 if hinted else ())
        hint = f"; closest source names: {', '.join(map(repr, close))}" if close else ""
        return _Problem(info.name, ranks, "no source", (
            f"{info.name}: destination tensor (dst ranks {_rank_list(ranks)}) has no source "
            f"tensor (no source rank holds {' or '.join(map(repr, wanted))} or an alias of "
            f"it{hint})"))

    def _no_source_advice(self) -> str:
        sides = f" ({self.sides})" if self.sides else ""
        return (f". Tensors without a source{sides}: where the two sides name tensors "
                "differently, pass a name map (name_map=tr.maps.megatron_to_hf(config), "
                "hf_to_vllm(config), torchtitan_to_hf(config) or tr.maps.Rename({...})); "
                "pass skip=[...] only for tensors a refit should leave untouched")

    def _geometry(self, info: TensorInfo, segs: list[Segment]) -> tuple:
        """All that validity depends on: both tensors' shapes, dtypes, kinds and held
        boxes (not names, not which ranks hold them), and where the segments sit."""
        src = self.src
        if len(segs) == 1:  # the usual case, without a generator per tensor
            seg = segs[0]
            return (self.dst.geometry(info), seg.dst_box, seg.src_offset, seg.part,
                    src.geometry(src.tensors[seg.src_name]))
        return (self.dst.geometry(info), tuple(
            (seg.dst_box, seg.src_offset, seg.part, src.geometry(src.tensors[seg.src_name]))
            for seg in segs))

    def _whole_key(self, info: TensorInfo, readers: dict[str, list[str]]) -> tuple | None:
        """:meth:`_geometry` for a map that takes each tensor whole from one source tensor
        (its one segment is the whole tensor at the origin: the shapes in the two
        geometries say where it sits), and note the reader; None without a source."""
        src_name = held_name(self.name_map.source_name(info.name), self.src.tensors,
                             self.src.aliases)
        if src_name is None:
            return None
        readers.setdefault(src_name, []).append(info.name)  # names come once, in order
        return ("whole", self.dst.geometry(info), self.src.geometry(self.src.tensors[src_name]))

    def _check_segments(self, info: TensorInfo, segs: list[Segment]) -> _Problem | None:
        for seg in segs:
            rule, message = self._segment_problem(info, seg)
            if message:
                return _Problem(info.name, self._dst_rank_tuple(info), rule, message)
        return None

    def _segment_problem(self, info: TensorInfo, seg: Segment) -> tuple[str, str]:
        """``(rule, message)`` of what is wrong with one segment, ``("", "")`` if nothing."""
        src_info = self.src.tensors[seg.src_name]
        if len(seg.src_offset) != len(src_info.shape):
            return "dims", (f"{info.name}: the name map reads {seg.src_name} "
                            f"{list(src_info.shape)} at {list(seg.src_offset)}, which has "
                            "another number of dims")
        src_box = relocate(seg.dst_box, seg.dst_box.offset, seg.src_offset)
        if (not seg.part and seg.dst_box == Box.whole(info.shape)
                and src_info.shape != info.shape):
            return "global shape", _shape_problem(info, src_info)
        if not seg.dst_box.within(info.shape) or not src_box.within(src_info.shape):
            return "bounds", (
                f"{info.name}: the name map places {seg.dst_box} of it at {src_box} of "
                f"{seg.src_name} {list(src_info.shape)}, outside one of the two tensors")
        if (src_info.dtype != info.dtype and info.name not in self.fp8
                and not self._may_cast(info)):
            return "dtype", (
                f"{info.name}: dtype mismatch with no cast: source {seg.src_name} is "
                f"{src_info.dtype} (src rank {src_info.first_rank}), destination is "
                f"{info.dtype} (dst rank {info.first_rank}); pass cast=True to convert")
        return "", ""

    def _may_cast(self, dst_info: TensorInfo) -> bool:
        return self.cast is True or (self.cast == "buffers" and dst_info.is_buffer)

    def _check_coverage(self, info: TensorInfo) -> _Problem | None:
        pads = self.name_map.padding(info.name, info.shape, self.src.tensors, self.src.aliases)
        for box, class_ids in info.boxes.items():
            parts = [r.dst_box for r in self.regions(info.name, box)]
            parts += [i for p in pads if (i := box.intersect(p)) is not None]
            covered = sum(b.numel for b in parts)
            # as many elements as the box, yet two parts overlap: as many others have none
            twice = covered == box.numel and _overlapping(parts)
            if covered != box.numel or twice:
                ranks = self.dst.ranks(class_ids)
                held = self._source_boxes(info.name)
                if covered < box.numel:
                    what = f"{box.numel - covered} of {box.numel} elements have no source"
                else:
                    what = "some elements are covered more than once"
                    what += " and as many have no source" if twice else ""
                return _Problem(info.name, ranks, "coverage", (
                    f"{info.name}: destination region {box} (dst ranks {_rank_list(ranks)}) is "
                    f"not covered exactly once by the source: {what}; source ranks hold {held}"))
        return None

    def _source_boxes(self, dst_name: str) -> str:
        parts = []
        for seg in self.segments(dst_name) or ():
            boxes = sorted(self.src.tensors[seg.src_name].boxes, key=lambda b: b.offset)
            parts.append(f"{seg.src_name} {[str(b) for b in boxes[:6]]}")
        return "; ".join(parts)

    # --------------------------------------------------------------- name mapping
    def segments(self, dst_name: str) -> list[Segment] | None:
        got = self._segments.get(dst_name, _UNSET)
        if got is _UNSET:
            if dst_name in self._derived:
                got = None
            else:
                info = self.dst.tensors[dst_name]
                got = self.name_map.segments(dst_name, info.shape, self.src.tensors,
                                             self.src.aliases)
            self._segments[dst_name] = got
        return got

    def consumers(self, src_name: str) -> list[str]:
        """Destination tensors that read from ``src_name`` (built once, for senders)."""
        if self._consumers is None:
            table: dict[str, list[str]] = {}
            for name in sorted(self.dst.tensors):
                _add_reader(table, self.segments(name) or (), name)
            self._consumers = table
        return self._consumers.get(src_name, [])

    # -------------------------------------------------------------------- regions
    def regions(self, dst_name: str, dst_box: Box) -> list[Region]:
        """How the held box ``dst_box`` of ``dst_name`` splits over source boxes, in
        :attr:`Region.order`."""
        key = (dst_name, dst_box)
        got = self._regions.get(key)
        if got is None:
            dst_classes = tuple(self.dst.tensors[dst_name].boxes[dst_box])
            segs = self.segments(dst_name) or ()
            got = self._whole_region(dst_name, dst_box, dst_classes, segs)
            if got is None:
                got = []
                for seg in segs:
                    part = dst_box.intersect(seg.dst_box)
                    if part is not None:
                        got.extend(self._cover(dst_name, dst_box, dst_classes, part, seg))
                got.sort(key=lambda r: r.dst_box.offset)
            self._regions[key] = got
        return got

    def _whole_region(self, dst_name: str, dst_box: Box, dst_classes: tuple[int, ...],
                      segs: Sequence[Segment]) -> list[Region] | None:
        """The one region of a box filled from the same box of a source tensor that one
        set of classes holds whole-box (every TP1 tensor, every expert at expert-TP1, a
        replicated norm): what :meth:`_cover` would find, without its search (a
        qwen3-30b-a3b-shaped toy's 2091 regions, 8 layers: 5.8 ms against 8.3 ms on a
        2-core CPU). None for every other case, which :meth:`_cover` then plans."""
        if len(segs) != 1:
            return None
        seg = segs[0]
        if seg.dst_box != dst_box or any(seg.src_offset) or any(dst_box.offset):
            return None
        boxes = self.src.tensors[seg.src_name].boxes
        if len(boxes) != 1:
            return None
        (box, class_ids), = boxes.items()
        if box != dst_box:
            return None
        return [Region(dst_name, dst_box, dst_classes, box, seg.src_name, box, tuple(class_ids))]

    def _cover(self, dst_name: str, dst_piece: Box, dst_classes: tuple[int, ...], part: Box,
               seg: Segment) -> list[Region]:
        src_part = relocate(part, seg.dst_box.offset, seg.src_offset)
        src_info = self.src.tensors[seg.src_name]
        hits = []
        for box, class_ids in src_info.boxes.items():
            inter = box.intersect(src_part)
            if inter is not None:
                hits.append((inter, class_ids))
        if not src_info.disjoint and len(hits) > 1:
            hits = _grid_cells(src_part, hits)
        return [
            Region(dst_name, dst_piece, dst_classes,
                   relocate(inter, seg.src_offset, seg.dst_box.offset), seg.src_name, inter,
                   tuple(class_ids))
            for inter, class_ids in hits
        ]

    # ------------------------------------------------------------- replica choice
    def _remote_receivers(self, region: Region) -> list[int]:
        """Destination ranks holding the region's box, less those that hold the region
        as a source (they copy it locally)."""
        key = (region.dst_classes, region.holders)
        got = self._receivers.get(key)
        if got is None:
            got = self._receivers[key] = _without(
                self.dst.ranks(region.dst_classes), set(self.src.ranks(region.holders)))
        return got

    def sources(self, region: Region, rank: int) -> list[tuple[int, Box]]:
        """Who fills ``region`` on destination ``rank``: ``(source rank, part of the
        region)``, parts in row order; ``rank`` itself where it holds the region as a
        source (a local copy). Receivers call this; :meth:`destinations` is its mirror."""
        holders = self.src.ranks(region.holders)
        k = bisect_left(holders, rank)
        if k < len(holders) and holders[k] == rank:
            return [(rank, region.dst_box)]
        if len(holders) == 1:
            return [(holders[0], region.dst_box)]
        parts = self.share_line(region.holders).senders(self.dst.rank_class[rank], rank,
                                                         region.id)
        return [(holders[h], region.dst_box.rows(lo, hi)) for h, lo, hi in parts]

    def destinations(self, region: Region, rank: int) -> list[tuple[int, Box]]:
        """What source ``rank`` sends of ``region``: ``(destination rank, part of the
        region)``, as :meth:`sources` decides on the receiving ranks."""
        holders = self.src.ranks(region.holders)
        k = bisect_left(holders, rank)
        if k == len(holders) or holders[k] != rank:
            return []
        if len(holders) == 1:
            return [(d, region.dst_box) for d in self._remote_receivers(region)]
        sent = self.share_line(region.holders).sent_by(k).get(region.id, ())
        return [(d, region.dst_box.rows(lo, hi)) for d, lo, hi in sent]

    def local_ranks(self, dst_classes: tuple[int, ...], holders: tuple[int, ...]) -> list[int]:
        """Destination ranks of ``dst_classes`` that hold what source classes ``holders``
        hold, so copy such regions locally (for whole-world summaries)."""
        held = set(self.src.ranks(holders))
        return [r for r in self.dst.ranks(dst_classes) if r in held]

    def wire_bytes(self, region: Region) -> int:
        """Bytes of one transfer of a whole region (in the wire dtype)."""
        return region.dst_box.numel * itemsize(self.wire_dtype(region.src_name, region.dst_name))

    def local_dtype(self, dst_name: str, src_dtype: str) -> str:
        """The dtype a destination rank writes: an FP8 target's shadow holds the source's."""
        return src_dtype if dst_name in self.fp8 else self.dst.tensors[dst_name].dtype

    def wire_dtype(self, src_name: str, dst_name: str) -> str:
        """The narrower of the two where a cast narrows a floating dtype (the sender
        converts, so the wire carries half the bytes of fp32 -> bf16), else the source's."""
        src = self.src.tensors[src_name].dtype
        dst = self.local_dtype(dst_name, src)
        if src == dst or not _narrows(src, dst):
            return src
        return dst

    def share_line(self, holders: tuple[int, ...]) -> ShareLine:
        """The share line of a holder set (see :mod:`.shares`), built on first use.

        Only the source tensors some of whose boxes the set holds can hold its regions
        (:meth:`Holdings.held_by`): work in proportion to what the set holds.
        """
        line = self._share_lines.get(holders)
        if line is not None:
            return line
        regions = [r for src_name in self.src.held_by(holders)
                   for name in self.consumers(src_name)
                   for box in self.dst.tensors[name].boxes
                   for r in self.regions(name, box)
                   if r.src_name == src_name and r.holders == holders]
        regions.sort(key=lambda r: r.order)
        held = set(self.src.ranks(holders))
        blocks: dict[int, ClassBlock] = {}
        for r in regions:
            for c in r.dst_classes:
                b = blocks.get(c)
                if b is None:
                    b = blocks[c] = ClassBlock(_without(self.dst.members[c], held))
                b.add(r.id, self.wire_bytes(r), r.rows)
        line = self._share_lines[holders] = ShareLine(len(held), blocks)
        return line

    # ------------------------------------------------------------------ rank plan
    @gc_paused
    def plan_rank(
        self, rank: int, world: int, src: ModelLayout | None, dst: ModelLayout | None
    ) -> RankPlan:
        """This rank's local copies, sends and receives (call after :meth:`validate`)."""
        src_by_name = {t.name: (k, t) for k, t in src} if src is not None else {}
        local, recvs, steps = (self._receiving(rank, dst, src_by_name) if dst is not None
                               else ([], [], []))
        sends, staged = self._sending(rank, src) if src is not None else ([], [])
        return RankPlan.ordered(rank, world, local, sends, recvs, steps + staged)

    def _receiving(self, rank, dst: ModelLayout, src_by_name) -> tuple[list, list, list]:
        local: list[LocalCopy] = []
        recvs: list[Transfer] = []
        steps: list[Quantize] = []
        by_name = {t.name: (k, t) for k, t in dst}
        for key, t in dst:
            if self.segments(t.name) is None:
                continue  # skipped on purpose (validate() rejected the rest)
            target = self.fp8.get(t.name)
            for piece in t.pieces:
                if target is None:
                    self._fill(rank, t, key, piece, src_by_name, local, recvs)
                elif self.fp8_at_source(t.name, piece.box, rank):
                    self._fill_quantized(rank, t, key, piece, target, by_name, src_by_name,
                                         recvs, steps)
                else:  # the exchange fills a shadow in the source's dtype, quantized after
                    self._fill(rank, t, shadow_key(key), piece, src_by_name, local, recvs)
                    scale_key, scale_box = self._scale_place(by_name, target, piece, piece.box)
                    src_dtype = self.local_dtype(t.name, self._first_src_dtype(t.name))
                    steps.append(Quantize(t.name, piece.box, shadow_key(key), piece.local_box, key,
                                          piece.local_box, scale_key, scale_box, src_dtype,
                                          target.per_tensor, received=True))
        return local, recvs, steps

    def _fill(self, rank, t: TensorLayout, key: str, piece, src_by_name, local, recvs) -> None:
        """Copies and receives that fill ``piece`` of ``t`` into local tensor ``key``."""
        for region in self.regions(t.name, piece.box):
            src_dtype = self.src.tensors[region.src_name].dtype
            dtype = self.local_dtype(t.name, src_dtype)
            for peer, part in self.sources(region, rank):
                local_box = part.moved(piece.box.offset, piece.local_offset)
                if peer == rank:
                    src_key, src_box = _local_source(src_by_name, region)
                    local.append(LocalCopy(t.name, part, src_key, src_box, key, local_box,
                                           src_dtype, dtype))
                else:
                    recvs.append(Transfer(peer, t.name, part, key, local_box,
                                          self.wire_dtype(region.src_name, t.name), dtype))

    def _fill_quantized(self, rank, t: TensorLayout, key: str, piece, target: Target, by_name,
                        src_by_name, recvs, steps) -> None:
        """Quantize ``piece`` from a local source, or receive it as FP8 and scales."""
        scale_dtype = self.dst.tensors[target.scale].dtype
        for region in self.regions(t.name, piece.box):
            for peer, part in self.sources(region, rank):
                local_box = part.moved(piece.box.offset, piece.local_offset)
                scale_key, scale_box = self._scale_place(by_name, target, piece, part)
                if peer == rank:
                    src_key, src_box = _local_source(src_by_name, region)
                    steps.append(Quantize(t.name, part, src_key, src_box, key, local_box,
                                          scale_key, scale_box,
                                          self.src.tensors[region.src_name].dtype,
                                          target.per_tensor, received=False))
                else:
                    recvs.append(Transfer(peer, t.name, part, key, local_box, FP8_DTYPE, FP8_DTYPE))
                    recvs.append(Transfer(peer, target.scale, self._cells(target, part),
                                          scale_key, scale_box, scale_dtype, scale_dtype))

    def _cells(self, target: Target, part: Box) -> Box:
        """The scale cells of ``part``: its block cells, or the one per-tensor scale."""
        if target.per_tensor:
            return Box.whole(self.dst.tensors[target.scale].shape)
        return scale_cells(part, self.fp8_block)

    def _scale_place(self, by_name, target: Target, piece, part: Box) -> tuple[str, Box]:
        """Local key and box of the scales of ``part`` (inside ``piece``) on this rank."""
        key, sl = by_name[target.scale]
        if target.per_tensor:
            return key, sl.pieces[0].local_box
        cells, held = scale_cells(part, self.fp8_block), scale_cells(piece.box, self.fp8_block)
        sp = next(p for p in sl.pieces if p.box == held)  # check_targets made sure it exists
        return key, cells.moved(sp.box.offset, sp.local_offset)

    def _first_src_dtype(self, dst_name: str) -> str:
        return self.src.tensors[self.segments(dst_name)[0].src_name].dtype

    def fp8_at_source(self, name: str, dst_piece: Box, rank: int) -> bool:
        """Whether destination ``rank``'s piece ``dst_piece`` of FP8 target ``name`` is
        quantized from the source: every part that fills it (:meth:`sources`) is whole
        blocks (for a per-tensor scale, the whole tensor) of one source piece, and, where
        a part comes from another rank, the transport lets senders transform. Else the
        piece is received in the source's dtype and quantized on the receiver. Senders
        ask it about their receivers, receivers about themselves: the same answer."""
        key = (name, dst_piece, rank)
        got = self._at_source.get(key)
        if got is None:
            target, shape = self.fp8[name], self.dst.tensors[name].shape
            got = all(
                (peer == rank or self.sender_transforms)
                and (part == Box.whole(shape) if target.per_tensor
                     else whole_blocks(part, shape, self.fp8_block))
                for region in self.regions(name, dst_piece)
                for peer, part in self.sources(region, rank))
            self._at_source[key] = got
        return got

    def _sending(self, rank: int, src: ModelLayout) -> tuple[list[Transfer], list[Quantize]]:
        sends: list[Transfer] = []
        staged: dict[tuple[str, Box], Quantize] = {}
        for key, t in src:
            for name in self.consumers(t.name):
                target = self.fp8.get(name)
                for dst_box in self.dst.tensors[name].boxes:
                    for region in self.regions(name, dst_box):
                        if region.src_name != t.name:
                            continue
                        sent = self.destinations(region, rank)
                        if not sent:  # every holder of it copies locally (collocated TP1 -> TP1)
                            continue
                        wire = self.wire_dtype(t.name, name)
                        for peer, part in sent:
                            src_box = _box_in(t, relocate(part, region.dst_box.offset,
                                                          region.src_box.offset))
                            if target is not None and self.fp8_at_source(name, dst_box, peer):
                                self._send_quantized(peer, name, part, key, src_box, t.dtype,
                                                     target, sends, staged)
                            else:
                                sends.append(Transfer(peer, name, part, key, src_box, wire,
                                                      t.dtype))
        return sends, list(staged.values())

    def _send_quantized(self, peer: int, name: str, part: Box, key: str, src_box: Box,
                        src_dtype: str, target: Target, sends, staged) -> None:
        """Send ``part`` as FP8 and scales, quantized once into FP8 buffers (several
        receivers of the same part share them)."""
        cells = self._cells(target, part)
        step = staged.get((name, part))
        if step is None:
            values, scales = fp8_send_keys(name, part)
            step = staged[(name, part)] = Quantize(
                name, part, key, src_box, values, Box.whole(part.size), scales,
                Box.whole(cells.size), src_dtype, target.per_tensor, received=False, staged=True)
        scale_dtype = self.dst.tensors[target.scale].dtype
        sends.append(Transfer(peer, name, part, step.dst_key, step.dst_box, FP8_DTYPE, FP8_DTYPE))
        sends.append(Transfer(peer, target.scale, cells, step.scale_key, step.scale_box,
                              scale_dtype, scale_dtype))


_UNSET = object()  # a memo's "not computed yet" (None is an answer: no source)


def _overlapping(boxes: Sequence[Box]) -> bool:
    """Whether two of ``boxes`` share an element. A sweep along dim 0: a box is compared
    only with those still open where it starts (stacked experts: one at a time)."""
    if len(boxes) < 2:
        return False
    if not boxes[0].ndim:
        return True  # two parts of a 0-dim tensor: both are its one element
    open_: list[Box] = []
    for box in sorted(boxes, key=lambda b: b.offset):
        start = box.offset[0]
        open_ = [b for b in open_ if b.offset[0] + b.size[0] > start]
        if any(b.intersect(box) is not None for b in open_):
            return True
        open_.append(box)
    return False


def _without(ranks: Sequence[int], held: set[int]) -> list[int]:
    """``ranks`` (ascending) less ``held``, ascending: set operations in C where they
    meet (a destination class of 2048 ranks against a holder set of 1024, at 16k ranks)."""
    if held.isdisjoint(ranks):
        return list(ranks)
    return sorted(set(ranks).difference(held))


def _add_reader(table: dict[str, list[str]], segs, name: str) -> None:
    """Note that destination ``name`` reads the source tensors of ``segs`` (each once)."""
    for seg in segs:
        users = table.setdefault(seg.src_name, [])
        if not users or users[-1] != name:
            users.append(name)


def _narrows(src: str, dst: str) -> bool:
    a, b = dtype_from_name(src), dtype_from_name(dst)
    return a.is_floating_point and b.is_floating_point and b.itemsize < a.itemsize


def _block(block) -> tuple[int, int]:
    block = tuple(int(b) for b in block)
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"fp8_block must be two positive sizes (rows, columns), not {block}")
    return block


def _local_source(src_by_name, region: Region) -> tuple[str, Box]:
    key, t = src_by_name[region.src_name]
    return key, _box_in(t, region.src_box)


def _box_in(t: TensorLayout, global_box: Box) -> Box:
    """Where a global box this rank holds sits in its local tensor."""
    for p in t.pieces:
        if p.box.contains(global_box):
            return global_box.moved(p.box.offset, p.local_offset)
    raise AssertionError(f"{t.name}: {global_box} is not inside one local piece")


def _grid_cells(part: Box, hits: list[tuple[Box, list[int]]]) -> list[tuple[Box, list[int]]]:
    """Split a region that overlapping source boxes cover into cells of one holder set."""
    cuts = []
    for d in range(part.ndim):
        points = {part.offset[d], part.end[d]}
        for box, _ in hits:
            points.update((box.offset[d], box.end[d]))
        cuts.append(sorted(points))
    cells = [((), ())]
    for d in range(part.ndim):
        cells = [(o + (a,), s + (b - a,)) for o, s in cells for a, b in zip(cuts[d], cuts[d][1:])]
    out = []
    for off, size in cells:
        cell = Box(off, size)
        class_ids = sorted({c for box, cs in hits if box.contains(cell) for c in cs})
        if class_ids:
            out.append((cell, class_ids))
    return out


def _shape_problem(dst_info: TensorInfo, src_info: TensorInfo) -> str:
    msg = (
        f"{dst_info.name}: global shapes differ: source {list(src_info.shape)} (src rank "
        f"{src_info.first_rank}) vs destination {list(dst_info.shape)} (dst rank {dst_info.first_rank})"
    )
    if len(src_info.shape) == len(dst_info.shape):
        for d, (s, t) in enumerate(zip(src_info.shape, dst_info.shape)):
            if s == t:
                continue
            dsizes = sorted({b.size[d] for b in dst_info.boxes})
            ssizes = sorted({b.size[d] for b in src_info.boxes})
            if len(dsizes) == 1 and dsizes[0] and t % dsizes[0] == 0 and t > dsizes[0] and s % dsizes[0]:
                msg += (f"; dim {d}: {s} does not divide into the destination's "
                        f"{t // dsizes[0]} shards of {dsizes[0]}")
            elif len(ssizes) == 1 and ssizes[0] and s % ssizes[0] == 0 and s > ssizes[0] and t % ssizes[0]:
                msg += (f"; dim {d}: {t} does not divide into the source's "
                        f"{s // ssizes[0]} shards of {ssizes[0]}")
            break
    return msg


def _rank_list(ranks: Sequence[int], n: int = 8) -> str:
    """The first ``n`` ranks, and how many there are where there are more."""
    ranks = list(ranks)
    return str(ranks) if len(ranks) <= n else f"{ranks[:n]}... ({len(ranks)} ranks)"
