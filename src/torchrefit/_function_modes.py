"""The caller's torch function modes set aside while torchrefit does its own work.

A ``TorchFunctionMode`` active on the calling thread is called back, in Python, on every
torch call made from Python (``data_ptr``, ``detach``, ``view``, ``is_set_to``), and a
device mode (``torch.set_default_device``, ``with torch.device(...)``) also places every
tensor that a factory call makes without naming a device. Inside torchrefit both hurt:

* time: with ``torch.set_default_device`` set, a ``data_ptr`` call cost 1.0 us instead
  of 0.06 us (2-core CPU, torch 2.13), and a qwen3-shaped toy pair (8 layers, 4182
  tensors) took 0.225 s instead of 0.115 s to build and refit first, and each later
  refit 9 ms more host time (``watch="every"``'s checks);
* correctness: the one-sided transports' control messages (CPU buffers that gloo
  carries and ctypes reads) were made on the default device; with ``"meta"`` one rank
  failed reading a header and its peer waited forever.

So ``Refitter``'s public methods run with this thread's function modes popped
(:func:`modes_set_aside`) and pushed back afterwards, also on an exception. The
caller's own code that torchrefit calls back (a custom layout adapter, a
``load_weights`` sink, FSDP2's reshard after a refit) runs with them in place again
(:func:`caller_modes`). Dispatch modes (``TorchDispatchMode``) are not touched.

The mode stack is reached through ``torch._C``'s stack functions (what
``torch.overrides`` uses); where a torch lacks them, nothing is set aside.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

import torch

__all__ = ["modes_set_aside", "caller_modes"]

P = ParamSpec("P")
R = TypeVar("R")

_C = torch._C
_STACK = all(hasattr(_C, n) for n in (
    "_len_torch_function_stack", "_pop_torch_function_stack", "_push_on_torch_function_stack"))
# per thread (the mode stack is per thread): the modes the innermost set-aside popped
_aside = threading.local()


def _pop_all() -> list:
    """Every function mode of this thread, popped; bottom of the stack first."""
    modes = [_C._pop_torch_function_stack() for _ in range(_C._len_torch_function_stack())]
    modes.reverse()
    return modes


def _push_all(modes: list) -> None:
    for mode in modes:
        _C._push_on_torch_function_stack(mode)


def modes_set_aside(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run with this thread's torch function modes popped (pushed back after)."""

    @functools.wraps(fn)
    def aside(*args: P.args, **kwargs: P.kwargs) -> R:
        if not _STACK or not _C._len_torch_function_stack():
            return fn(*args, **kwargs)  # the usual case: no mode, nothing to do
        modes = _pop_all()
        outer = getattr(_aside, "modes", None)
        _aside.modes = modes
        try:
            return fn(*args, **kwargs)
        finally:
            _aside.modes = outer
            _push_all(modes)

    return aside


@contextmanager
def caller_modes() -> Iterator[None]:
    """The modes the enclosing :func:`modes_set_aside` popped, in place again for the
    block (the caller's code: it may rely on its default device)."""
    modes = getattr(_aside, "modes", None)
    if not modes:
        yield
        return
    _push_all(modes)
    try:
        yield
    finally:
        _pop_all()  # back to the empty stack the set-aside work runs on
