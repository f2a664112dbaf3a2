"""Turns on a shared GPU: processes of one group that copy on the same GPU do it one
after another, not at once.

Without MPS a GPU runs one process's kernels at a time and switches between processes
with work queued; copies from several processes at once then cost more than the same
copies one process after another: every switch drains one context and fills another.

So where several ranks of a group copy on one GPU (a ``one_host`` transport; ranks
with local copies or, for a pull transport, reads), they take turns in rank order for
every refit: rank ``k`` posts its ready header (peers may read its sources during
others' turns), its host waits until the previous rank's turn word says that rank's
copies of this refit finished, then queues its own copies, and its stream writes its
own turn word after them. A host wait, not a stream wait: a wait queued on a stream
for another process makes the GPU switch contexts to resolve it
(``transport.base.poll_until``). The waits never
form a cycle: a rank's ready header precedes its wait, and its
wait for its readers' done tokens follows its own turn word.

Where every rank copying on a GPU can hand its copies over, one of them copies for all
instead (``transport.delegates``, the default); turns are for the others (a rank that
quantizes to FP8, or all of them with ``settings.delegate_copies`` off). Found once per Refitter by two small
gathers in ``OneSidedTransport.prepare`` (each rank's host and GPU, whether it copies
and whether it can hand its copies over; then the turn mailboxes of the ranks that take
turns).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .one_sided.mailbox import Mailbox

__all__ = ["Turn", "device_key", "chain_of", "shared_devices"]

_WORD = 0  # the one word of a turn mailbox: the number of this rank's finished turns


def device_key(device: torch.device) -> str:
    """What identifies the physical device a rank copies on, across processes: host and
    GPU UUID (``CUDA_VISIBLE_DEVICES`` may number one GPU differently per process)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        ident = str(getattr(props, "uuid", "") or getattr(props, "pci_bus_id", "") or device.index)
    else:
        ident = device.type
    return f"{socket.gethostname()}/{ident}"


def shared_devices(keys: list[str], copies: list[bool]) -> dict[str, list[int]]:
    """Device key -> the ranks that copy there, in rank order, for every device where two
    or more do (the ranks that take turns, or whose first copies for all). Pure."""
    members: dict[str, list[int]] = {}
    for rank, (key, copying) in enumerate(zip(keys, copies)):
        if copying:
            members.setdefault(key, []).append(rank)
    return {key: ranks for key, ranks in members.items() if len(ranks) > 1}


def chain_of(rank: int, keys: list[str], copies: list[bool]) -> list[int]:
    """The ranks that take turns with ``rank``, in order: those that copy on its device,
    where there are two or more and ``rank`` is one of them; else empty. Pure."""
    members = shared_devices(keys, copies).get(keys[rank], [])
    return members if rank in members else []


@dataclass
class Turn:
    """This rank's place in its device's chain: the previous rank's mailbox (None: it
    goes first) and its own (None: it goes last), with the writer of its word (a
    transport's stream writer, or None where the host writes it: copies that finished
    when they were queued, on CPU)."""

    rank: int
    previous: int | None
    before: Mailbox | None
    own: Mailbox | None
    writer: Callable[[int, int], None] | None
    taken: int = 0  # turns this rank took (refits of any program, in the same order everywhere)

    def wait(self, poll: Callable[[Callable[[], bool], float], bool], timeout: float) -> bool:
        """Host: until the previous rank finished turn ``taken + 1``; False on timeout."""
        self.taken += 1
        if self.before is None:
            return True
        box, want = self.before, self.taken
        # at least, not exactly (Mailbox.take): the previous rank may be turns ahead, when
        # nothing it does waits for this rank
        return poll(lambda: box.load(_WORD) >= want, timeout)

    def post(self) -> None:
        """After this rank's copies: its word, from its stream where it has a writer."""
        if self.own is None:
            return
        if self.writer is not None:
            self.writer(_WORD, self.taken)
        else:
            self.own.store(_WORD, self.taken)

