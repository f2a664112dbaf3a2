"""The caller's thread state that torchrefit sets aside while it does its own work:
torch function modes, and inference mode where torchrefit makes tensors it keeps.

**Function modes.** A ``TorchFunctionMode`` active on the calling thread is called
back, in Python, on every torch call made from Python (``data_ptr``, ``detach``,
``view``, ``is_set_to``), and a device mode (``torch.set_default_device``,
``with torch.device(...)``) also places every tensor that a factory call makes without
naming a device. Inside torchrefit both hurt:

* time: with ``torch.set_default_device`` set, a ``data_ptr`` call cost 1.0 us instead
  of 0.06 us (2-core CPU, torch 2.13), and a qwen3-shaped toy pair (8 layers, 4182
  tensors) took 0.225 s instead of 0.115 s to build and refit first, and each later
  refit 9 ms more host time (``watch="every"``'s checks);
* correctness: the one-sided transports' control messages (CPU buffers that gloo
  carries and ctypes reads) were made on the default device; with ``"meta"`` one rank
  failed reading a header and its peer waited forever.

So ``Refitter``'s public methods pop this thread's function modes (:func:`set_aside`)
and push them back afterwards, also on an exception. Dispatch modes
(``TorchDispatchMode``) are not touched. The mode stack is reached through
``torch._C``'s stack functions (what ``torch.overrides`` uses); where a torch lacks
them, nothing is popped.

**Inference mode.** A tensor made inside ``torch.inference_mode()`` is an inference
tensor: it can be written in place only inside inference mode. A Refitter built or
first refitted inside it (an engine's worker methods run there) kept such buffers
buffers, and its next refit outside raised ("Inplace update to inference tensor
outside InferenceMode"). So what builds tensors torchrefit keeps (construction,
compiling, attaching a peer's table, ``verify``) runs outside inference mode
(:func:`outside_inference`): normal tensors, writable in either mode. Copies into the
model's own tensors run in the caller's mode, as the caller's model requires, and so
does capturing them in a CUDA graph while compiling (:func:`caller_inference`): an
engine built inside inference mode holds inference tensors, which only inference mode
may write.

**Callbacks.** The caller's own code that torchrefit calls (a custom layout adapter,
a ``load_weights`` sink, FSDP2's reshard after a refit) runs with the caller's
function modes and inference mode in place again (:func:`caller_state`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import ParamSpec, TypeVar

import torch

__all__ = ["set_aside", "caller_state", "outside_inference", "caller_inference"]

P = ParamSpec("P")
R = TypeVar("R")

_C = torch._C
_STACK = all(hasattr(_C, n) for n in (
    "_len_torch_function_stack", "_pop_torch_function_stack", "_push_on_torch_function_stack"))


class _Aside(threading.local):
    """Per thread (mode stacks and inference mode are): what the outermost
    :func:`set_aside` on this thread took from its caller."""

    def __init__(self) -> None:
        self.depth = 0
        self.modes: list = []
        self.inference = False


_aside = _Aside()


def _pop_all() -> list:
    """Every function mode of this thread, popped; bottom of the stack first."""
    if not _STACK:
        return []
    modes = [_C._pop_torch_function_stack() for _ in range(_C._len_torch_function_stack())]
    modes.reverse()
    return modes


def _push_all(modes: list) -> None:
    for mode in modes:
        _C._push_on_torch_function_stack(mode)


def set_aside(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run with this thread's torch function modes popped (pushed back after);
    the caller's inference mode is noted for :func:`caller_state`."""

    @functools.wraps(fn)
    def aside(*args: P.args, **kwargs: P.kwargs) -> R:
        state = _aside
        if state.depth:  # a Refitter method inside another (refit's verify): already aside
            return fn(*args, **kwargs)
        # nothing to pop, the common case, costs one C call: every refit() starts here,
        # right after its host waited, where each Python step costs several times its
        # warm time
        modes = _pop_all() if _STACK and _C._len_torch_function_stack() else ()
        state.depth, state.modes, state.inference = 1, modes, torch.is_inference_mode_enabled()
        try:
            return fn(*args, **kwargs)
        finally:
            state.depth, state.modes = 0, ()
            if modes:
                _push_all(modes)

    return aside


@contextmanager
def caller_state() -> Iterator[None]:
    """For the block (the caller's own code): the function modes and inference mode that
    the enclosing :func:`set_aside` found, in place again."""
    if not _aside.depth:
        yield
        return
    modes, inference = _aside.modes, _aside.inference
    _aside.depth = 0  # the caller's code may call torchrefit again: it sets aside anew
    with ExitStack() as stack:
        if inference and not torch.is_inference_mode_enabled():
            stack.enter_context(torch.inference_mode())
        _push_all(modes)
        try:
            yield
        finally:
            _pop_all()  # back to the empty stack torchrefit's work runs on
            _aside.depth, _aside.modes, _aside.inference = 1, modes, inference


def outside_inference(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run outside inference mode (and without grad) where the caller is in it,
    so that the tensors it makes and keeps are normal tensors."""

    @functools.wraps(fn)
    def outside(*args: P.args, **kwargs: P.kwargs) -> R:
        if not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode(False), torch.no_grad():
            return fn(*args, **kwargs)

    return outside


@contextmanager
def caller_inference() -> Iterator[None]:
    """Within :func:`set_aside`, the caller's inference mode again for the block, where
    :func:`outside_inference` left it: for work that writes the model's own tensors while
    compiling (capturing the copies in a CUDA graph runs them once), which may be
    inference tensors that only inference mode may write (an engine built inside it)."""
    if _aside.depth and _aside.inference and not torch.is_inference_mode_enabled():
        with torch.inference_mode():
            yield
    else:
        yield
