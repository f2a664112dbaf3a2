"""Models held by identity and weakly: a Refitter's destination chunks (stamped with each
refit's version) and the drop-in's cache keys, which must not keep a model alive."""

from __future__ import annotations

import weakref

__all__ = ["chunks", "identity", "weak", "alive"]


def chunks(model) -> tuple:
    """A model or list of virtual-pipeline chunks, as a tuple of chunks."""
    return tuple(model) if isinstance(model, (list, tuple)) else (model,)


def identity(model) -> tuple:
    """Ids of the model's chunks (a key part: equal while the same objects are passed)."""
    return () if model is None else tuple(id(m) for m in chunks(model))


def weak(model, callback) -> tuple:
    """Weak references to the model's chunks, ``callback`` called when one is collected."""
    if model is None:
        return ()
    refs = []
    for m in chunks(model):
        try:
            refs.append(weakref.ref(m, callback))
        except TypeError:  # not weakly referenceable: held strongly (then never dropped)
            refs.append(lambda m=m: m)
    return tuple(refs)


def alive(refs: tuple, model) -> bool:
    """Whether ``refs`` (from :func:`weak`) still point at exactly ``model``'s chunks."""
    now = () if model is None else chunks(model)
    return len(refs) == len(now) and all(r() is m for r, m in zip(refs, now))
