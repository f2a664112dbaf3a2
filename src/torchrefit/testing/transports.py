"""Which transports a test can run here: the registered ones available in this process."""

from __future__ import annotations

from ..transport.base import registered

__all__ = ["usable_transports"]


def usable_transports(cuda: bool, one_sided_only: bool = False) -> list[str]:
    """Names of the registered transports available here that run on CPU tensors
    (``cuda=False``) or CUDA tensors, most preferred first. Transports whose group
    backend is not Gloo (nccl) are left out: the tests' worlds are Gloo worlds; so are
    transports registered from outside torchrefit (a test's fake one, registered in the
    process that imported it: the worlds' spawned ranks would not know its name)."""
    names = []
    for cls in registered():
        if not cls.__module__.startswith("torchrefit."):
            continue
        if not cls.available() or (cls.needs_cuda and not cuda) or cls.backend != "gloo":
            continue
        if one_sided_only and cls.protocol != "one_sided":
            continue
        names.append(cls.name)
    return names
