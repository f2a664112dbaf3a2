"""This rank's side of the edges it sends or receives on: one process group and one
``Refitter`` per edge, built the first time a task names the edge and kept for later
updates (the plan between the two layouts is made once per edge).

An edge's group joins every rank of its two jobs, sender's ranks first, beside each job's
own default group (``connect``'s way: ``build_joint_group`` over a prefix of the fleet's
store, the prefix derived from the secret). A failed transfer leaves the group unusable:
the edge is forgotten on both sides, and the coordinator names the next attempt on that
pair with a new generation (a new tag, so a new group). Edges whose peer left the fleet
are closed when a task says who is still in it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist

from ..connect import _build_joint_group as build_joint_group
from ..refitter import Refitter
from .secret import group_prefix

__all__ = ["Link", "Links", "edge_tag", "parse_tag"]

_log = logging.getLogger(__name__)


def edge_tag(src: str, dst: str, generation: int) -> str:
    return f"{src}>{dst}#{generation}"


def parse_tag(tag: str) -> tuple[str, str]:
    pair = tag.rsplit("#", 1)[0]
    src, dst = pair.split(">", 1)
    return src, dst


@dataclass
class Link:
    """One edge as this rank holds it."""

    tag: str
    group: dist.ProcessGroup
    refitter: Refitter

    def close(self) -> None:
        try:
            self.refitter.close()
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
                 model, timeout: float, refitter_args: dict | None = None) -> None:
        self.store, self.key, self.salt = store, key, salt
        self.job, self.rank, self.world = job, rank, world
        self.model, self.timeout = model, timeout
        self.refitter_args = dict(refitter_args or {})
        self._links: dict[str, Link] = {}

    def get(self, tag: str, peer_world: int) -> Link:
        """The edge's link, built now if new (collective with every rank of the peer job)."""
        link = self._links.get(tag)
        if link is None:
            link = self._build(tag, peer_world)
            self._links[tag] = link
        return link

    def _build(self, tag: str, peer_world: int) -> Link:
        src, dst = parse_tag(tag)
        sending = src == self.job
        src_world = self.world if sending else peer_world
        joint = self.rank if sending else src_world + self.rank
        prefix = dist.PrefixStore(group_prefix(self.key, self.salt, tag), self.store)
        group = build_joint_group(prefix, joint, self.world + peer_world, "gloo", self.timeout)
        try:
            r = Refitter(self.model if sending else None, None if sending else self.model,
                         group=group, src_rank_offset=0, dst_rank_offset=src_world,
                         timeout=self.timeout, **self.refitter_args)
        except Exception:
            Link(tag, group, None).close()
            raise
        return Link(tag, group, r)

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
