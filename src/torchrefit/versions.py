"""Weight versions: which refit a destination model's weights came from.

``Refitter.refit(version=None)`` stamps the version on this rank's destination
model after the refit succeeded (a failed refit leaves the previous stamp);
``weight_version(model)`` reads it on any destination rank, e.g. an engine that
tags its rollouts with the policy version that produced them.
"""

from __future__ import annotations

import weakref

__all__ = ["weight_version", "stamp_version"]

_ATTR = "_torchrefit_weight_version"
# objects that refuse attributes (slots) are stamped here, by identity, held weakly
_SIDE_TABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stamp_version(model, version: int) -> None:
    """Record ``version`` on ``model`` (each chunk of a list of virtual-pipeline chunks)."""
    for chunk in _chunks(model):
        try:
            object.__setattr__(chunk, _ATTR, version)
        except (AttributeError, TypeError):
            try:
                _SIDE_TABLE[chunk] = version
            except TypeError:  # neither attributes nor weak references (a dict model)
                pass


def weight_version(model) -> int | None:
    """The version of the last successful refit into ``model`` on this rank, or None
    if no refit has written it yet. Local (not collective): call it on any rank that
    holds a destination model."""
    chunks = _chunks(model)
    if not chunks:
        return None
    chunk = chunks[0]
    got = getattr(chunk, _ATTR, None)
    if got is None:
        try:
            got = _SIDE_TABLE.get(chunk)
        except TypeError:  # neither attributes nor weak references
            return None
    return got


def _chunks(model) -> list:
    if model is None:
        return []
    return list(model) if isinstance(model, (list, tuple)) else [model]
