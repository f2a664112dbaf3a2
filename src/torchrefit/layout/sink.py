"""A destination that only accepts ``load_weights(iterable of (name, tensor))``.

vLLM and SGLang engines load weights through ``model.load_weights(weights)``, fusing
and sharding them themselves; they hold no tensor torchrefit could write into. An
engine rank passes ``dst_layout=tr.load_weights_sink(engine.load_weights,
names_and_shapes, bucket_bytes=...)`` (and its engine object, or any placeholder, as
``dst_model``, where the version is stamped). The sink describes the tensors it
wants, whole (``(name, shape[, dtype])``) or sharded as the engine declares
(``(name, TensorSpec[, dtype])``: the global name, global shape and the pieces this
rank wants), and receives them into one reused buffer of at most ``bucket_bytes``:

1. describing allocates the buffer (``min(bucket_bytes, what this rank wants)``)
   and views every tensor at its start;
2. after planning, the ``Refitter`` calls :meth:`SinkDescribed.place` with the bucket
   sequence every rank derived (``plan.buckets``): each bucket's tensors are laid
   out from the buffer's start;
3. each ``refit()`` runs one phase per bucket and, on this rank, calls
   :meth:`SinkDescribed.deliver` after each: ``load_weights`` gets that bucket's
   ``(name, tensor)`` pairs, then the next bucket overwrites the buffer. So
   ``load_weights`` must copy what it keeps (vLLM's and SGLang's weight loaders do);
   on CUDA it runs on the caller's stream, after the bucket landed and before the
   next bucket is written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from .._util.caller_state import caller_state
from ..errors import LayoutError
from ._described import Described
from ._types import ModelLayout, TensorLayout, dtype_name
from .explicit import TensorSpec
from .sharding import whole_piece

__all__ = ["load_weights_sink", "LoadWeightsSink", "SinkDescribed", "SINK_ALIGN"]

#: byte alignment of each tensor in the buffer (any dtype; planning's bucket rule uses it)
SINK_ALIGN = 256


@dataclass(frozen=True)
class SinkDescribed(Described):
    """A sink rank's description: the wanted tensors and how to hand buckets over."""

    bucket_bytes: int = 0
    sink: LoadWeightsSink | None = None

    def place(self, buckets: Sequence[Sequence[str]]) -> None:
        """Lay each bucket's tensors out from the buffer's start (same rule as planning)."""
        self.sink.place(self, buckets)

    def deliver(self, names: Sequence[str]) -> int:
        """Hand the tensors of one bucket (global names) to ``load_weights``; the count."""
        return self.sink.deliver(self, names)


class LoadWeightsSink:
    """The ``dst_layout`` :func:`load_weights_sink` returns (a layout adapter)."""

    def __init__(self, load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
                 tensors: Iterable[tuple], *, bucket_bytes: int,
                 dtype: torch.dtype | None, device: torch.device | str | None) -> None:
        if not callable(load_weights):
            raise TypeError(f"load_weights_sink: load_weights must be callable, not {load_weights!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"load_weights_sink: bucket_bytes must be a positive int, not {bucket_bytes!r}")
        self.load_weights = load_weights
        self.bucket_bytes = bucket_bytes
        self.wanted = [_entry(e, dtype) for e in tensors]
        self.device = torch.device(device) if device is not None else _default_device()
        self.by_global = {spec.name: key for key, spec, _ in self.wanted}
        self.buffer: torch.Tensor | None = None

    def __call__(self, model) -> SinkDescribed:
        """Describe (on this rank, while the ``Refitter`` describes): layouts, one buffer."""
        entries, sizes = [], {}
        for key, spec, dt in self.wanted:
            local = _local_shape(spec)
            entries.append((key, TensorLayout(spec.name, spec.global_shape, dtype_name(dt),
                                              local, spec.pieces)))
            sizes[key] = (local, dt)
        layout = ModelLayout(tuple(entries))  # duplicate names raise LayoutError here
        biggest = max((_nbytes(s, d) for s, d in sizes.values()), default=0)
        if biggest > self.bucket_bytes:
            key = max(sizes, key=lambda k: _nbytes(*sizes[k]))
            raise LayoutError(f"{key}: {biggest} bytes exceed the sink's bucket_bytes "
                              f"{self.bucket_bytes}; raise bucket_bytes to at least the largest tensor")
        total = sum(-(-_nbytes(s, d) // SINK_ALIGN) * SINK_ALIGN for s, d in sizes.values())
        self.buffer = torch.empty(min(self.bucket_bytes, total), dtype=torch.uint8, device=self.device)
        tensors = {key: self._view(0, shape, dt) for key, (shape, dt) in sizes.items()}
        return SinkDescribed(layout, tensors, None, self.bucket_bytes, self)

    def _view(self, offset: int, shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
        n = _nbytes(shape, dt)
        return self.buffer[offset: offset + n].view(dt).view(shape)

    def place(self, described: SinkDescribed, buckets: Sequence[Sequence[str]]) -> None:
        tensors = described.tensors
        for names in buckets:
            offset = 0
            for name in names:
                key = self.by_global.get(name)
                if key is None:
                    continue
                t = tensors[key]
                offset = -(-offset // SINK_ALIGN) * SINK_ALIGN
                if offset + t.nbytes > self.buffer.numel():  # plan_buckets' budget rule broke
                    raise AssertionError(f"{name}: bucket overflows the sink buffer")
                tensors[key] = self._view(offset, tuple(t.shape), t.dtype)
                offset += t.nbytes

    def deliver(self, described: SinkDescribed, names: Sequence[str]) -> int:
        pairs = [(self.by_global[n], described.tensors[self.by_global[n]])
                 for n in names if n in self.by_global]
        if pairs:
            with caller_state():  # the engine's code, with the caller's default device
                self.load_weights(pairs)
        return len(pairs)


def load_weights_sink(
    load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
    names_and_shapes: Iterable[tuple],
    *,
    bucket_bytes: int = 1 << 30,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> LoadWeightsSink:
    """A ``dst_layout`` for an engine that loads weights through ``load_weights``.

    ``names_and_shapes``: ``(name, global shape)``, ``(name, global shape, dtype)``,
    or ``(name, TensorSpec, dtype)`` for a tensor the engine wants sharded (its
    global name, global shape and the pieces this rank wants; see
    ``tr.shard_pieces``); ``dtype`` is the default dtype, ``device`` where the buffer
    lives (default: the current CUDA device, else CPU). Names are the destination's
    (after ``name_map``). The sink's extra memory is one buffer of at most
    ``bucket_bytes``; the message pools stay bounded by the Refitter's ``pool_bytes``.
    """
    return LoadWeightsSink(load_weights, names_and_shapes, bucket_bytes=bucket_bytes,
                           dtype=dtype, device=device)


def _entry(e: tuple, default: torch.dtype | None) -> tuple[str, TensorSpec, torch.dtype]:
    if not isinstance(e, (tuple, list)) or len(e) not in (2, 3):
        raise LayoutError(f"load_weights_sink: expected (name, shape[, dtype]), got {e!r}")
    name, shape = e[0], e[1]
    dt = e[2] if len(e) == 3 else default
    if not isinstance(dt, torch.dtype):
        raise LayoutError(f"{name}: the sink needs a dtype (give (name, shape, dtype) or dtype=)")
    if isinstance(shape, TensorSpec):
        return str(name), shape, dt
    shape = tuple(int(s) for s in shape)
    return str(name), TensorSpec(str(name), shape, whole_piece(shape)), dt


def _local_shape(spec: TensorSpec) -> tuple[int, ...]:
    """The local tensor the pieces tile: the furthest extent of any piece per dim."""
    return tuple(max(p.local_offset[d] + p.box.size[d] for p in spec.pieces)
                 for d in range(len(spec.global_shape))) if spec.pieces else ()


def _nbytes(shape: tuple[int, ...], dt: torch.dtype) -> int:
    n = dt.itemsize
    for s in shape:
        n *= s
    return n


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
