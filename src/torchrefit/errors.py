"""Errors raised by torchrefit.

Every error a refit raises derives from :class:`RefitError`. Errors found while
describing layouts or planning are agreed on by all ranks of the refit group
before any byte moves, so a refit raises on every rank or on none.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["RefitError", "LayoutError", "PlanError", "TransportError", "ConnectError",
           "VerificationError"]


class RefitError(RuntimeError):
    """Base class of every torchrefit error.

    ``str(err)`` is one line naming the tensor, the ranks and the rule broken (a
    torchrun job prints it once per rank); the attributes hold the same in parts:
    ``tensor`` (global tensor name, or None), ``ranks`` (the ranks concerned),
    ``rule`` (a short name of the rule broken, such as ``"no source"``) and
    ``detail`` (everything found, one problem per line; the message where no more).
    """

    def __init__(self, message: str = "", *, tensor: str | None = None,
                 ranks: Sequence[int] = (), rule: str | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.ranks = tuple(ranks)
        self.rule = rule
        self.detail = message if detail is None else detail

    def __reduce__(self):  # keep the attributes across processes (pickled results, queues)
        return (_rebuild, (type(self), str(self), self.tensor, self.ranks, self.rule, self.detail))


def _rebuild(cls: type[RefitError], message: str, tensor: str | None, ranks: tuple[int, ...],
             rule: str | None, detail: str) -> RefitError:
    return cls(message, tensor=tensor, ranks=ranks, rule=rule, detail=detail)


class LayoutError(RefitError):
    """A model's local tensors cannot be described as pieces of global tensors."""


class PlanError(RefitError):
    """The source and destination layouts cannot be matched (coverage, shapes, dtypes)."""


class TransportError(RefitError):
    """A transport is unavailable or failed while moving bytes."""


class ConnectError(TransportError):
    """``tr.connect`` could not join the trainer and engine jobs (a rank never came,
    the store's host is unreachable, the jobs disagree about their sizes)."""


class VerificationError(RefitError):
    """A destination tensor differs from the source after a refit."""
