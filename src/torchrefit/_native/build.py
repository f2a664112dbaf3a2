"""Building ``watch="every"``'s native checks (``_native.watch``) in the background.

The Python checks cost a few hundred nanoseconds per tensor and check: a MoE trainer's
thousands of tensors then spend milliseconds of host time per refit before the first
copy is queued. The native checks answer the same question in one C++ call each, but
they are compiled per environment (torch's and Python's versions), and a refit cannot
wait tens of seconds for a compiler.

So a Refitter that watches many tensors and finds no build asks for one here: one
process per machine and environment (a lock file beside the build) runs
``python -m torchrefit native build`` at the lowest CPU priority, detached from the
caller's process group; the refits meanwhile use the Python checks, and the first refit
after the build landed switches to the native ones (``Refitter`` asks
:meth:`BackgroundBuild.ready`, which costs a clock read per refit and a ``stat`` at
most once a second). A failed build leaves a marker with the compiler's error, so later
processes of the same environment do not try again; ``torchrefit native build`` says
why and retries.

``Settings.native_watch`` chooses: ``"auto"`` (this), ``"off"`` (Python checks only).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .._util.cache_dir import cache_dir
from . import watch as native

__all__ = ["BUILD_MIN_TENSORS", "BackgroundBuild", "start_background_build", "failure_marker"]

_log = logging.getLogger("torchrefit")

#: tensors a rank watches (both sides) from which a missing build is started: below it the
#: Python checks take well under 0.1 ms, not worth a compiler on the machine
BUILD_MIN_TENSORS = 512
#: a lock older than this is a builder that died: another process may build
_STALE_LOCK_S = 900.0
_LOOK_EVERY_S = 1.0

_started: dict[Path, BackgroundBuild] = {}  # one per environment's build folder, per process


def _lock(where: Path) -> Path:
    return where / "building.lock"


def failure_marker(where: Path) -> Path:
    """Where a failed background build leaves the compiler's error for this environment."""
    return where / "failed.txt"


@dataclass
class BackgroundBuild:
    """A build of this environment's native checks, by a process this one started
    (``proc``) or by another one (``proc`` None: the lock was taken)."""

    where: Path
    proc: subprocess.Popen | None
    _next_look: float = 0.0
    _gave_up: bool = field(default=False)

    def ready(self) -> bool:
        """True once the build is importable (``_native.watch.module()`` returns it);
        False while it runs, and for good once it failed. Cheap enough for every refit."""
        if self._gave_up:
            return False
        now = time.monotonic()
        if now < self._next_look:
            return False
        self._next_look = now + _LOOK_EVERY_S
        if self.proc is not None and self.proc.poll() is None:
            return False
        if native.module(fresh=True) is not None:
            return True
        if self.proc is not None or not _lock(self.where).exists():  # the builder finished, with no module
            self._gave_up = True
            _log.info("torchrefit: the native watch checks could not be built (%s); refits use the "
                      "Python checks", failure_marker(self.where))
        return False


def start_background_build() -> BackgroundBuild | None:
    """Start (or join) this environment's build; None where there is nothing to wait for:
    already built, switched off, no cache to build into, no C++ compiler, or an earlier
    build here failed. Called by ``Refitter`` at construction, on each rank."""
    where = native.built_path()
    if where is None or not native.enabled() or native.module() is not None:
        return None
    if where in _started:
        return _started[where]
    if failure_marker(where).exists():
        _log.debug("torchrefit: an earlier native build failed here (%s): not retried",
                   failure_marker(where))
        return None
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        _log.info("torchrefit: no C++ compiler (%s) for the native watch checks; refits use the "
                  "Python checks", compiler)
        return None
    _started[where] = build = BackgroundBuild(where, _spawn(where) if _take_lock(where) else None)
    return build


def _take_lock(where: Path) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    lock = _lock(where)
    for _ in range(2):
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            try:
                if time.time() - lock.stat().st_mtime < _STALE_LOCK_S:
                    return False
                lock.unlink()
            except FileNotFoundError:  # its builder just finished: take it next time round
                pass
        except OSError as e:  # a read-only cache: nowhere to build
            _log.debug("torchrefit: cannot build the native checks in %s (%s)", where, e)
            return False
    return False


def _spawn(where: Path) -> subprocess.Popen | None:
    command = [sys.executable, "-m", "torchrefit", "native", "build", "--background"]
    # the child reads its settings from the environment: the cache this process was
    # configured with (``settings.configure(kernel_cache=...)`` too) must be its
    env = {**os.environ, "TORCHREFIT_KERNEL_CACHE": str(cache_dir())}
    try:
        proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_lowest_priority)
    except OSError as e:
        _lock(where).unlink(missing_ok=True)
        _log.info("torchrefit: could not start the native watch build (%s)", e)
        return None
    _log.info("torchrefit: building the native watch checks in the background (pid %d, into %s)",
              proc.pid, where)
    return proc


def _lowest_priority() -> None:
    try:
        os.nice(19)
    except OSError:
        pass


def run_background_build() -> int:
    """``torchrefit native build --background``: build, leave the error in the failure
    marker if it fails, and free the lock either way. The child process's whole work."""
    where = native.built_path()
    if where is None:
        return 1
    try:
        native.build()
        failure_marker(where).unlink(missing_ok=True)
        return 0
    except Exception as e:  # noqa: BLE001 (recorded for ``torchrefit native build`` to show)
        failure_marker(where).write_text(f"{type(e).__name__}: {e}\n")
        return 1
    finally:
        _lock(where).unlink(missing_ok=True)
