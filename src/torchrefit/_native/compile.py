"""Compiling one C++ source into a shared library in the kernel cache, for the native
watch checks (``_native.watch``) and the delta kernels (``_native.delta``).

The source and the library are written under names of this process and thread and the
library renamed into place, so processes (or threads) building at once never load half
of one.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

__all__ = ["compile_library"]


def compile_library(where: Path | None, filename: str, source: str, flags: Sequence[str],
                    link: Sequence[str] = (), verbose: bool = False) -> Path:
    """Compile ``source`` with the C++ compiler (``$CXX``, else ``c++``) and ``flags``
    into ``where / filename`` (``link``: what follows the output on the command line);
    returns the file. ``where`` None: the kernel cache is off, which raises."""
    if where is None:
        raise RuntimeError("the kernel cache is off (settings.kernel_cache, TORCHREFIT_KERNEL_CACHE=0): "
                           "nowhere to build into")
    where.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}.{threading.get_ident()}"
    src = where / f"{Path(filename).stem}.{tag}.cpp"
    src.write_text(source)
    out = where / filename
    tmp = out.with_name(f"{out.name}.{tag}.tmp")
    command = [os.environ.get("CXX", "c++"), *flags, "-fPIC", "-shared", "-pthread", "-std=c++17",
               str(src), "-o", str(tmp), *link]
    if verbose:
        print(" ".join(command))
    try:
        done = subprocess.run(command, capture_output=not verbose, text=True)
    finally:
        src.unlink(missing_ok=True)
    if done.returncode:
        tail = (done.stderr or "").strip().splitlines()[-12:]
        raise RuntimeError(f"{command[0]} exited with {done.returncode}:\n" + "\n".join(tail))
    os.replace(tmp, out)
    return out
