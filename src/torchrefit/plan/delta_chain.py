"""The version chain of delta refits (pure): which pairs of ranks may exchange a patch.

A sending rank keeps a reference of exactly the bytes it last sent (``execute.delta``);
a patch made against it is correct only where the receiver's target still holds those
bytes. Every call that moves bytes (a refit into the live tensors, a stage into their
twins) is numbered alike on every rank (``seq``: every rank makes the same collective
calls in the same order), and each rank tracks, by that number, what its references and
its targets hold. Before a delta call every rank publishes two numbers (:meth:`Chain.offer`);
from the same gathered numbers every rank derives the same pairs (:func:`delta_pairs`),
so sender and receiver never disagree on whether a message is a patch. Anything not
known to hold the reference's bytes (a first call, recompiled programs, tensors an engine
replaced, a target another call wrote since) gets full bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["UNKNOWN", "TARGETS", "Chain", "delta_pairs"]

#: an epoch no call ever had: the bytes held are not known
UNKNOWN = -1
#: where a call writes: the live destination tensors (refit, commit) or their twins (stage)
TARGETS = ("live", "twins")


def delta_pairs(offers: Sequence[tuple[int, int]], rank: int, send_peers: Sequence[int],
                recv_peers: Sequence[int]) -> tuple[frozenset[int], frozenset[int]]:
    """The peers this rank sends a patch to and receives a patch from, from every rank's
    ``(references' epoch, target's epoch)`` (:meth:`Chain.offer`): a pair exchanges a
    patch exactly where the sender's references hold a known epoch and the receiver's
    target holds that same epoch. Sender and receiver compute it from the same numbers."""
    mine_refs, mine_held = offers[rank]
    send = frozenset(p for p in send_peers if mine_refs != UNKNOWN and offers[p][1] == mine_refs)
    recv = frozenset(p for p in recv_peers if offers[p][0] != UNKNOWN and offers[p][0] == mine_held)
    return send, recv


@dataclass
class Chain:
    """One rank's bookkeeping (mutable, used from one thread at a time: a Refitter's
    calls are serialized by its stager).

    ``held[target]``: the epoch the target holds; ``shadows``: the epoch FP8 shadows hold
    (a receiver that quantizes after receiving patches its shadows, which every call
    writes, whatever its target); ``writer[target]``: the token of the compiled exchange
    that last wrote the target (a program compiled again, after storage moved or tensors
    were replaced, may write other live tensors and new shadows). The references' own epoch lives with
    them (``execute.delta.DeltaRounds.ref_epoch``): compiled again, they start unknown."""

    seq: int = 0
    held: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TARGETS, UNKNOWN))
    shadows: int = UNKNOWN
    writer: dict[str, int] = field(default_factory=dict)

    def offer(self, target: str, token: int, ref_epoch: int, has_shadows: bool) -> tuple[int, int]:
        """What this rank publishes before a call writing ``target`` through the compiled
        exchange ``token`` whose references hold ``ref_epoch``: that epoch and the
        target's."""
        if self.writer.get(target, token) != token:
            # compiled again: the live tensors may be others, the FP8 shadows are new; the
            # twins are made once and kept (only a stage writes them)
            self.shadows = UNKNOWN
            if target == "live":
                self.held[target] = UNKNOWN
        held = self.held[target]
        if has_shadows and self.shadows != held:
            held = UNKNOWN
        return ref_epoch, held

    def next(self) -> int:
        """The number of the call about to run (the same on every rank)."""
        self.seq += 1
        return self.seq

    def done(self, target: str, token: int, epoch: int) -> None:
        """A call numbered ``epoch`` wrote every byte of this rank's part of ``target``
        (and its shadows)."""
        self.held[target] = epoch
        self.shadows = epoch
        self.writer[target] = token

    def failed(self, target: str) -> None:
        """A call failed on this rank: its target may be partly written."""
        self.held[target] = UNKNOWN
        self.shadows = UNKNOWN

    def committed(self) -> None:
        """The twins were copied into the live tensors: they hold what the twins hold."""
        self.held["live"] = self.held["twins"]
        self.writer.pop("live", None)

    def forget(self) -> None:
        """The destination's tensors were written by someone else (an engine that reloaded
        its weights): the next call sends them full bytes."""
        self.held = dict.fromkeys(TARGETS, UNKNOWN)
        self.shadows = UNKNOWN
