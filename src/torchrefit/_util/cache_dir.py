"""Where torchrefit keeps what it compiled, for later processes on the machine: compiled
kernel images (``execute.kernels.image_cache``) in this directory, the optional native watch
check (``_native.watch``) next to it.

``settings.kernel_cache`` (environment: ``TORCHREFIT_KERNEL_CACHE``; a directory, ``0``
turns the cache off), else
``$XDG_CACHE_HOME/torchrefit/kernels`` or ``~/.cache/torchrefit/kernels``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from .. import settings

__all__ = ["cache_dir"]


def cache_dir() -> Path | None:
    """The cache's directory, or None where ``settings.kernel_cache`` is ``"0"``."""
    # looked up on every delta message (``_native.delta.kernels``): the path is made once
    # per setting and home
    return _cache_dir(settings.current().kernel_cache.strip(), os.environ.get("XDG_CACHE_HOME"),
                      os.environ.get("HOME"))


@functools.lru_cache(maxsize=8)
def _cache_dir(raw: str, xdg: str | None, home: str | None) -> Path | None:
    if raw == "0":
        return None
    if raw:
        return Path(raw)
    base = xdg or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchrefit" / "kernels"
