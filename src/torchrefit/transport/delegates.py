"""One copier per shared GPU: where several ranks of a pull transport copy on one GPU,
the first of them (the *delegate*) does every copy of all of them, reading and writing
their memory, while the others only announce their tensors and wait.

Without MPS a GPU runs one process's kernels at a time. Taking turns
(``transport.turns``) stopped the processes' copies from contending, but every turn
still paid a start and a handoff between processes: ipc's collocated TP2 -> TP1 refit
of the seed's model took 1.11-1.14x the copy floor with turns, where one process queuing
that model's TP1 copies takes 1.00x and the TP2 halves alone 1.10x (BENCHMARKS.md,
"Eleventh session"). A delegate queues them all in one process (its own local copies,
and one graph for every other copy), so nothing switches.

Which ranks delegate is decided once per Refitter from one small gather in
``OneSidedTransport.prepare`` (each rank's device, whether it copies and whether its
copies can be done by another process) and is the same on every rank, so each sender
knows whose copier reads its sources. Its copies cannot be done by another process
where a rank quantizes to FP8 (its own kernels around the exchange); such a GPU's ranks
take turns instead.

On by default; ``TORCHREFIT_DELEGATE=0`` (on any rank of a GPU) makes that GPU's ranks
take turns instead. Measured on one H200 (BENCHMARKS.md, "Fourteenth session"): ipc's
collocated TP2 -> TP1 of the seed's model at 1.096x the copy floor with 2 processes and
1.067x with 4, against 1.142x and 1.138x taking turns in the same call. The first refit
is slower (with 4 processes 0.29-0.45 s against 0.20 s: most of it ending the capture
of the delegate's graph of every member's copies), which a few hundred refits repay.
"""

from __future__ import annotations

import os

from .turns import shared_devices

__all__ = ["DELEGATE_ENV", "delegates_of", "enabled"]

DELEGATE_ENV = "TORCHREFIT_DELEGATE"


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
    return os.environ.get(DELEGATE_ENV, "1").strip() != "0"
