"""Simulate a refit end to end and report what it moves and what planning costs.

:func:`simulate` builds the rosters of a simulated world (one per distinct
holding), totals the traffic of every rank, and times *pure planning from
rosters* on sampled ranks: what a real rank does after the one metadata gather
(index the rosters, validate the whole refit, plan its own part), from fresh
copies of the gathered bytes. Used by ``torchrefit plan`` and the benchmarks.
"""

from __future__ import annotations

import gc
import math
import pickle
import resource
import sys
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ..layout._types import ModelLayout
from ..plan.metadata import Gathered, record_bytes, ref_of
from ..plan.planner import Planner
from ..plan.types import RankPlan, itemsize
from .meshes import Mesh
from .predict import Hardware, Prediction, predict
from .rosters import SimulatedRosters, simulated_rosters
from .shapes import ModelShape, global_tensors
from .traffic import Traffic, traffic

__all__ = ["RankTiming", "PlanReport", "Simulation", "simulate", "time_rank", "peak_rss_bytes"]


@dataclass(frozen=True)
class RankTiming:
    """Seconds one rank spends planning from gathered rosters, by step."""

    rank: int
    seconds: float
    index_seconds: float
    validate_seconds: float
    plan_seconds: float
    sends: int
    recvs: int
    cpu_seconds: float  # this process's CPU time for the same steps (a loaded machine inflates wall time)


@dataclass(frozen=True)
class PlanReport:
    """The figures of one simulated refit (bytes are bytes; seconds are wall clock)."""

    model: str
    src: str
    dst: str
    world: int
    tensors: int
    params: int
    model_bytes: int
    src_classes: int
    dst_classes: int
    bytes_total: int
    bytes_remote: int
    bytes_local: int
    local_fraction: float
    max_sent: int
    mean_sent: float
    senders_possible: int
    max_received: int
    mean_received: float
    links: int
    max_link: int
    mean_link: float
    max_send_over_mean: float
    max_send_over_floor: float
    metadata_bytes_per_rank: int
    metadata_bytes_gathered: int  # by every rank: records, then each distinct roster once
    metadata_bytes_gathered_full: int  # were every rank's roster gathered (the replicas' too)
    metadata_broadcasts: int  # owners of distinct rosters: one broadcast each
    pickled_layout_bytes_per_rank: int
    plan_seconds: float
    slowest_rank: int
    timings: tuple[RankTiming, ...]
    peak_rss_bytes: int
    plan_alloc_peak_bytes: int
    simulate_seconds: float
    simulate_cpu_seconds: float
    prediction: Prediction

    def to_json(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        """The report as text, for people."""
        slow = next(t for t in self.timings if t.rank == self.slowest_rank)
        return [
            f"model        {self.model}: {self.tensors} tensors, {self.params / 1e9:.2f} B parameters, "
            f"{_gb(self.model_bytes)}",
            f"source       {self.src} ({_rosters(self.src_classes)})",
            f"destination  {self.dst} ({_rosters(self.dst_classes)})",
            f"moves        {_gb(self.bytes_total)} in all: {_gb(self.bytes_remote)} between ranks, "
            f"{_gb(self.bytes_local)} by local copy ({self.local_fraction:.1%} local)",
            f"per rank     sent: max {_gb(self.max_sent)}, mean {_gb(self.mean_sent)} over the "
            f"{self.senders_possible} ranks that could send; received: max "
            f"{_gb(self.max_received)}, mean {_gb(self.mean_received)}",
            f"per link     {self.links} rank pairs move bytes: max {_gb(self.max_link)}, "
            f"mean {_gb(self.mean_link)}",
            f"balance      busiest sender {self.max_send_over_mean:.3f}x the mean; "
            f"{self.max_send_over_floor:.3f}x the least any choice of replicas allows",
            f"metadata     {self.metadata_bytes_per_rank} B per rank (rosters; "
            f"{self.pickled_layout_bytes_per_rank} B as pickled layout objects); every rank "
            f"gathers {self.metadata_bytes_gathered / 1e6:.2f} MB (a digest from each rank, "
            f"then {self.src_classes + self.dst_classes} distinct rosters once each, in "
            f"{self.metadata_broadcasts} broadcasts) instead of "
            f"{self.metadata_bytes_gathered_full / 1e6:.2f} MB of every rank's roster",
            f"planning     {self.plan_seconds:.3f} s on the slowest of {len(self.timings)} sampled "
            f"ranks ({slow.cpu_seconds:.3f} s CPU; rank {slow.rank}: index {slow.index_seconds:.3f} s, validate "
            f"{slow.validate_seconds:.3f} s, plan {slow.plan_seconds:.3f} s; "
            f"{slow.sends} sends, {slow.recvs} receives)",
            f"memory       planner allocations peak {self.plan_alloc_peak_bytes / 1e6:.1f} MB; this "
            f"process peaked at {self.peak_rss_bytes / 1e6:.0f} MB resident (torch and the "
            "simulated world included)",
            f"predicted    {self.prediction.line()}",
        ]


@dataclass(frozen=True)
class Simulation:
    """A simulated refit: its report, whole-world traffic and the two simulated roles."""

    report: PlanReport
    traffic: Traffic
    src: SimulatedRosters
    dst: SimulatedRosters

    def plan(self, rank: int) -> RankPlan:
        """Rank ``rank``'s plan, planned as that rank would plan it."""
        s, d = self.src, self.dst
        return time_rank(s.rosters(), d.rosters(), rank, s.world, s.layout(rank), d.layout(rank))[1]


def simulate(shape: ModelShape, src: Mesh, dst: Mesh, world: int, *, model: str = "custom",
             samples: int = 8, ranks: Sequence[int] = (),
             hardware: Hardware | None = None) -> Simulation:
    """Simulate the refit of ``shape`` from ``src`` to ``dst`` over ``world`` ranks; time
    ``samples`` ranks (both ends, evenly spaced, the busiest) plus ``ranks``; predict
    the refit's time on ``hardware`` (default :class:`Hardware`: 8-GPU H100/H200 nodes)."""
    t0, c0 = time.perf_counter(), time.process_time()
    s, d = simulated_rosters(shape, src, world), simulated_rosters(shape, dst, world)
    src_blobs, dst_blobs = s.rosters(), d.rosters()
    planner = Planner.from_rosters(src_blobs, dst_blobs)
    planner.validate()
    moves = traffic(planner, world)
    del planner
    sample = _sample(moves, world, samples, ranks, s, d)
    for r in sample:  # build the sampled ranks' own layouts before the clock starts
        s.layout(r), d.layout(r)
    gc.collect()
    gc.freeze()  # the simulated world is not part of any rank: keep it out of GC passes
    try:
        timings = [time_rank(src_blobs, dst_blobs, r, world, s.layout(r), d.layout(r))[0]
                   for r in sample]
        slowest = max(timings, key=lambda t: t.seconds)
        alloc = _alloc_peak(src_blobs, dst_blobs, slowest.rank, world, s, d)
    finally:
        gc.unfreeze()
    tensors = [t for t in global_tensors(shape) if t.persistent]  # what a refit moves
    report = _report(shape, model, s, d, world, moves, timings, slowest, alloc, tensors,
                     predict(moves, hardware or Hardware()),
                     (time.perf_counter() - t0, time.process_time() - c0))
    return Simulation(report, moves, s, d)


def time_rank(src_blobs: Sequence[bytes | None], dst_blobs: Sequence[bytes | None], rank: int,
              world: int, src: ModelLayout | None,
              dst: ModelLayout | None) -> tuple[RankTiming, RankPlan]:
    """Plan one rank from gathered roster bytes, timed by step (fresh copies of the bytes,
    as a gather delivers them: replicas' rosters are equal, not the same object)."""
    src_blobs, dst_blobs = _fresh(src_blobs), _fresh(dst_blobs)
    c0 = time.process_time()
    t0 = time.perf_counter()
    planner = Planner.from_rosters(src_blobs, dst_blobs)
    t1 = time.perf_counter()
    planner.validate()
    t2 = time.perf_counter()
    plan = planner.plan_rank(rank, world, src, dst)
    t3 = time.perf_counter()
    return RankTiming(rank, t3 - t0, t1 - t0, t2 - t1, t3 - t2, len(plan.sends),
                      len(plan.recvs), time.process_time() - c0), plan


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _fresh(blobs: Sequence[bytes | None]) -> list[bytes | None]:
    """A copy as the deduplicated gather delivers it: one new object per distinct
    roster, shared by the ranks that hold it (see :mod:`torchrefit.plan.metadata`)."""
    copies: dict[int, bytes] = {}
    out: list[bytes | None] = []
    for b in blobs:
        if b is None:
            out.append(None)
            continue
        got = copies.get(id(b))
        if got is None:
            got = copies[id(b)] = bytes(bytearray(b))
        out.append(got)
    return out


def _alloc_peak(src_blobs, dst_blobs, rank: int, world: int, s: SimulatedRosters,
                d: SimulatedRosters) -> int:
    """Peak bytes the planner allocates for one rank (tracemalloc: a separate, slower run)."""
    src_copy, dst_copy = _fresh(src_blobs), _fresh(dst_blobs)
    tracemalloc.start()
    try:
        planner = Planner.from_rosters(src_copy, dst_copy)
        planner.validate()
        planner.plan_rank(rank, world, s.layout(rank), d.layout(rank))
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _sample(moves: Traffic, world: int, samples: int, extra: Sequence[int], s: SimulatedRosters,
            d: SimulatedRosters) -> list[int]:
    """Ranks to time: both ends, evenly spaced ones, the busiest sender and receiver."""
    active = [r for r in range(world) if s.class_of[r] is not None or d.class_of[r] is not None]
    picked = {active[0], active[-1]} if samples > 1 else set()
    step = max(1, len(active) // max(1, samples - 4))
    picked.update(active[::step][: max(0, samples - 4)])
    sent, received = moves.sent(), moves.received()
    picked.add(max(range(world), key=sent.__getitem__))
    picked.add(max(range(world), key=received.__getitem__))
    for r in extra:
        if not 0 <= r < world:
            raise ValueError(f"rank {r} is outside the world of {world} ranks")
        picked.add(r)
    return sorted(picked)


def _metadata(s: SimulatedRosters, d: SimulatedRosters, world: int,
              hardware: Hardware) -> tuple[int, Gathered, int, int]:
    """(largest roster bytes one rank contributes, what every rank gathers, what it would
    gather were every rank's roster sent, the same rank's layouts pickled as objects:
    what gathering per-parameter objects would cost)."""
    per_rank, refs, records = [], [], []
    by_class = [{c: ref_of(role.roster(c)) for c in range(len(role.classes))} for role in (s, d)]
    for r in range(world):
        mine = tuple(None if role.class_of[r] is None else got[role.class_of[r]]
                     for role, got in zip((s, d), by_class))
        refs.append(mine)
        per_rank.append(sum(ref.size for ref in mine if ref is not None))
        records.append(record_bytes(_record(r, hardware), mine))
    big = max(range(world), key=per_rank.__getitem__)
    layouts = tuple(role.layout(big) for role in (s, d))
    return (per_rank[big], Gathered.of(records, refs), sum(per_rank),
            len(pickle.dumps(layouts, protocol=5)))


def _record(rank: int, hardware: Hardware) -> tuple:
    """What a Refitter on ``rank`` sends besides its digests (``refitter._RankInfo`` as a
    tuple: no error, no rosters, the default message-pool budget, CUDA, NCCL and Gloo, its
    host name, how its layouts were found)."""
    return (None, None, None, 1 << 30, "cuda", True, True,
            f"gpu-node-{hardware.node(rank):05d}.cluster.local", ("megatron", "megatron"))


def _report(shape, model, s, d, world, moves: Traffic, timings, slowest, alloc, tensors,
            prediction: Prediction, seconds: tuple[float, float]) -> PlanReport:
    sent, received = moves.sent(), moves.received()
    receivers = [received[r] for r in range(world) if d.class_of[r] is not None]
    links = moves.links()
    meta, gathered, full, pickled = _metadata(s, d, world, prediction.hardware)
    params = sum(math.prod(t.shape) for t in tensors if not t.buffer)
    nbytes = sum(math.prod(t.shape) * itemsize(t.dtype or shape.dtype) for t in tensors)
    remote, local = moves.bytes_remote, moves.bytes_local
    return PlanReport(
        model=model, src=s.mesh.describe(), dst=d.mesh.describe(), world=world,
        tensors=len(tensors), params=params, model_bytes=nbytes, src_classes=len(s.classes),
        dst_classes=len(d.classes), bytes_total=remote + local, bytes_remote=remote,
        bytes_local=local, local_fraction=local / (remote + local) if remote + local else 0.0,
        max_sent=max(sent), mean_sent=moves.mean_send(), senders_possible=len(moves.candidates),
        max_received=max(received),
        mean_received=sum(receivers) / len(receivers) if receivers else 0.0,
        links=len(links), max_link=max(links, default=0),
        mean_link=sum(links) / len(links) if links else 0.0,
        max_send_over_mean=moves.max_send_over_mean(),
        max_send_over_floor=moves.max_send_over_floor(),
        metadata_bytes_per_rank=meta, metadata_bytes_gathered=gathered.total,
        metadata_bytes_gathered_full=full, metadata_broadcasts=gathered.owners,
        pickled_layout_bytes_per_rank=pickled, plan_seconds=slowest.seconds,
        slowest_rank=slowest.rank, timings=tuple(timings), peak_rss_bytes=peak_rss_bytes(),
        plan_alloc_peak_bytes=alloc, simulate_seconds=seconds[0], simulate_cpu_seconds=seconds[1],
        prediction=prediction,
    )




def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.2f} MB"


def _rosters(n: int) -> str:
    return f"{n} distinct roster{'' if n == 1 else 's'}"
