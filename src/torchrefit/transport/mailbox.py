"""Control words in host shared memory: one-sided ready and done signals without Gloo.

A one-host one-sided transport (``ipc``) sends its per-refit header and done token
as Gloo messages only when they carry something new (a table, a token); otherwise
the target writes one word here and the initiator polls it. On an H200 the Gloo
header cost 0.2 ms on the path before the copies could start (BENCHMARKS.md,
"Transports run 4"); a word in shared memory is seen within microseconds.

A target rank owns one :class:`Mailbox` for its whole group: two int64 words per
group rank ``r``, the *header* word at ``2r`` (the target writes it for initiator
``r``) and the *done* word at ``2r + 1`` (initiator ``r`` writes it back). A word
holds ``seq << 1 | follows``: ``seq`` counts the pair's exchanges (both ends count
the same), ``follows`` says a Gloo message comes with this exchange. Each side
writes a word only after the peer read the previous one (the protocol alternates
header, done, header), so a word is never overwritten unread.
"""

from __future__ import annotations

import ctypes

import torch

from .base import poll_until

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

    def __init__(self, words: torch.Tensor, share: tuple) -> None:
        self.words = words  # keeps the shared storage mapped
        self._share = share
        self._base = words.data_ptr()

    @classmethod
    def create(cls, world: int) -> Mailbox:
        words = torch.zeros(2 * world, dtype=torch.int64)
        # moves the storage into named shared memory: take its address only afterwards
        share = words.untyped_storage()._share_filename_cpu_()
        return cls(words, share)

    def handle(self) -> tuple:
        return self._share, self.words.numel()

    @classmethod
    def open(cls, handle: tuple) -> Mailbox:
        share, n = handle
        storage = torch.UntypedStorage._new_shared_filename_cpu(*share)
        return cls(torch.empty(0, dtype=torch.int64).set_(storage, 0, (n,), (1,)), share)

    def _word(self, index: int) -> ctypes.c_int64:
        # aligned 8-byte loads and stores: whole on x86-64 and AArch64
        return ctypes.c_int64.from_address(self._base + 8 * index)

    def post(self, index: int, seq: int, follows: bool) -> None:
        self._word(index).value = seq << 1 | int(follows)

    def take(self, index: int, seq: int, timeout: float | None) -> bool | None:
        """Wait until word ``index`` holds exchange ``seq``; whether a Gloo message
        follows, or None when ``timeout`` seconds passed first. Raises ValueError
        where the word is ahead of ``seq`` (the two ends counted differently)."""
        word = self._word(index)
        if not poll_until(lambda: word.value >> 1 >= seq, timeout):
            return None
        value = word.value
        if value >> 1 != seq:
            raise ValueError(f"control word holds exchange {value >> 1}, expected {seq}")
        return bool(value & 1)
