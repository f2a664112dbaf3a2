"""This rank's side of the edges it sends or receives on: one process group per edge and
one ``Refitter`` per part of the relay's pipeline (``parts``) over it, built the first time
a task names the edge and kept for later updates.

What a rank sends and receives into (``Sides``): the trainer sends from its model as
given; a replica receives into its live weights (unstaged) or into the fleet's staging
copy of them (staged, installed under its lock once whole), and relays from the same
tensors it received into, part by part, each part described by ``parts.part_layout``.

An edge's group joins every rank of its two jobs, sender's ranks first, beside each job's
own default group (``connect``'s way: ``build_joint_group`` over a prefix of the fleet's
store, the prefix derived from the secret). A failed transfer leaves the group unusable:
the edge is forgotten on both sides, and the coordinator names the next attempt on that
pair with a new generation (a new tag, so a new group). Edges whose peer left the fleet
are closed when a task says who is still in it.

A group is built on a thread of its own, over a store client of its own (the group keeps
it: one connection to the fleet's store per live edge), while the calling thread watches
whether the peer job was dropped: the rendezvous waits in the store for every peer's
address, and a peer killed before it published one would otherwise hold this rank (and
the update with it) for the whole ``timeout``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..connect import _build_joint_group as build_joint_group
from ..layout import Described, describe
from ..plan.cache import PlanCache
from ..refitter import Refitter
from .board import Board
from .parts import cut, global_sizes, part_layout
from .secret import group_prefix

__all__ = ["Link", "Links", "PeerDropped", "Sides", "edge_tag", "parse_tag"]

_log = logging.getLogger(__name__)

_WATCH = 0.05  # seconds between two looks at whether the peer was dropped, while a group builds


class PeerDropped(RuntimeError):
    """The peer job of an edge was dropped while the edge's group was being built."""


def edge_tag(src: str, dst: str, generation: int) -> str:
    return f"{src}>{dst}#{generation}"


def parse_tag(tag: str) -> tuple[str, str]:
    pair = tag.rsplit("#", 1)[0]
    src, dst = pair.split(">", 1)
    return src, dst


@dataclass
class Sides:
    """What this rank's job sends from and receives into. The trainer: ``model`` and its
    ``refitter_args``, whole. A replica (``live`` set): its live weights described once,
    ``staging`` (a copy of them, staged replicas) and the global names of each part."""

    model: object
    refitter_args: dict = field(default_factory=dict)
    live: Described | None = None
    staging: dict[str, torch.Tensor] | None = None
    parts: list[frozenset[str]] = field(default_factory=list)

    @classmethod
    def replica(cls, model, staged: bool, chunks: int, refitter_args: dict | None) -> Sides:
        args = dict(refitter_args or {})
        layout = args.pop("dst_layout", None) or args.pop("src_layout", None)
        live = describe(model, layout)
        staging = {k: torch.empty_like(t) for k, t in live.tensors.items()} if staged else None
        return cls(model, args, live, staging, cut(global_sizes(live.layout), chunks))

    def refitter_args_for(self, part: int, sending: bool) -> dict:
        """Refitter arguments for ``part`` of an edge, this rank at the sending end or not."""
        if self.live is None:  # the trainer: its model whole (the plan sends what the part needs)
            return {**self.refitter_args, "src_model": self.model, "dst_model": None}
        tensors = self.staging
        model = self.model if tensors is None else tensors
        layout = part_layout(self.live, self.parts[part], tensors)
        side = {"src_model": model, "src_layout": layout, "dst_model": None} if sending else {
            "src_model": None, "dst_model": model, "dst_layout": layout}
        return {**self.refitter_args, **side}

    def install(self) -> None:
        """Staged: copy the staging copy into the live weights (the caller holds the lock)."""
        if self.staging is not None:
            with torch.no_grad():
                torch._foreach_copy_([self.live.tensors[k] for k in self.staging], list(self.staging.values()))
        if self.live is not None and self.live.after_refit is not None:
            self.live.after_refit()


@dataclass
class Link:
    """One edge as this rank holds it: its group and one Refitter per part."""

    tag: str
    group: dist.ProcessGroup
    parts: list[Refitter]

    def close(self) -> None:
        for r in self.parts:
            try:
                r.close()
            except Exception:
                pass
        try:
            if self.group in dist.distributed_c10d._world.pg_map:
                dist.destroy_process_group(self.group)
        except Exception as e:  # a peer already gone: nothing left to tell it
            _log.debug("closing the group of edge %s: %s", self.tag, e)


class Links:
    """The edges of one rank of one job (``job``, ``rank`` of ``world``)."""

    def __init__(self, store: dist.Store, key: bytes, salt: str, job: str, rank: int, world: int,
                 sides: Sides, timeout: float) -> None:
        self.store, self.key, self.salt = store, key, salt
        self.job, self.rank, self.world = job, rank, world
        self.sides, self.timeout = sides, timeout
        self.plans = PlanCache()  # one per rank: edges between layouts seen before reuse theirs
        self._links: dict[str, Link] = {}

    def get(self, tag: str, peer_world: int, parts: int, store: dist.Store | None = None,
            gone: Callable[[], bool] = lambda: False) -> Link:
        """The edge's link, built now if new (collective with every rank of the peer job),
        meeting over a client of ``store`` (the calling thread's; default: this rank's).
        Raises ``PeerDropped`` as soon as ``gone()`` says the peer job was dropped while
        the link was being built."""
        link = self._links.get(tag)
        if link is None:
            link = self._build_watched(tag, peer_world, parts, store or self.store, gone)
            self._links[tag] = link
        return link

    def _build_watched(self, tag: str, peer_world: int, parts: int, store: dist.Store,
                       gone: Callable[[], bool]) -> Link:
        """``_build`` on a thread of its own (over its own client of the store: an abandoned
        build keeps it), looking at ``gone()`` every ``_WATCH`` seconds meanwhile. Where the
        caller leaves early (the peer dropped, or ``gone()`` raised), what the build made is
        closed: at once where it had ended, else when it ends (its waits end by their
        timeout)."""
        own = Board(store).for_thread().store
        state: dict = {}
        done, lock = threading.Event(), threading.Lock()

        def build() -> None:
            try:
                link = self._build(tag, peer_world, parts, own)
            except BaseException as e:  # handed to the caller, unless it left
                link, state["error"] = None, e
            with lock:
                state["link"] = link
                abandoned = state.get("abandoned", False)
                done.set()
            if abandoned and link is not None:
                link.close()

        threading.Thread(target=build, name=f"fleet-link-{tag}", daemon=True).start()
        try:
            while not done.wait(_WATCH):
                if gone():
                    src, dst = parse_tag(tag)
                    peer = dst if src == self.job else src
                    raise PeerDropped(f"edge {tag}: {peer} was dropped while the edge's group was being built")
        except BaseException:
            with lock:  # the caller leaves: what the build made is closed, now or once it ends
                state["abandoned"] = True
                built = state.get("link")
            if built is not None:
                built.close()
            raise
        if "error" in state:
            raise state["error"]
        return state["link"]

    def _build(self, tag: str, peer_world: int, parts: int, store: dist.Store) -> Link:
        src, dst = parse_tag(tag)
        sending = src == self.job
        src_world = self.world if sending else peer_world
        joint = self.rank if sending else src_world + self.rank
        prefix = dist.PrefixStore(group_prefix(self.key, self.salt, tag), store)
        group = build_joint_group(prefix, joint, self.world + peer_world, "gloo", self.timeout)
        link = Link(tag, group, [])
        try:
            for p in range(parts):
                link.parts.append(Refitter(
                    group=group, src_rank_offset=0, dst_rank_offset=src_world, timeout=self.timeout,
                    plan_cache=self.plans, **self.sides.refitter_args_for(p, sending)))
        except Exception:
            link.close()
            raise
        return link

    def forget(self, tag: str) -> None:
        link = self._links.pop(tag, None)
        if link is not None:
            link.close()

    def keep_only(self, live: set[str]) -> None:
        """Close every edge whose peer is not in ``live`` (or is an older generation of a
        pair that has a newer one)."""
        newest: dict[tuple[str, str], int] = {}
        for tag in self._links:
            pair, gen = tag.rsplit("#", 1)
            newest[pair] = max(newest.get(pair, -1), int(gen))
        for tag in list(self._links):
            src, dst = parse_tag(tag)
            pair, gen = tag.rsplit("#", 1)
            peer = dst if src == self.job else src
            if peer not in live or int(gen) < newest[pair]:
                self.forget(tag)

    def close(self) -> None:
        for tag in list(self._links):
            self.forget(tag)
