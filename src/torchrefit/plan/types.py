"""The plan of one rank: immutable, hashable, printable.

Sender and receiver derive the same transfers, in the same order, from the same
gathered rosters: a transfer is identified by the destination global tensor and
the region of it (``name``, ``region``), which both sides compute.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .._util.format import format_bytes as _fmt
from ..layout._types import Box, dtype_from_name

__all__ = ["Transfer", "LocalCopy", "Quantize", "RankPlan", "itemsize", "shadow_key", "fp8_send_keys"]

_ITEMSIZE: dict[str, int] = {}


def itemsize(dtype: str) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = dtype_from_name(dtype).itemsize
    return size


@dataclass(frozen=True, slots=True)
class Transfer:
    """One region sent to or received from ``peer``.

    ``key`` and ``local_box`` locate the region in this rank's local tensor; the
    bytes on the wire are in ``wire_dtype`` (the source's dtype), converted to
    ``local_dtype`` on receipt where they differ.
    """

    peer: int
    name: str
    region: Box
    key: str
    local_box: Box
    wire_dtype: str
    local_dtype: str

    @property
    def nbytes(self) -> int:
        return self.region.numel * itemsize(self.wire_dtype)


@dataclass(frozen=True, slots=True)
class LocalCopy:
    """A region copied between two local tensors of this rank (no transport)."""

    name: str
    region: Box
    src_key: str
    src_box: Box
    dst_key: str
    dst_box: Box
    src_dtype: str
    dst_dtype: str

    @property
    def nbytes(self) -> int:
        return self.region.numel * itemsize(self.dst_dtype)


@dataclass(frozen=True, slots=True)
class Quantize:
    """Box ``region`` of FP8 destination ``name`` quantized on this rank: values read
    from ``src_key`` [``src_box``] (dtype ``src_dtype``), FP8 written to ``dst_key``
    [``dst_box``] and the scales to ``scale_key`` [``scale_box``].

    ``received`` False: before the exchange, from this rank's source (the region is
    whole blocks of one source piece): into the destination itself where the source is
    local, or into FP8 buffers (``staged``; keys from :func:`fp8_send_keys`) that the
    sends then carry as FP8 and scales. ``received`` True: after the exchange, a whole
    destination piece from the shadow (:func:`shadow_key`) the exchange filled in the
    source's dtype (some block of it spans source pieces, or the transport is one-sided).
    """

    name: str
    region: Box
    src_key: str
    src_box: Box
    dst_key: str
    dst_box: Box
    scale_key: str
    scale_box: Box
    src_dtype: str
    per_tensor: bool
    received: bool
    staged: bool = False

    @property
    def nbytes(self) -> int:
        """FP8 bytes written (one per element)."""
        return self.region.numel


def shadow_key(key: str) -> str:
    """The destination key under which a rank holds an FP8 tensor's high-precision
    shadow (the executor fills it; a ``received`` :class:`Quantize` reads it)."""
    return f"{key} (shadow)"


def fp8_send_keys(name: str, region: Box) -> tuple[str, str]:
    """Source-side keys of the FP8 values and scales a sender quantizes ``region`` of
    destination ``name`` into before sending them."""
    return f"{name}{region} (fp8)", f"{name}{region} (scale)"


@dataclass(frozen=True)
class RankPlan:
    """Everything rank ``rank`` does in a refit: local copies, sends and receives.

    ``sends`` and ``recvs`` are sorted by (peer, name, region offset), the order
    both ends of every pair agree on.
    """

    rank: int
    world: int
    local: tuple[LocalCopy, ...]
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]
    quantize: tuple[Quantize, ...] = ()
    bytes_local: int = field(init=False)
    bytes_sent: int = field(init=False)
    bytes_received: int = field(init=False)
    #: FP8 value bytes of this rank's destination quantized on the sender (straight from a
    #: local source, or received as FP8) and quantized here on receipt; every refit's
    #: report carries them, so they are summed once here, not per refit. Not in the repr:
    #: it follows from the fields above (tests/test_plan_snapshots.py hashes the repr)
    fp8_bytes: tuple[int, int] = field(init=False, repr=False)

    @classmethod
    def ordered(cls, rank: int, world: int, local: Iterable[LocalCopy],
                sends: Iterable[Transfer], recvs: Iterable[Transfer],
                quantize: Iterable[Quantize] = ()) -> RankPlan:
        """The plan with its copies and transfers in the one order every rank uses:
        sender and receiver of a pair sort the same regions by the same key, so message
        m of the pair holds the same regions at both ends."""
        return cls(rank, world, tuple(sorted(local, key=_copy_order)),
                   tuple(sorted(sends, key=_transfer_order)),
                   tuple(sorted(recvs, key=_transfer_order)),
                   tuple(sorted(quantize, key=_quantize_order)))

    def __post_init__(self) -> None:
        object.__setattr__(self, "bytes_local", sum(c.nbytes for c in self.local))
        object.__setattr__(self, "bytes_sent", sum(t.nbytes for t in self.sends))
        object.__setattr__(self, "bytes_received", sum(t.nbytes for t in self.recvs))
        sender = sum(q.nbytes for q in self.quantize if not q.received and not q.staged)
        sender += sum(t.nbytes for t in self.recvs if t.local_dtype == "float8_e4m3fn")
        object.__setattr__(self, "fp8_bytes", (sender, sum(q.nbytes for q in self.quantize if q.received)))

    @property
    def send_peers(self) -> tuple[int, ...]:
        return tuple(sorted({t.peer for t in self.sends}))

    @property
    def recv_peers(self) -> tuple[int, ...]:
        return tuple(sorted({t.peer for t in self.recvs}))

    def bytes_by_peer(self) -> dict[tuple[str, int], int]:
        out: dict[tuple[str, int], int] = {}
        for kind, ts in (("send", self.sends), ("recv", self.recvs)):
            for t in ts:
                out[(kind, t.peer)] = out.get((kind, t.peer), 0) + t.nbytes
        return out

    def summary(self) -> str:
        lines = [
            f"rank {self.rank} of {self.world}: "
            f"local {len(self.local)} copies {_fmt(self.bytes_local)}, "
            f"send {len(self.sends)} regions {_fmt(self.bytes_sent)} to {len(self.send_peers)} peers, "
            f"receive {len(self.recvs)} regions {_fmt(self.bytes_received)} "
            f"from {len(self.recv_peers)} peers"
        ]
        for (kind, peer), n in sorted(self.bytes_by_peer().items(), key=lambda kv: (kv[0][1], kv[0][0])):
            lines.append(f"  {kind} {'to  ' if kind == 'send' else 'from'} rank {peer}: {_fmt(n)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def explain(self, tensors: Iterable[str] | None = None) -> str:
        """Per global tensor (all, or those named): each region this rank copies
        locally, receives or sends, from which rank to which, in what dtype (``a -> b``
        where it changes: on the sender, local -> wire; on the receiver, wire -> local),
        and its bytes on the wire."""
        rows: dict[str, list[tuple]] = {}
        for c in self.local:
            rows.setdefault(c.name, []).append(
                (0, c.region, f"rank {self.rank} (local)", c.src_dtype, c.dst_dtype, c.nbytes))
        for t in self.recvs:
            rows.setdefault(t.name, []).append(
                (1, t.region, f"rank {t.peer} -> rank {self.rank}", t.wire_dtype, t.local_dtype,
                 t.nbytes))
        for t in self.sends:
            rows.setdefault(t.name, []).append(
                (2, t.region, f"rank {self.rank} -> rank {t.peer}", t.local_dtype, t.wire_dtype,
                 t.nbytes))
        for q in self.quantize:
            where = "received" if q.received else "to send" if q.staged else "from source"
            rows.setdefault(q.name, []).append(
                (3, q.region, f"rank {self.rank} ({where})", q.src_dtype, "float8_e4m3fn",
                 q.nbytes))
        lines = [self.summary().partition("\n")[0]]
        for name in sorted(rows if tensors is None else set(rows) & set(tensors)):
            moved = sorted(rows[name], key=lambda r: (r[0], r[1].offset, r[2]))
            totals = [0] * len(_EXPLAIN_KINDS)
            for kind, *_, nbytes in moved:
                totals[kind] += nbytes
            lines.append(f"{name}: " + ", ".join(
                f"{_EXPLAIN_KINDS[k][1]} {_fmt(n)}" for k, n in enumerate(totals) if n))
            for kind, region, route, wire, local, nbytes in moved:
                dtype = wire if wire == local else f"{wire} -> {local}"
                lines.append(f"  {_EXPLAIN_KINDS[kind][0]:<8}{str(region):<24} {route:<24}"
                             f"{dtype:<22}{_fmt(nbytes):>10}")
        return "\n".join(lines)


_EXPLAIN_KINDS = (("copy", "copied locally"), ("receive", "received"), ("send", "sent"),
                  ("quantize", "quantized"))


def _transfer_order(t: Transfer) -> tuple:
    return (t.peer, t.name, t.region.offset)


def _quantize_order(q: Quantize) -> tuple:
    return (q.received, q.staged, q.name, q.region.offset)


def _copy_order(c: LocalCopy) -> tuple:
    return (c.name, c.region.offset)

