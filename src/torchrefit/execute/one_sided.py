"""The one-sided program: a ``OneSidedTransport`` reads or writes peers' registered memory.

Compiling decides, per peer, this rank's role: *target* (its tensors are exposed
to the peer: the sender for a pull transport, the receiver for a push one) or
*initiator* (it moves the bytes), and takes the views of its side of every
transfer in plan order, the order both ends agree on. The target registers its
tensors once per compile (``transport.expose``); the initiator opens a target's
table once per target generation (``transport.attach``; regions of a pull
transport are then copied like local copies, captured in a CUDA graph).

:meth:`OneSidedProgram.run` is the cross-process ordering of every one-sided
transport, written once (see ``transport.one_sided`` for the primitives):
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
from ..layout._types import Box
from ..plan.types import Transfer
from ..transport.one_sided import OneSidedTransport
from .local import LANES, Copy, LocalCopies, compile_copies, differing
from .streams import SideStreams
from .views import Views

__all__ = ["Initiated", "Exposed", "OneSided", "OneSidedProgram", "compile_one_sided"]

_GENERATIONS = itertools.count(1)


@dataclass(frozen=True)
class Initiated:
    """A peer whose memory this rank reaches: its local views, one per transfer in plan
    order (destinations for pull, sources for push), and their names for errors."""

    peer: int
    local: tuple[torch.Tensor, ...]
    names: tuple[str, ...]


@dataclass(frozen=True)
class Exposed:
    """A peer that reaches this rank's memory: per transfer in plan order, the index of
    the exposed tensor and the region of it."""

    peer: int
    regions: tuple[tuple[int, Box], ...]


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


def compile_one_sided(views: Views, transport: OneSidedTransport) -> OneSided:
    plan = views.plan
    # pull: the sender is the target and the receiver reads; push: the other way round
    mine, theirs = (plan.recvs, plan.sends) if transport.pull else (plan.sends, plan.recvs)
    my_side, their_side = ("dst", "src") if transport.pull else ("src", "dst")
    keys: dict[str, int] = {}  # exposed local tensor key -> its index in the table
    regions: dict[int, list[tuple[int, Box]]] = defaultdict(list)
    for t in theirs:
        regions[t.peer].append((keys.setdefault(t.key, len(keys)), t.local_box))
    exposed = transport.expose([views.tensor(their_side, k) for k in keys]) if keys else None
    local: dict[int, list[Transfer]] = defaultdict(list)
    for t in mine:
        local[t.peer].append(t)
    initiated = tuple(
        Initiated(peer, tuple(views.view(my_side, t.key, t.local_box) for t in ts),
                  tuple(f"{t.name}{t.region} {'from' if transport.pull else 'to'} rank {t.peer}" for t in ts))
        for peer, ts in sorted(local.items()))
    targets = tuple(Exposed(peer, tuple(r)) for peer, r in sorted(regions.items()))
    return OneSided(next(_GENERATIONS), exposed, targets, initiated, len(plan.sends), len(plan.recvs))


class OneSidedProgram:
    """Replays a compiled :class:`OneSided` through its transport. Holds one piece of
    run-time state: for a pull transport, the copies out of the targets' memory,
    compiled (and captured) once per set of target generations."""

    def __init__(self, compiled: OneSided, transport: OneSidedTransport, device: torch.device,
                 cuda_graph: bool) -> None:
        self.compiled = compiled
        self.transport = transport
        # streams of its own: the pulls are captured during a refit, while the local
        # copies' session holds the program's side streams
        self.side = SideStreams(device, LANES) if compiled.initiated and transport.pull else None
        self.cuda_graph = cuda_graph
        self._pulls: tuple[tuple, LocalCopies] | None = None  # (peer generations, copies)
        self._matched: set[tuple[int, int]] = set()  # (peer, generation) whose regions were checked

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
        they may read or write this rank's memory while it waits for anything)."""
        c, transport = self.compiled, self.transport
        if c.targets:
            token = transport.ready()  # after this rank's current stream: its producer
            for target in c.targets:
                transport.post_header(target.peer, c.generation, (c.exposed, target.regions), token)

    def reach(self) -> list[tuple[int, tuple]]:
        """Initiator: each target's header (its table opened where new) and ready token,
        and, for a pull transport, its copies compiled (captured) for these tables: all
        but the transfer, so that a rank taking turns on a shared GPU does this before
        its turn (``Program._run_in_turn``)."""
        remote = [self._attach(pair) for pair in self.compiled.initiated]
        if remote and self.transport.pull:
            self._pull_copies(remote)
        return remote

    def initiate(self, compare: bool = False, remote: list[tuple[int, tuple]] | None = None) -> list[str]:
        """Initiator: read or write each target's memory once it is ready (``remote``:
        what :meth:`reach` returned, else reached now), then post the done tokens.
        Returns the mismatches in ``compare`` mode."""
        c, transport = self.compiled, self.transport
        if not c.initiated:
            return []
        if remote is None:
            remote = [self._attach(pair) for pair in c.initiated]
        bad = self._transfer(remote, compare)
        token = transport.done()
        for pair in c.initiated:
            transport.post_done(pair.peer, token)
        return bad

    def finish(self) -> None:
        """Target: this rank's later work waits for each initiator's access."""
        for target in self.compiled.targets:
            self.transport.wait_done(target.peer, self.transport.recv_done(target.peer))
        self.transport.settle()

    def _attach(self, pair: Initiated) -> tuple[int, tuple]:
        generation, token, remote = self.transport.recv_header(pair.peer)
        # once per table, not per refit: on the receiver's path between the sender's
        # header and its copies (56 us for the seed model's 203 regions on an H200)
        if (pair.peer, generation) not in self._matched:
            if len(remote) != len(pair.local) or (self.transport.pull and any(
                    r.numel() != v.numel() for r, v in zip(remote, pair.local))):
                raise TransportError(f"rank {pair.peer}'s exposed regions do not match what this rank "
                                     f"exchanges with it (first: {pair.names[0]}); the plans disagree")
            self._matched.add((pair.peer, generation))
        self.transport.wait_ready(pair.peer, token)
        return generation, remote

    def _transfer(self, remote: Sequence[tuple[int, tuple]], compare: bool) -> list[str]:
        pairs = self.compiled.initiated
        if compare:
            if not self.transport.pull:
                raise AssertionError("verify of a push transport runs over message rounds")
            return [name for pair, (_, r) in zip(pairs, remote)
                    for name in differing(pair.local, r, pair.names)]
        if self.transport.pull:
            self._pull_copies(remote).run_on_caller(self.side)
        else:
            for pair, (_, r) in zip(pairs, remote):
                self.transport.write(pair.peer, pair.local, r)
            self.transport.finish_writes()
        return []

    def _pull_copies(self, remote: Sequence[tuple[int, tuple]]) -> LocalCopies:
        key = tuple((pair.peer, gen) for pair, (gen, _) in zip(self.compiled.initiated, remote))
        if self._pulls is None or self._pulls[0] != key:
            copies = [Copy(dst, src, name) for pair, (_, r) in zip(self.compiled.initiated, remote)
                      for dst, src, name in zip(pair.local, r, pair.names)]
            # not merged: byte runs across tensors are found through the driver's allocation
            # ranges, which nothing here has checked on memory mapped from another process
            self._pulls = (key, compile_copies(copies, self.side, self.cuda_graph, merge=False))
        return self._pulls[1]
