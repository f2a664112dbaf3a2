"""Where torchrefit keeps what it compiled, for later processes on the machine: compiled
kernel images (``execute.kernels.image_cache``) in this directory, the optional native watch
check (``_native.watch``) next to it.

``settings.kernel_cache`` (environment: ``TORCHREFIT_KERNEL_CACHE``; a directory, ``0``
turns the cache off), else
``$XDG_CACHE_HOME/torchrefit/kernels`` or ``~/.cache/torchrefit/kernels``.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import settings

__all__ = ["cache_dir"]


def cache_dir() -> Path | None:
    """The cache's directory, or None where ``settings.kernel_cache`` is ``"0"``."""
    raw = settings.current().kernel_cache.strip()
    if raw == "0":
        return None
    if raw:
        return Path(raw)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchrefit" / "kernels"
