"""Every tunable of torchrefit in one frozen value, read once per process.

A process's settings are :func:`current`: the defaults below, with the environment's
overrides for the deployment settings (those a job launcher, not the code, knows), read
the first time any of them is asked for. Code changes them with :func:`configure`
(process-wide, validated at once) or :func:`overridden` (for a block); nothing else in
torchrefit reads a ``TORCHREFIT_*`` variable. Settings that change what a refit does
must be alike on every rank of a refit group (``transport`` is checked; the others change
only how this rank copies, never which bytes land).

======================  ==========  ========================================  ============================================
name                    default     environment override                      what it trades
======================  ==========  ========================================  ============================================
``transport``           ``""``      ``TORCHREFIT_TRANSPORT``                  what ``transport="auto"`` means, for jobs
                                                                              that cannot pass ``transport=``; ``""``: the
                                                                              preferred available one
``kernel_cache``        ``""``      ``TORCHREFIT_KERNEL_CACHE``               where compiled copy kernels and the native
                                                                              watch checks are kept (``""``: the user's
                                                                              cache directory; ``"0"``: no cache, each
                                                                              process compiles again)
``nvrtc``               ``""``      ``TORCHREFIT_NVRTC``                      the NVRTC library copy kernels are compiled
                                                                              with (``""``: the one torch ships with)
``nvshmem_shared_gpu``  False       ``TORCHREFIT_NVSHMEM_SHARED_GPU``         let NVSHMEM ranks share one GPU (only under
                                                                              CUDA MPS; without it NVSHMEM hangs)
``nixl_timeout``        None        ``TORCHREFIT_NIXL_TIMEOUT``               seconds a NIXL write or notification may
                                                                              take (None: the Refitter's ``timeout``)
``mailbox``             True        ``TORCHREFIT_MAILBOX`` (``0``: off)       one-sided control words through host shared
                                                                              memory (microseconds) instead of Gloo
                                                                              messages; off where ``/dev/shm`` cannot be
                                                                              mapped between the processes
``native_watch``        True        ``TORCHREFIT_NATIVE_WATCH`` (``0``: off)  ``watch="every"``'s checks in C++ where
                                                                              built, and a background build for models of
                                                                              many tensors; off: the Python checks (slower
                                                                              per refit), no compiler started
``branches``            8           --                                        side streams the large local copies spread
                                                                              over; fewer for processes time-sliced on one
                                                                              GPU without MPS
``sm_copy_below``       None        --                                        plain large copies below this many bytes run
                                                                              as elementwise kernels rather than memcpy
                                                                              (None: all of them in programs of mostly
                                                                              mid-sized copies, else none)
``batched_copy``        ``"auto"``  --                                        which large copies join the one batched
                                                                              kernel launch: ``auto`` (programs of many
                                                                              mid-sized copies), ``all`` or ``none``
``fleet_secret``        ``""``      ``TORCHREFIT_FLEET_SECRET``               the secret ``Fleet`` and ``join`` share when
                                                                              neither is given ``secret=`` or
                                                                              ``secret_file=`` (``""``: none; they raise)
``delegate_copies``     True        --                                        ranks sharing a GPU hand their copies to one
                                                                              of them (one graph, no turns); False: they
                                                                              take turns, as FP8-quantizing ranks always
                                                                              do
``delta_dense_above``   0.1         --                                        a delta message with more than this share of
                                                                              its elements changed goes dense: sparse costs
                                                                              more time per changed element (diff, encode,
                                                                              scatter) than the bytes it saves on a fast
                                                                              wire; lower it where the wire is as fast as
                                                                              memory, raise it (to 1) where bytes dominate
``native_delta``        True        --                                        delta refits diff and apply CPU tensors in one
                                                                              native pass each (``_native.delta``, built in
                                                                              about a second on a thread the first time);
                                                                              off: torch ops (same bytes, slower per
                                                                              changed element), no compiler started
``delta_threads``       0           --                                        threads one native diff or apply spreads
                                                                              over; 0: torch's intra-op threads in this
                                                                              process (``torch.get_num_threads()``: its
                                                                              cores, or 1 where a launcher such as
                                                                              torchrun gives several ranks a host)
``triton_delta``        True        --                                        delta refits diff and apply CUDA tensors with
                                                                              Triton kernels (one pass over the source and
                                                                              its reference); off, or without Triton: the
                                                                              torch ops (same bytes on the wire)
``pause_patience``      0.2         --                                        seconds a rank of a vLLM fleet replica of
                                                                              several ranks waits for its peers to pause
                                                                              their steps before an install; past it every
                                                                              rank lets go (a step may need a peer's lock)
                                                                              and tries again
======================  ==========  ========================================  ============================================
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace

__all__ = ["Settings", "ENV", "BATCHED_COPY_MODES", "MAX_BRANCHES", "current", "configure", "overridden",
           "from_env", "reload"]

#: the most side streams the large local copies may spread over (``execute.local``)
MAX_BRANCHES = 8
BATCHED_COPY_MODES = ("auto", "all", "none")


@dataclass(frozen=True)
class Settings:
    """The process's settings; see the module's table for what each trades."""

    #: what ``transport="auto"`` means on this rank ("" or "auto": the preferred one)
    transport: str = ""
    #: the kernel cache's directory ("": the user's cache directory; "0": off)
    kernel_cache: str = ""
    #: the NVRTC library to load ("": torch's)
    nvrtc: str = ""
    #: NVSHMEM ranks may share a GPU (CUDA MPS)
    nvshmem_shared_gpu: bool = False
    #: seconds a NIXL transfer or notification may take (None: the Refitter's timeout)
    nixl_timeout: float | None = None
    #: one-sided transports exchange control words through host shared memory
    mailbox: bool = True
    #: the native watch checks are used where built, and built in the background
    native_watch: bool = True
    #: side streams for large local copies, 1 to MAX_BRANCHES
    branches: int = MAX_BRANCHES
    #: plain large copies below this many bytes run as kernels (None: the size rule)
    sm_copy_below: int | None = None
    #: which large copies are batched into one launch: auto, all or none
    batched_copy: str = "auto"
    #: ranks copying on one GPU hand their copies to one of them
    delegate_copies: bool = True
    #: the fleet's shared secret where Fleet / join get none ("": none, they raise)
    fleet_secret: str = ""
    #: a delta message with more than this share of its elements changed is sent dense
    delta_dense_above: float = 0.1
    #: delta refits diff and apply CPU tensors with the native kernels where built
    native_delta: bool = True
    #: threads one native delta diff or apply spreads over (0: torch's intra-op threads)
    delta_threads: int = 0
    #: delta refits diff and apply CUDA tensors with the Triton kernels
    triton_delta: bool = True
    #: seconds a rank of a multi-rank vLLM fleet replica waits for its peers to pause
    pause_patience: float = 0.2

    def __post_init__(self) -> None:
        if not 1 <= self.branches <= MAX_BRANCHES:
            raise ValueError(f"torchrefit settings: branches must be 1 to {MAX_BRANCHES}, not {self.branches}")
        if self.sm_copy_below is not None and self.sm_copy_below < 0:
            raise ValueError(f"torchrefit settings: sm_copy_below must be bytes >= 0 or None, "
                             f"not {self.sm_copy_below}")
        if not 0.0 <= self.delta_dense_above <= 1.0:
            raise ValueError(f"torchrefit settings: delta_dense_above must be a share of elements from 0 to 1, "
                             f"not {self.delta_dense_above!r}")
        if not 0 <= self.delta_threads <= 64:
            raise ValueError(f"torchrefit settings: delta_threads must be 0 (torch's intra-op threads) to 64, "
                             f"not {self.delta_threads!r}")
        if self.batched_copy not in BATCHED_COPY_MODES:
            raise ValueError(f"torchrefit settings: batched_copy must be one of {', '.join(BATCHED_COPY_MODES)}, "
                             f"not {self.batched_copy!r}")
        if not self.pause_patience > 0:
            raise ValueError(f"torchrefit settings: pause_patience must be seconds > 0, "
                             f"not {self.pause_patience!r}")
        if self.nixl_timeout is not None and not self.nixl_timeout > 0:
            raise ValueError(f"torchrefit settings: nixl_timeout must be seconds > 0 or None, "
                             f"not {self.nixl_timeout}")


#: setting -> the environment variable that overrides it (deployment settings only)
ENV = {
    "transport": "TORCHREFIT_TRANSPORT",
    "kernel_cache": "TORCHREFIT_KERNEL_CACHE",
    "nvrtc": "TORCHREFIT_NVRTC",
    "nvshmem_shared_gpu": "TORCHREFIT_NVSHMEM_SHARED_GPU",
    "nixl_timeout": "TORCHREFIT_NIXL_TIMEOUT",
    "mailbox": "TORCHREFIT_MAILBOX",
    "native_watch": "TORCHREFIT_NATIVE_WATCH",
    "fleet_secret": "TORCHREFIT_FLEET_SECRET",
}


def from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """The defaults with ``environ``'s overrides (default: ``os.environ``). A value that
    cannot be read raises ``ValueError`` naming the variable."""
    environ = os.environ if environ is None else environ
    raw = {name: environ[var].strip() for name, var in ENV.items() if environ.get(var, "").strip()}
    changes: dict[str, object] = {}
    for name in ("transport", "kernel_cache", "nvrtc", "fleet_secret"):
        if name in raw:
            changes[name] = raw[name]
    if "nvshmem_shared_gpu" in raw:
        changes["nvshmem_shared_gpu"] = raw["nvshmem_shared_gpu"] == "1"
    for name in ("mailbox", "native_watch"):
        if name in raw:
            changes[name] = raw[name] != "0"
    if "nixl_timeout" in raw:
        try:
            changes["nixl_timeout"] = float(raw["nixl_timeout"])
        except ValueError:
            raise ValueError(f"{ENV['nixl_timeout']}={raw['nixl_timeout']!r} is not a number of seconds") from None
    try:
        return Settings(**changes)
    except ValueError as e:
        raise ValueError(f"{e} (from the environment: {', '.join(ENV[n] for n in raw)})") from None


_current: Settings | None = None


def current() -> Settings:
    """This process's settings (the environment is read on the first call only)."""
    global _current
    if _current is None:
        _current = from_env()
    return _current


def configure(**changes) -> Settings:
    """Change this process's settings (names of :class:`Settings`), validated now; returns
    the new settings. Takes effect for Refitters built or compiled from then on."""
    global _current
    known = {f.name for f in fields(Settings)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(f"torchrefit settings: no setting named {', '.join(unknown)} "
                        f"(settings: {', '.join(sorted(known))})")
    _current = replace(current(), **changes)
    return _current


@contextlib.contextmanager
def overridden(**changes) -> Iterator[Settings]:
    """:func:`configure` for the block only (the settings before it come back after)."""
    global _current
    before = current()
    try:
        yield configure(**changes)
    finally:
        _current = before


def reload() -> Settings:
    """Forget what :func:`configure` changed and read the environment again."""
    global _current
    _current = None
    return current()
