"""The one-sided program: a ``OneSidedTransport`` reads or writes peers' registered memory.

Compiling decides, per peer, this rank's role: *target* (its tensors are exposed
to the peer: the sender for a pull transport, the receiver for a push one) or
*initiator* (it moves the bytes), and takes the views of its side of every
transfer in plan order, the order both ends agree on. The target registers its
tensors once per compile (``transport.expose``); the initiator opens a target's
table once per target generation (``transport.attach``; regions of a pull
transport are then copied like local copies, captured in a CUDA graph).

:meth:`OneSidedProgram.run` is the cross-process ordering of every one-sided
transport, written once (see ``transport.one_sided.protocol`` for the primitives):
the initiator never touches the target's memory before the target's ready token
(a pull receiver never reads before the sender's producer finished; a push
sender never overwrites a destination its engine still reads), and the target's
later work waits for the initiator's done token (a pull sender never overwrites
sources a receiver still reads; a push receiver never reads before the writes
landed). Stream ordering stays in ``streams.SideStreams`` and the transport's
tokens.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import TransportError
from ..layout._types import Box, dtype_from_name
from ..plan.types import LocalCopy, Transfer
from ..transport.one_sided.protocol import OneSidedTransport
from .local import LANES, Copy, LocalCopies, compile_copies, differing
from .streams import SideStreams
from .views import Views

__all__ = ["Delegation", "Initiated", "Exposed", "OneSided", "OneSidedProgram", "Work", "compile_one_sided",
           "new_generation"]

_GENERATIONS = itertools.count(1)


def new_generation() -> int:
    """A table generation no compile in this process had (initiators re-attach on a new one)."""
    return next(_GENERATIONS)


@dataclass(frozen=True)
class Initiated:
    """A peer whose memory this rank reaches: its local views, one per transfer in plan
    order (destinations for pull, sources for push), and their names for errors. A
    delegate's peers have none: what it copies comes with its members' work."""

    peer: int
    local: tuple[torch.Tensor, ...]
    names: tuple[str, ...]


@dataclass(frozen=True)
class Work:
    """What a rank asks its delegate to copy (``transport.delegates``), as indices into
    the regions of the table it sends with it: its local copies (source region,
    destination region, name) and its receptions (sender, destination region, name; per
    sender in plan order, the sender's table holding the sources)."""

    local: tuple[tuple[int, int, str], ...]
    recvs: tuple[tuple[int, int, str], ...]


@dataclass(frozen=True)
class Exposed:
    """A peer that reaches this rank's memory: per transfer in plan order, the index of
    the exposed tensor and the region of it; for this rank's delegate, also its work."""

    peer: int
    regions: tuple[tuple[int, Box], ...]
    work: Work | None = None


@dataclass(frozen=True)
class Delegation:
    """A delegate's own part of the copies it does for ``members`` (rank order, itself
    among them): its receptions per sender (destination views and names, plan order)
    and its sources read for each other member (plan order)."""

    members: tuple[int, ...]
    recvs: dict[int, tuple[tuple[torch.Tensor, str], ...]]
    sends: dict[int, tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class OneSided:
    """What compiling decided. ``generation`` is unique per compile of any program in
    this process: initiators re-attach whenever it changes."""

    generation: int
    exposed: object  # the transport's description of this rank's registered tensors
    targets: tuple[Exposed, ...]
    initiated: tuple[Initiated, ...]
    messages_sent: int
    messages_received: int
    delegation: Delegation | None = None
    #: push only, where a transfer converts its dtype: the sender's copies into buffers
    #: of the wire dtype before its writes, the receiver's out of them after them
    before: tuple[Copy, ...] = ()
    after: tuple[Copy, ...] = ()


def compile_one_sided(views: Views, transport: OneSidedTransport, local: Sequence[LocalCopy] = (),
                      compare: bool = False) -> OneSided:
    """``local``: this rank's local copies where its delegate does them."""
    plan, me, pull = views.plan, views.plan.rank, transport.pull
    # pull: the sender is the target and the receiver's copier reads; push: the other way round
    mine, theirs = (plan.recvs, plan.sends) if pull else (plan.sends, plan.recvs)
    my_side, their_side = ("dst", "src") if pull else ("src", "dst")
    copier = (lambda r: transport.copier_of(r, compare)) if pull else (lambda r: r)
    keys: dict[tuple[str, str], int] = {}  # exposed local tensor (side, key) -> its index in the table
    regions: dict[int, list[tuple[int, Box]]] = defaultdict(list)
    own_reads: dict[int, list[torch.Tensor]] = defaultdict(list)  # delegate: its sources for a member
    # by receiver, then plan order: the order a delegate reading for several receivers expects
    staged: dict[tuple[str, str], torch.Tensor] = {}  # push receiver: ("stage", i) -> its wire buffer
    after: list[Copy] = []
    for t in sorted(theirs, key=lambda t: t.peer):
        who = copier(t.peer)
        if who == me:
            own_reads[t.peer].append(views.view(their_side, t.key, t.local_box))
        elif not pull and t.wire_dtype != t.local_dtype:  # lands in a wire buffer, converted after
            dst = views.view("dst", t.key, t.local_box)
            stage = _wire_buffer(dst, t.wire_dtype)
            staged[key := ("stage", str(len(staged)))] = stage
            after.append(Copy(dst, stage, f"{t.name}{t.region} from rank {t.peer}"))
            regions[who].append((keys.setdefault(key, len(keys)), Box((0,) * stage.dim(), tuple(stage.shape))))
        else:
            regions[who].append((keys.setdefault((their_side, t.key), len(keys)), t.local_box))
    delegate, work = copier(me), None
    if delegate != me:  # its delegate reads and writes this rank's side of every copy
        work, mine = _work(views, regions[delegate], keys, local, mine), ()
    exposed = transport.expose([staged[side, k] if side == "stage" else views.tensor(side, k)
                                for side, k in keys]) if regions else None
    targets = tuple(Exposed(peer, tuple(r), work if peer == delegate else None) for peer, r in sorted(regions.items()))
    mine = [(t, views.view(my_side, t.key, t.local_box), f"{t.name}{t.region} {'from' if pull else 'to'} rank "
             f"{t.peer}") for t in mine]
    before: list[Copy] = []
    if not pull:  # a push sender converts into a buffer of the wire dtype, and writes that
        mine = [(t, _staged_send(view, t.wire_dtype, name, before) if t.wire_dtype != t.local_dtype else view, name)
                for t, view, name in mine]
    members = transport.copies_for(me, compare) if pull else ()
    initiated, delegation = _initiated(mine), None
    if members:
        initiated, delegation = _delegating(me, members, mine, own_reads)
    return OneSided(new_generation(), exposed, targets, initiated, len(plan.sends), len(plan.recvs),
                    delegation, tuple(before), tuple(after))


def _wire_buffer(like: torch.Tensor, dtype: str) -> torch.Tensor:
    """A contiguous buffer shaped like ``like`` in ``dtype``, on its device."""
    return torch.empty(like.shape, dtype=dtype_from_name(dtype), device=like.device)


def _staged_send(view: torch.Tensor, wire: str, name: str, before: list[Copy]) -> torch.Tensor:
    """A buffer of the wire dtype a push sender writes from; its conversion appended to ``before``."""
    stage = _wire_buffer(view, wire)
    before.append(Copy(stage, view, name))
    return stage


def _by_peer(mine: list[tuple[Transfer, torch.Tensor, str]]) -> dict[int, list[tuple[torch.Tensor, str]]]:
    """This rank's views and names of its transfers, per peer, in plan order."""
    by_peer: dict[int, list[tuple[torch.Tensor, str]]] = defaultdict(list)
    for t, view, name in mine:
        by_peer[t.peer].append((view, name))
    return by_peer


def _initiated(mine: list[tuple[Transfer, torch.Tensor, str]]) -> tuple[Initiated, ...]:
    """Per peer whose memory this rank reaches, its views and names in plan order."""
    return tuple(Initiated(peer, tuple(v for v, _ in got), tuple(n for _, n in got))
                 for peer, got in sorted(_by_peer(mine).items()))


def _delegating(me: int, members: tuple[int, ...], mine: list[tuple[Transfer, torch.Tensor, str]],
                own_reads: dict[int, list[torch.Tensor]]) -> tuple[tuple[Initiated, ...], Delegation]:
    """A delegate's peers (its own senders and its other members; the senders its
    members name in their work are reached at run time) and its own part."""
    recvs = _by_peer(mine)
    delegation = Delegation(members, {p: tuple(v) for p, v in recvs.items()},
                            {q: tuple(v) for q, v in own_reads.items()})
    return tuple(Initiated(p, (), ()) for p in sorted(set(recvs) | set(members) - {me})), delegation


def _work(views: Views, regions: list[tuple[int, Box]], keys: dict[tuple[str, str], int],
          local: Sequence[LocalCopy], recvs: Sequence[Transfer]) -> Work:
    """This rank's local copies and receptions as its delegate's work: their regions of
    this rank's tensors appended to ``regions`` (after the sources it sends the
    delegate's members), named by index."""
    def at(side: str, key: str, box: Box) -> int:
        regions.append((keys.setdefault((side, key), len(keys)), box))
        return len(regions) - 1

    return Work(tuple((at("src", c.src_key, c.src_box), at("dst", c.dst_key, c.dst_box), c.name) for c in local),
                tuple((t.peer, at("dst", t.key, t.local_box), f"{t.name}{t.region} from rank {t.peer}")
                      for t in recvs))


#: what an initiator reached: per target, its rank, table generation and remote regions
Reached = list[tuple[int, int, tuple]]


class OneSidedProgram:
    """Replays a compiled :class:`OneSided` through its transport. Holds one piece of
    run-time state: for a pull transport, the copies out of the targets' memory,
    compiled (and captured) once per set of target generations."""

    def __init__(self, compiled: OneSided, transport: OneSidedTransport, device: torch.device,
                 cuda_graph: bool) -> None:
        self.compiled = compiled
        self.transport = transport
        # streams of its own: the pulls are captured during a refit, while the local
        # copies' ordering window (SideStreams.session) holds the program's side streams
        self.side = SideStreams(device, LANES) if compiled.initiated and transport.pull else None
        self.cuda_graph = cuda_graph
        self._pulls: tuple[tuple, LocalCopies] | None = None  # (peer generations, copies)
        self._pulled_for: Reached | None = None  # the reach _pulls was last looked up for
        # push, where transfers convert: copies into and out of wire buffers, on the caller's stream
        converts = SideStreams(device, LANES) if compiled.before or compiled.after else None
        self._converts = converts
        self._before = compile_copies(compiled.before, converts, cuda_graph, merge=False) if compiled.before else None
        self._after = compile_copies(compiled.after, converts, cuda_graph, merge=False) if compiled.after else None
        self._matched: set[tuple[int, int]] = set()  # (peer, generation) whose regions were checked
        # per target, what its header carries the first time: made once, not per refit
        self._tables = tuple((t.peer, (compiled.exposed, t.regions) + ((t.work,) if t.work is not None else ()))
                             for t in compiled.targets)

    @property
    def idle(self) -> bool:
        return not (self.compiled.targets or self.compiled.initiated)

    def run(self, compare: bool = False) -> list[str]:
        """One refit's exchange, collective with this rank's peers; in ``compare`` mode
        nothing is written and the mismatching regions are returned."""
        self.announce()
        bad = self.initiate(compare)
        self.finish()
        return bad

    def announce(self) -> None:
        """Target: this refit's ready token and header to each initiator (first, so that
        they may read or write this rank's memory while it waits for anything). A rank
        whose delegate copies for it is the delegate's target: its token also orders the
        delegate's writes after this rank's readers of the old destination."""
        if self._tables:
            transport, generation = self.transport, self.compiled.generation
            token = transport.ready()  # after this rank's current stream: its producer (and readers)
            for peer, table in self._tables:
                transport.post_header(peer, generation, table, token)

    def reach(self) -> Reached:
        """Initiator: each target's header (its table opened where new) and ready token,
        and, for a pull transport, its copies compiled (captured) for these tables: all
        but the transfer, so that a rank taking turns on a shared GPU does this before
        its turn (``Program._run_in_turn``). A delegate reaches its own senders and its
        members first, then the senders only its members' work names."""
        remote = [self._attach(pair) for pair in self.compiled.initiated]
        d = self.compiled.delegation
        if d is not None:
            known = {peer for peer, _, _ in remote} | {self.transport.rank}
            works = [self.transport.work_of(peer, gen) for peer, gen, _ in remote]
            more = sorted({p for w in works if w is not None for p, _, _ in w.recvs} - known)
            remote += [self._attach(Initiated(p, (), ())) for p in more]
        if remote and self.transport.pull:
            self._pull_copies(remote)
        return remote

    def initiate(self, compare: bool = False, remote: Reached | None = None) -> list[str]:
        """Initiator: read or write each target's memory once it is ready (``remote``:
        what :meth:`reach` returned, else reached now), then post the done tokens.
        Returns the mismatches in ``compare`` mode."""
        c, transport = self.compiled, self.transport
        if not c.initiated:
            return []
        if self._before is not None and not compare:  # queued before the ready waits, which cover it
            self._before.run_on_caller(self._converts)
        if remote is None:
            remote = self.reach()
        bad = self._transfer(remote, compare)
        token = transport.done()
        for peer, _, _ in remote:
            transport.post_done(peer, token)
        return bad

    def finish(self) -> None:
        """Target: this rank's later work waits for each initiator's access."""
        for target in self.compiled.targets:
            self.transport.wait_done(target.peer, self.transport.recv_done(target.peer))
        self.transport.settle()
        if self._after is not None:  # the writes landed: out of the wire buffers, before later work
            self._after.run_on_caller(self._converts)

    def _attach(self, pair: Initiated) -> tuple[int, int, tuple]:
        generation, token, remote = self.transport.recv_header(pair.peer)
        # once per table, not per refit: on the receiver's path between the sender's
        # header and its copies (tens of microseconds for a dense model's ~200 regions);
        # a delegate checks its tables where it pairs them (delegated_copies)
        if (pair.peer, generation) not in self._matched and self.compiled.delegation is None:
            if len(remote) != len(pair.local) or (self.transport.pull and any(
                    r.numel() != v.numel() for r, v in zip(remote, pair.local))):
                raise TransportError(f"rank {pair.peer}'s exposed regions do not match what this rank "
                                     f"exchanges with it (first: {pair.names[0]}); the plans disagree")
            self._matched.add((pair.peer, generation))
        self.transport.wait_ready(pair.peer, token)
        return pair.peer, generation, remote

    def _transfer(self, remote: Reached, compare: bool) -> list[str]:
        pairs = self.compiled.initiated
        if compare:
            if not self.transport.pull:
                raise AssertionError("verify of a push transport runs over message rounds")
            return [name for pair, (_, _, r) in zip(pairs, remote)
                    for name in differing(pair.local, r, pair.names)]
        if self.transport.pull:
            self._pull_copies(remote).run_on_caller(self.side)
        else:
            for pair, (_, _, r) in zip(pairs, remote):
                self.transport.write(pair.peer, pair.local, r)
            self.transport.finish_writes()
        return []

    def _pull_copies(self, remote: Reached) -> LocalCopies:
        if remote is self._pulled_for:  # reach() looked them up; the transfer asks again
            return self._pulls[1]
        key = tuple((peer, gen) for peer, gen, _ in remote)
        if self._pulls is None or self._pulls[0] != key:
            if self.compiled.delegation is not None:
                copies = delegated_copies(self.compiled.delegation, self.transport.rank, remote,
                                          {peer: self.transport.work_of(peer, gen) for peer, gen, _ in remote})
            else:
                copies = [Copy(dst, src, name) for pair, (_, _, r) in zip(self.compiled.initiated, remote)
                          for dst, src, name in zip(pair.local, r, pair.names)]
            # not merged: byte runs across tensors are found through the driver's allocation
            # ranges, which nothing here has checked on memory mapped from another process
            self._pulls = (key, compile_copies(copies, self.side, self.cuda_graph, merge=False))
        self._pulled_for = remote
        return self._pulls[1]


def delegated_copies(d: Delegation, me: int, remote: Reached, works: dict[int, Work | None]) -> list[Copy]:
    """A delegate's copies for its members, in member order: each member's local copies
    and receptions between regions of the tables reached (``remote``) and the delegate's
    own views. A sender's table holds its sources for the delegate's members by member
    (rank order), each in plan order: the members' work says how many are whose.
    Raises :class:`TransportError` where a table or a work does not fit (plans disagree)."""
    tables = {peer: r for peer, _, r in remote}
    for q in d.members:
        if q != me and works.get(q) is None:
            raise TransportError(f"rank {q} copies on this rank's GPU but sent it no work; the ranks disagree "
                                 "on who copies for whom", ranks=(q,), rule="out of step")

    def wanted(p: int, q: int) -> int:  # receptions of member q from sender p
        return len(d.recvs.get(p, ())) if q == me else sum(1 for s, _, _ in works[q].recvs if s == p)

    sections: dict[tuple[int, int], tuple] = {}
    for p, regions in tables.items():
        at = 0
        for q in d.members:
            n = wanted(p, q)
            sections[p, q] = regions[at:at + n]
            at += n
        w = works.get(p) if p in d.members else None
        if len(regions) != at + (2 * len(w.local) + len(w.recvs) if w is not None else 0):
            raise TransportError(f"rank {p}'s exposed regions ({len(regions)}) do not match what this rank "
                                 f"copies from it for ranks {list(d.members)}; the plans disagree",
                                 ranks=(p,), rule="out of step")
    out = []
    for q in d.members:
        if q == me:
            for p, items in d.recvs.items():
                out += [Copy(dst, src, name) for (dst, name), src in zip(items, sections[p, me])]
            continue
        w, theirs, taken = works[q], tables[q], defaultdict(int)
        out += [Copy(theirs[j], theirs[i], name) for i, j, name in w.local]
        for p, j, name in w.recvs:
            k = taken[p]
            taken[p] += 1
            sources = d.sends.get(q, ()) if p == me else sections[p, q]
            if k >= len(sources):
                raise TransportError(f"{name}: rank {p} sends rank {q} fewer regions than it receives; "
                                     "the plans disagree", ranks=(p, q), rule="out of step")
            out.append(Copy(theirs[j], sources[k], name))
        if taken[me] != len(d.sends.get(q, ())):
            raise TransportError(f"rank {q} receives {taken[me]} regions from this rank, which sends it "
                                 f"{len(d.sends.get(q, ()))}; the plans disagree", ranks=(q,), rule="out of step")
    for c in out:
        if c.dst.numel() != c.src.numel():
            raise TransportError(f"{c.name}: {c.src.numel()} elements read for {c.dst.numel()}; the plans "
                                 "disagree", rule="out of step")
    return out
