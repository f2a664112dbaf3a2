"""What a fleet update did, per replica (the trainer's ``Fleet.update`` returns it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ReplicaOutcome", "FleetReport", "MemberState"]


@dataclass(frozen=True)
class ReplicaOutcome:
    """One replica in one update.

    ``version``: what its live weights hold after the update (its last whole version where
    it was not updated); ``mixed``: its live weights are a mix of two versions (an unstaged
    replica cut mid-update, until its next complete update); ``dropped``: why it left the
    fleet in this update (killed, lost, timed out), else ``""``; ``source``: who fed it;
    ``bytes``: what its ranks received; ``seconds``: from the update's start until it held
    the version."""

    name: str
    version: int
    mixed: bool
    bytes: int
    seconds: float
    source: str = ""
    dropped: str = ""


@dataclass(frozen=True)
class FleetReport:
    """One ``Fleet.update``: the version, its wall time, the bytes the trainer's ranks sent
    (its egress), the rounds it took (1 unless a relay node dropped and the replicas behind
    it were fed again), and one outcome per replica that was in the fleet."""

    version: int
    seconds: float
    trainer_bytes_sent: int
    rounds: int
    replicas: tuple[ReplicaOutcome, ...]

    @property
    def dropped(self) -> dict[str, str]:
        return {r.name: r.dropped for r in self.replicas if r.dropped}

    @property
    def updated(self) -> list[str]:
        return [r.name for r in self.replicas if r.version == self.version and not r.dropped and not r.mixed]

    def __str__(self) -> str:
        lines = [f"fleet update {self.version}: {self.seconds:.3f} s, trainer sent "
                 f"{self.trainer_bytes_sent} B, {self.rounds} round(s)"]
        for r in self.replicas:
            state = f"dropped: {r.dropped}" if r.dropped else ("MIXED" if r.mixed else f"v{r.version}")
            lines.append(f"  {r.name}: {state}, {r.bytes} B from {r.source or '-'} in {r.seconds:.3f} s")
        return "\n".join(lines)


@dataclass(frozen=True)
class MemberState:
    """A replica as the fleet knows it now: ``state`` is ``arming`` (admitted, its ranks not
    all beating yet), ``seeding``, ``waiting`` (joined, to be fed by the next update: no peer
    held the current version), ``ready`` or ``dropped``."""

    name: str
    ranks: int
    state: str
    version: int
    mixed: bool
    reason: str = ""
