"""Control words in host shared memory: one-sided ready and done signals without Gloo.

A one-host one-sided transport (``ipc``) sends its per-refit header and done token
as Gloo messages only when they carry something new (a table, a token); otherwise
the target writes one word here and the initiator polls it. A Gloo message costs a
round through the kernel's sockets on the path before the copies can start; a word in
shared memory is seen within microseconds.

A target rank owns one :class:`Mailbox` for its whole group: two int64 words per
group rank ``r``, the *header* word at ``2r`` (the target writes it for initiator
``r``) and the *done* word at ``2r + 1`` (initiator ``r`` writes it back). A word
holds ``seq << 1 | follows``: ``seq`` counts the pair's exchanges (both ends count
the same), ``follows`` says a Gloo message comes with this exchange. Each side
writes a word only after the peer read the previous one (the protocol alternates
header, done, header), so a word is never overwritten unread.

The words live in a file of ``/dev/shm`` mapped by both processes, created and
unlinked by the target (when its mailbox is dropped or the process exits). Not
torch's ``share_memory_``: its first use starts torch's shared-memory manager
process, 0.24 s that every first refit paid. The mapping spans whole pages, so a
GPU transport can register it with CUDA and have its streams write words
(``transport.ipc.StreamWords``): a word then lands only once everything
queued before it on the writer's stream ran.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import uuid
import weakref
from collections.abc import Callable

__all__ = ["Mailbox", "header_word", "done_word"]


def header_word(rank: int) -> int:
    """Index of the word a target writes for initiator ``rank``."""
    return 2 * rank


def done_word(rank: int) -> int:
    """Index of the word initiator ``rank`` writes back to a target."""
    return 2 * rank + 1


class Mailbox:
    """Two int64 words per group rank in CPU shared memory (see the module docstring).

    The target creates it (:meth:`create`) and hands :meth:`handle` to each initiator
    inside its first table; an initiator maps it with :meth:`open`.
    """

    def __init__(self, path: str, words: int, *, owner: bool) -> None:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if owner else 0), 0o600)
        size = -(-8 * words // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages: registrable with CUDA
        try:
            if owner:
                os.ftruncate(fd, size)  # zero-filled: every exchange count starts at 0
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._path, self._words = path, words
        # the address stays valid while this object holds the map open (an mmap never moves)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        # the words as int64 items: one C-level store or load each (a ctypes object made per
        # store cost 5 us right after the host waited, the sender's ready word among them)
        self._cells = memoryview(self._map).cast("q")
        if owner:  # the name goes with the target's mailbox; a peer that mapped it keeps its map
            weakref.finalize(self, _unlink, path)

    @classmethod
    def create(cls, world: int) -> Mailbox:
        path = f"/dev/shm/torchrefit-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        return cls(path, 2 * world, owner=True)

    def handle(self) -> tuple:
        return self._path, self._words

    @classmethod
    def open(cls, handle: tuple) -> Mailbox:
        path, words = handle
        return cls(path, words, owner=False)

    @property
    def address(self) -> int:
        """Where the mapping starts in this process (page-aligned)."""
        return self._base

    @property
    def nbytes(self) -> int:
        return len(self._map)

    def store(self, index: int, value: int) -> None:
        """Word ``index`` := ``value`` (a raw word, as a stream writes it)."""
        self._cells[index] = value  # aligned 8-byte stores and loads: whole on x86-64 and AArch64

    def load(self, index: int) -> int:
        return self._cells[index]

    def post(self, index: int, seq: int, follows: bool) -> None:
        self.store(index, seq << 1 | int(follows))

    def take(self, index: int, seq: int, timeout: float | None,
             poll: Callable[[Callable[[], bool], float | None], bool]) -> bool | None:
        """Wait until word ``index`` holds exchange ``seq``, polling with ``poll``
        (``transport.base.poll_until``'s form, e.g. a ``Waits.poller``); whether
        a Gloo message follows, or None when ``timeout`` seconds passed first. Raises
        ValueError where the word is ahead of ``seq`` (the two ends counted differently)."""
        cells = self._cells
        if not poll(lambda: cells[index] >> 1 >= seq, timeout):
            return None
        value = cells[index]
        if value >> 1 != seq:
            raise ValueError(f"control word holds exchange {value >> 1}, expected {seq}")
        return bool(value & 1)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
