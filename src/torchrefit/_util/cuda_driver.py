"""CUDA driver calls torch does not expose, through ctypes (no compiled extension).

Used by ``transport.ipc`` (stream-written mailbox words), ``execute.kernels.copy_runs`` (loading
and launching the batched copy kernel) and ``execute.runs`` (allocation ranges).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

__all__ = ["driver_function"]


def driver_function(name: str, argtypes: list) -> Callable[..., int]:
    """``name`` (its ``_v2`` where the driver has one) from CUDA's driver library, returning
    its CUresult; RuntimeError where the library or the function is missing."""
    lib = _libcuda()
    for n in (name + "_v2", name):
        f = getattr(lib, n, None)
        if f is not None:
            f.restype, f.argtypes = ctypes.c_int, argtypes
            return f
    raise RuntimeError(f"the CUDA driver has no {name}")


@functools.cache
def _libcuda() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"no CUDA driver library: {e}") from None
