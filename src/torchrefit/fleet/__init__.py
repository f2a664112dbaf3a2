"""Fleets: one trainer feeding engine replicas that come and go (docs/fleet.md).

    fleet = tr.Fleet(model, rank, world_size, address, port, secret=...)   # every trainer rank
    report = fleet.update()                                                  # after each step

    replica = tr.join(model, rank, world_size, address, port, secret=...)  # every replica rank
    replica.wait_ready()

Modules: ``relay`` (pure: who feeds whom, who seeds a newcomer), ``secret`` (admission
proofs), ``board`` (the store's keys), ``links`` (one group and Refitter per edge, every
edge of a rank sharing one ``PlanCache``: plans are kept per pair of layouts), ``parts``
(pure: the parts an update moves in), ``worker`` (running a task on one rank), ``coordinator`` (the trainer's rank 0),
``trainer`` (``Fleet``), ``replica`` (``join``), ``report``.
"""

from .replica import JoinRefused, Replica, join
from .report import FleetReport, MemberState, ReplicaOutcome
from .trainer import Fleet

__all__ = ["Fleet", "join", "Replica", "JoinRefused", "FleetReport", "ReplicaOutcome", "MemberState"]
