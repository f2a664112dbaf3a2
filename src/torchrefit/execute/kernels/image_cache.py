"""Compiled kernel images kept on disk, so a process's first refit compiles nothing that
an earlier process on the machine compiled already.

Where: ``settings.kernel_cache`` (environment: ``TORCHREFIT_KERNEL_CACHE``; a directory,
``0`` turns the cache off), else
``$XDG_CACHE_HOME/torchrefit/kernels`` or ``~/.cache/torchrefit/kernels``. An image is
filed under a hash of everything that made it (the caller's key: source, options,
target architecture, CUDA version), written to a temporary file and renamed into place,
so ranks compiling at once never read half a file. Where the directory cannot be
written the image is simply not kept. A cached image that the driver refuses is
dropped (:func:`forget`) and compiled again by the caller.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from ..._util.cache_dir import cache_dir

__all__ = ["cache_dir", "cached", "forget"]


def _path(directory: Path, name: str, key: str) -> Path:
    return directory / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.bin"


def cached(name: str, key: str, make: Callable[[], bytes]) -> tuple[bytes, bool]:
    """The image filed under ``name`` and ``key``, and True; or ``make()``'s, filed there
    for later processes where the directory can be written, and False."""
    directory = cache_dir()
    if directory is None:
        return make(), False
    path = _path(directory, name, key)
    try:
        image = path.read_bytes()
        if image:
            return image, True
    except OSError:
        pass
    image = make()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(image)
        os.replace(tmp, path)
    except OSError:  # read-only or no home: compile again next time
        pass
    return image, False


def forget(name: str, key: str) -> None:
    """Drop the image filed under ``name`` and ``key`` (one the driver refused)."""
    directory = cache_dir()
    if directory is not None:
        try:
            _path(directory, name, key).unlink()
        except OSError:
            pass
