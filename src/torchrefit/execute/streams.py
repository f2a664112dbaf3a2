"""The one place where torchrefit orders CUDA streams (DESIGN invariant 1).

Work that runs on a side stream must first wait for the caller's current stream,
where the producer (the optimizer step) queued the newest weights, and the
caller's stream must wait for the side stream before ``refit()`` returns, so the
consumer (the rollout engine) never reads a half-written destination. Every
transport and the executor go through :class:`SideStream`; none orders streams on
its own. On CPU tensors every helper here is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext

import torch

__all__ = ["SideStream", "host_wait_current"]


class SideStream:
    """A side stream bound to the caller's stream by waits in both directions.

    ``with side.session():`` opens the ordering window: on entry the side stream
    waits for everything already queued on the caller's stream (the producer); on
    exit the caller's stream waits for everything queued on the side stream (so
    the consumer sees finished data). Inside the window, ``with side.placed():``
    puts work on the side stream; work outside it stays on the caller's stream
    and overlaps with the side stream's. On CPU both are no-ops.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._open = False

    @contextmanager
    def session(self, keep_alive: Iterable[torch.Tensor] = ()) -> Iterator[SideStream]:
        if self.stream is None:
            yield self
            return
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)  # producer -> side stream: no stale reads
        self._open = True
        try:
            yield self
        finally:
            self._open = False
            caller.wait_stream(self.stream)  # side stream -> consumer: no torn reads
            for t in keep_alive:
                if t.is_cuda:
                    t.record_stream(self.stream)

    def placed(self):
        """Context placing work on the side stream; only valid inside :meth:`session`."""
        if self.stream is None:
            return nullcontext()
        if not self._open:
            raise RuntimeError("side stream work must run inside SideStream.session()")
        return torch.cuda.stream(self.stream)


def host_wait_current(device: torch.device) -> None:
    """Block the host until work queued so far on ``device``'s current stream is done.

    Used where bytes produced on the GPU must be read by the host (a CPU transport
    fed from GPU tensors). It waits for one stream's event, never the whole device.
    """
    if device.type != "cuda":
        return
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    event.synchronize()
