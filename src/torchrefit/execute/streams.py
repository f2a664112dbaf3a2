"""The one place where torchrefit orders CUDA streams (docs/reliability.md: never stale, never torn).

Work that runs on a side stream must first wait for the caller's current stream,
where the producer (the optimizer step) queued the newest weights, and the
caller's stream must wait for the side stream before ``refit()`` returns, so the
consumer (the rollout engine) never reads a half-written destination. Every
transport and the executor go through :class:`SideStreams`; none orders streams on
its own. On CPU tensors every helper here is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext

import torch

__all__ = ["SideStreams"]


class SideStreams:
    """Side streams bound to the caller's stream by waits in both directions.

    ``with side.session(n):`` opens the ordering window over the first ``n`` streams:
    on entry each waits for everything already queued on the caller's stream (the
    producer); on exit the caller's stream waits for everything queued on them (so
    the consumer sees finished data). Inside the window, ``with side.placed(i):``
    puts work on stream ``i``; work outside it stays on the caller's stream and
    overlaps. Inside a CUDA-graph capture the same waits become the graph's fork
    and join. On CPU every helper is a no-op.
    """

    def __init__(self, device: torch.device, count: int = 2) -> None:
        self.device = device
        self.streams = ([torch.cuda.Stream(device=device) for _ in range(count)]
                        if device.type == "cuda" else [])
        self._open = 0

    @contextmanager
    def session(self, n: int | None = None, keep_alive: Iterable[torch.Tensor] = ()) -> Iterator[SideStreams]:
        if not self.streams:
            yield self
            return
        used = self.streams[: n or len(self.streams)]
        caller = torch.cuda.current_stream(self.device)
        for stream in used:
            stream.wait_stream(caller)  # producer -> side stream: no stale reads
        outer, self._open = self._open, len(used)
        try:
            yield self
        finally:
            self._open = outer
            for stream in used:
                caller.wait_stream(stream)  # side stream -> consumer: no torn reads
            for t in keep_alive:
                if t.is_cuda:
                    for stream in used:
                        t.record_stream(stream)

    def placed(self, i: int = 0):
        """Context placing work on stream ``i``; only valid inside :meth:`session`."""
        if not self.streams:
            return nullcontext()
        if i >= self._open:
            raise RuntimeError(f"side stream {i} used outside a SideStreams.session() that opened it")
        return torch.cuda.stream(self.streams[i])
