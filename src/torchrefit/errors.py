"""Errors raised by torchrefit.

Every error a refit raises derives from :class:`RefitError`. Errors found while
describing layouts or planning are agreed on by all ranks of the refit group
before any byte moves, so a refit raises on every rank or on none.
"""

from __future__ import annotations

__all__ = ["RefitError", "LayoutError", "PlanError", "TransportError", "ConnectError",
           "VerificationError"]


class RefitError(RuntimeError):
    """Base class of every torchrefit error."""


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
