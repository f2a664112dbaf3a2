"""One copier per shared GPU: where several ranks of a pull transport copy on one GPU,
the first of them (the *delegate*) does every copy of all of them, reading and writing
their memory, while the others only announce their tensors and wait.

Without MPS a GPU runs one process's kernels at a time. Taking turns
(``transport.turns``) stops the processes' copies from contending, but every turn still
pays a start and a handoff between processes. A delegate queues them all in one process
(its own local copies, and one graph for every other copy), so nothing switches.

Which ranks delegate is decided once per Refitter from one small gather in
``OneSidedTransport.prepare`` (each rank's device, whether it copies and whether its
copies can be done by another process) and is the same on every rank, so each sender
knows whose copier reads its sources. Its copies cannot be done by another process
where a rank quantizes to FP8 (its own kernels around the exchange); such a GPU's ranks
take turns instead.

On by default; ``settings.delegate_copies = False`` (on any rank of a GPU) makes that
GPU's ranks take turns instead. The first refit is slower with a delegate (ending the
capture of its graph of every member's copies), which later refits repay.
"""

from __future__ import annotations

from .. import settings
from .turns import shared_devices

__all__ = ["delegates_of", "enabled"]


def delegates_of(keys: list[str], copies: list[bool], eligible: list[bool]) -> dict[int, int]:
    """rank -> the rank that copies for it, for every rank of a device where two or more
    ranks copy and every one of them can hand its copies over: the device's first
    copying rank. Ranks absent copy for themselves. Pure: the same on every rank."""
    out: dict[int, int] = {}
    for ranks in shared_devices(keys, copies).values():
        if all(eligible[r] for r in ranks):
            out.update((r, ranks[0]) for r in ranks)
    return out


def enabled() -> bool:
    """``settings.delegate_copies``: off, ranks sharing a GPU take turns instead."""
    return settings.current().delegate_copies
