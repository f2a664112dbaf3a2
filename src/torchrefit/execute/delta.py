"""Delta exchange: only the elements that changed since the last call cross the wire.

Compiled once per program from the plan's remote transfers, cut into messages as a full
refit's are (``plan.messages.cut_messages``) but of at most :data:`PIECE` bytes, so that
a call has rounds to pipeline. A sending rank keeps, per message, a
reference of exactly the bytes it last sent (in the wire dtype: after a cast or an FP8
quantize, so scales and quantized bytes are diffed, never the source's values). Each call:

1. the sender diffs every message against its reference, bit for bit (integer views: NaN
   payloads, -0.0 and subnormals compare by their bits), and encodes it sparse (per part:
   changed counts per block of 65536 elements, the 16-bit position within the block, the
   values) or dense (the whole message): sparse where it is fewer bytes and at most
   ``settings.delta_dense_above`` of the message changed (past that, time per changed
   element outweighs the bytes saved); the reference is brought up to date;
2. headers tell each receiver, per message, the encoding and the changed count of every
   part (so both ends know every payload's size): message m's travel in the round before
   it (message 0's in a round of their own);
3. round m carries message m of every pair; a receiver scatters a sparse payload into
   its destination views in place (under stage/commit: the twins), or copies a dense
   one, while its sender diffs message m + 2.

Which pairs exchange patches at all is the version chain's decision (``plan.delta_chain``),
taken before the call from numbers every rank gathered: a pair outside it gets every
message dense (the reference is filled on the way), so a receiver never patches a base
it does not hold.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import settings
from ..layout._types import Box, dtype_from_name
from ..plan.delta_chain import UNKNOWN, Chain, delta_pairs
from ..plan.messages import cut_messages, rows_of
from ..plan.types import RankPlan
from ..transport.base import RoundsTransport
from ..transport.collectives import collective, collective_device
from . import delta_native
from .delta_wire import BLOCK, DENSE, SPARSE, sparse_nbytes
from .delta_wire import align as _align
from .kernels import delta_blocks
from .rounds import pinned_pools
from .views import Views

__all__ = ["DeltaRounds", "DeltaStats", "compile_delta", "gather_offers", "BLOCK", "DENSE", "SPARSE",
           "sparse_nbytes", "run_chained", "encode_sends", "header_words", "header_numel", "room"]

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_tokens = itertools.count(1)
#: source bytes per delta message at most: a 128 MiB pair's call takes 4 rounds, so the
#: receiver's apply of one message runs beside the sender's diff of a later one, and each
#: round's fixed cost (a header, a message) stays small next to its diff
PIECE = 32 << 20


@dataclass(frozen=True)
class _Part:
    """One region (or rows of it) of a message: its local view and its place in the
    dense message."""

    view: torch.Tensor  # local, in the local dtype (source: before a cast; destination: after)
    wire: torch.dtype
    offset: int
    numel: int
    key: str = ""  # the local tensor it views and the box of it (one-sided transports register them)
    box: Box | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.wire.itemsize


@dataclass(frozen=True)
class _Message:
    peer: int
    parts: tuple[_Part, ...]
    nbytes: int
    ref: torch.Tensor | None  # sends: the bytes last sent (uint8), on the reference's device


class _Scratch:
    """Buffers a program's delta calls reuse: on CPU a fresh allocation faults its pages in
    on every call, which costs more than the arithmetic. ``out(name, dtype, device)`` is
    an empty view of a kept buffer for an ``out=`` argument: torch grows the buffer's
    storage when a result needs more, and later calls reuse it."""

    def __init__(self) -> None:
        self._kept: dict[tuple, torch.Tensor] = {}
        self.density: dict[tuple[int, int], float] = {}  # per message: the share its last diff found changed

    def buffer(self, name, n: int, dtype: torch.dtype, device: torch.device,
               pinned: bool = False) -> torch.Tensor:
        """``n`` elements of a kept buffer (grown where shorter); ``pinned``: in pinned
        host memory."""
        key = ("buffer", name)
        buf = self._kept.get(key)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            buf = self._kept[key] = torch.empty(max(n, 1), dtype=dtype, device=device, pin_memory=pinned)
        return buf[:n]

    def mask(self, n: int, device: torch.device) -> torch.Tensor:
        return self.buffer("mask", n, torch.bool, device)

    def out(self, name: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._kept.get(name)
        if buf is None or buf.dtype != dtype or buf.device != device:
            buf = self._kept[name] = torch.empty(0, dtype=dtype, device=device)
        return buf[:0]

    def kept(self, device: torch.device):
        """``buffer`` on ``device``, as ``kernels.delta_blocks`` asks for it."""
        return lambda name, n, dtype: self.buffer(name, n, dtype, device)

    def pinned(self, name, n: int) -> torch.Tensor:
        """``n`` bytes of a kept buffer in pinned host memory."""
        return self.buffer(("pinned", name), n, torch.uint8, torch.device("cpu"), pinned=True)

    def payload(self, key: tuple[int, int], n: int, device: torch.device) -> torch.Tensor:
        return self.buffer(("payload", key), n, torch.uint8, device)

    def keep_payload(self, key: tuple[int, int], buf: torch.Tensor) -> None:
        """Encode message ``key``'s sparse payloads into ``buf`` (a buffer another module
        registered) wherever they fit in it."""
        self._kept[("buffer", ("payload", key))] = buf


@dataclass(frozen=True)
class DeltaStats:
    """What one call put on the wire from this rank and took from it (payloads and headers)."""

    wire_bytes_sent: int = 0
    wire_bytes_received: int = 0
    sparse_messages: int = 0
    dense_messages: int = 0


@dataclass
class DeltaRounds:
    """A program's delta exchange. ``ref_epoch``: the call whose bytes the references hold
    (``plan.delta_chain``); ``token``: this compile, distinct from every other."""

    sends: dict[int, list[_Message]]
    recvs: dict[int, list[_Message]]
    device: torch.device
    wire: torch.device
    reference_bytes: int
    ref_epoch: int = UNKNOWN
    token: int = field(default_factory=lambda: next(_tokens))
    pairs: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset())
    last: DeltaStats = DeltaStats()
    pools: list[torch.Tensor | None] = field(default_factory=lambda: [None, None])  # receive buffers, by round parity
    scratch: _Scratch = field(default_factory=_Scratch)

    def pool(self, parity: int, n: int, pinned: bool) -> torch.Tensor:
        """Receive buffer ``parity`` (0 or 1) of at least ``n`` bytes, grown as needed and kept."""
        buf = self.pools[parity]
        if buf is None or buf.numel() < n:
            buf = self.pools[parity] = torch.empty(n, dtype=torch.uint8, device=self.wire, pin_memory=pinned)
        return buf

    @property
    def idle(self) -> bool:
        return not self.sends and not self.recvs

    def arm(self, send: frozenset[int], recv: frozenset[int]) -> None:
        """The pairs that exchange patches in the next call (the rest: dense)."""
        self.pairs = (send, recv)


def compile_delta(views: Views, reference: str, device: torch.device, wire: torch.device,
                  limit: int) -> DeltaRounds:
    """The plan's remote transfers as messages with their views; a reference per sent
    message, on ``device`` (``reference="device"``) or in pinned host memory (``"host"``)."""
    plan: RankPlan = views.plan
    limit = min(limit, PIECE)
    ref_device = device if reference == "device" else torch.device("cpu")
    pinned = reference == "host" and device.type == "cuda"
    out: dict[str, dict[int, list[_Message]]] = {"send": {}, "recv": {}}
    for kind, transfers in (("send", plan.sends), ("recv", plan.recvs)):
        by_peer = defaultdict(list)
        for t in transfers:
            by_peer[t.peer].append(t)
        side = "src" if kind == "send" else "dst"
        for peer, ts in sorted(by_peer.items()):
            msgs = []
            for m in cut_messages(peer, ts, limit):
                parts = tuple(_part(views, side, ts[c.index], c) for c in m.chunks)
                ref = (torch.zeros(m.nbytes, dtype=torch.uint8, device=ref_device, pin_memory=pinned)
                       if kind == "send" else None)
                msgs.append(_Message(peer, parts, m.nbytes, ref))
            out[kind][peer] = msgs
    ref_bytes = sum(m.nbytes for ms in out["send"].values() for m in ms)
    return DeltaRounds(out["send"], out["recv"], device, wire, ref_bytes)


def _part(views: Views, side: str, t, chunk) -> _Part:
    box = rows_of(t.local_box, chunk.rows)
    wire = dtype_from_name(t.wire_dtype)
    return _Part(views.view(side, t.key, box), wire, chunk.offset, chunk.nbytes // wire.itemsize, t.key, box)


def room(msg: _Message, dense_above: float) -> int:
    """Bytes a sparse payload of ``msg`` may take at most where at most ``dense_above`` of
    its elements changed (each part's block counts written even where none changed,
    as the native diff writes them): the room the native diff asks for, and the size of
    the sparse slots one-sided transports register (``execute.delta_one_sided``)."""
    cap = int(dense_above * sum(p.numel for p in msg.parts))
    return sum(sparse_nbytes(p.numel, max(1, min(p.numel, cap)), p.wire.itemsize) for p in msg.parts)


def gather_offers(offer: tuple[int, int], group: dist.ProcessGroup,
                  timeout: float | None) -> list[tuple[int, int]]:
    """Every rank's ``(references' epoch, target's epoch)``: one small all-gather."""
    world = dist.get_world_size(group)
    device = collective_device(group)
    mine = torch.tensor(offer, dtype=torch.int64, device=device)
    out = [torch.empty(2, dtype=torch.int64, device=device) for _ in range(world)]
    collective("agreeing on the delta base versions", dist.all_gather, out, mine,
               group=group, timeout=timeout)
    return [tuple(o.tolist()) for o in out]


# ------------------------------------------------------------------ the sender's side
def _ref_part(msg: _Message, part: _Part) -> torch.Tensor:
    """The reference bytes of ``part`` as its wire dtype, in the view's shape."""
    return msg.ref[part.offset: part.offset + part.nbytes].view(part.wire).view(part.view.shape)


def _current(part: _Part) -> torch.Tensor:
    """The part's current value in the wire dtype (a cast on the sender: a new tensor)."""
    return part.view if part.view.dtype == part.wire else part.view.to(part.wire)


def _diff(cur: torch.Tensor, ref: torch.Tensor, scratch: _Scratch, slot: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major positions (int64, ascending) of the elements whose bits differ and their
    current values; ``ref`` is brought up to date where it differs (a dense send
    overwrites it whole anyway). Results live in ``scratch``'s buffers of ``slot``."""
    it = _INT[cur.element_size()]
    a, b = cur.view(it), ref.view(it)
    if _word_aligned(a) and _word_aligned(b) and cur.element_size() < 8:
        return _diff_words(a.reshape(-1).view(torch.int64), b.reshape(-1).view(torch.int64), cur.dtype,
                           cur.element_size(), scratch, slot)
    if a.is_contiguous() and b.is_contiguous():
        pos = torch.ne(a.reshape(-1), b.reshape(-1), out=scratch.mask(a.numel(), a.device)).nonzero().squeeze(1)
    else:
        pos = (a != b).reshape(-1).nonzero().squeeze(1)
    vals = _flat_get(cur, pos)
    _flat_put(ref, pos, vals)
    return pos, vals


def _found(mask: torch.Tensor, out) -> torch.Tensor:
    """Ascending indices of ``mask``'s true elements. Where it is long, first the runs of
    8 that hold any (the mask read as int64 words), then, where few runs hold any, the
    elements of those runs: a scan of an eighth of the elements plus the runs, against a
    scan of all of them (6x faster at 0.1% of words differing, slower past ~3%)."""
    if mask.numel() % 8 or mask.numel() < 1 << 15:
        return torch.nonzero(mask, out=out("words")).view(-1)
    runs = mask.view(torch.uint8).view(torch.int64)
    hit = torch.nonzero(runs, out=out("runs")).view(-1)
    if hit.numel() > runs.numel() // 16:  # runs hit often: refining them costs more than the plain scan
        return torch.nonzero(mask, out=out("words")).view(-1)
    inside = torch.index_select(runs, 0, hit, out=out("inside")).view(torch.bool)
    lanes = torch.nonzero(inside, out=out("lanes8")).view(-1)
    idx = torch.index_select(hit, 0, torch.bitwise_right_shift(lanes, 3, out=out("words")), out=out("words2"))
    return idx.bitwise_left_shift_(3).bitwise_or_(lanes.bitwise_and_(7))


def _word_aligned(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.numel() * t.element_size() % 8 == 0 and t.storage_offset() * t.element_size() % 8 == 0


def _diff_words(wa: torch.Tensor, wb: torch.Tensor, dtype: torch.dtype, size: int, scratch: _Scratch,
                slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The diff on 8-byte words: one compare over the whole part into a kept mask, then
    the elements of the differing words only; the reference takes those words whole.
    Every intermediate lands in a kept buffer."""
    dev, it, per = wa.device, _INT[size], 8 // size

    def out(name: str, dtype=torch.int64) -> torch.Tensor:
        return scratch.out((name, slot), dtype, dev)
    words = _found(torch.ne(wa, wb, out=scratch.mask(wa.numel(), dev)), out)
    if not words.numel():
        return words, torch.empty(0, dtype=dtype, device=dev)
    now = torch.index_select(wa, 0, words, out=out("now"))
    old = torch.index_select(wb, 0, words, out=out("old"))
    wb.index_copy_(0, words, now)
    sub = torch.ne(now.view(it), old.view(it), out=scratch.mask(now.numel() * per, dev))
    lanes = torch.nonzero(sub, out=out("lanes")).view(-1)  # flat in (words, per)
    shift = per.bit_length() - 1  # per is 2, 4 or 8
    vals = torch.index_select(now.view(it), 0, lanes, out=out("vals", it)).view(dtype)
    pos = torch.bitwise_right_shift(lanes, shift, out=out("pos"))
    pos = torch.index_select(words, 0, pos, out=out("pos2")).bitwise_left_shift_(shift)
    return pos.bitwise_or_(lanes.bitwise_and_(per - 1)), vals


def _flat_get(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    if t.is_contiguous():
        return t.reshape(-1).index_select(0, pos) if t.dtype != torch.bool else t.reshape(-1)[pos]
    return t[torch.unravel_index(pos, t.shape)] if t.dim() else t.reshape(-1)[pos]


def _flat_put(t: torch.Tensor, pos: torch.Tensor, values: torch.Tensor) -> None:
    """``t``'s elements at row-major ``pos`` = ``values`` (integer views: bits exact)."""
    it = _INT[t.element_size()]
    v = t.view(it)
    vals = values.view(it)
    if v.is_contiguous():
        v.view(-1).scatter_(0, pos, vals)
    else:
        v.index_put_(torch.unravel_index(pos, v.shape), vals)


def _sparse_payload(parts, positions, values, out: torch.Tensor) -> torch.Tensor:
    """One message's sparse payload, written into ``out``: per changed part, block counts
    (int32), low 16 bits of positions (int16), values (their bytes), each at a 16-byte
    aligned offset."""
    at = 0
    for part, pos, vals in zip(parts, positions, values):
        size = sparse_nbytes(part.numel, len(pos), part.wire.itemsize)
        if not size:
            continue
        k, nblocks = len(pos), -(-part.numel // BLOCK)
        c0 = _align(4 * nblocks)
        out[at: at + 4 * nblocks].view(torch.int32).copy_(_block_counts(pos, nblocks))
        out[at + c0: at + c0 + 2 * k].view(torch.int16).copy_(pos)  # int64 to int16 keeps the low 16 bits
        v0 = at + c0 + _align(2 * k)
        out[v0: v0 + k * part.wire.itemsize].copy_(vals.reshape(-1).view(torch.uint8))
        at += size
    return out


def _block_counts(pos: torch.Tensor, nblocks: int) -> torch.Tensor:
    """Changed elements per block of ``BLOCK``: positions come sorted, so a binary search
    per block boundary (a pass over the positions would cost more)."""
    bounds = torch.arange(1, nblocks + 1, device=pos.device) << 16
    ends = torch.searchsorted(pos, bounds)
    return torch.diff(ends, prepend=ends.new_zeros(1))


#: a sample of this many runs of _RUN contiguous elements per part estimates its density
_RUNS, _RUN = 32, 512


@functools.lru_cache(maxsize=256)
def _sample_at(numel: int, device: torch.device) -> torch.Tensor:
    """The sampled elements of a part of ``numel`` (made once per size: a refit samples
    the same parts every call)."""
    starts = torch.arange(_RUNS, device=device) * (numel // _RUNS)
    return (starts[:, None] + torch.arange(_RUN, device=device)).reshape(-1)


def _sampled_density(msg: _Message) -> float:
    """The share of elements changed in evenly spaced runs of each large part (contiguous
    runs: a small part of the memory a strided sample would touch). -1: too small to say."""
    seen, changed = 0, None
    kern = delta_native.kernels() if msg.ref.device.type == "cpu" else None
    for part in msg.parts:
        if part.numel < 4 * _RUNS * _RUN:
            continue
        it = _INT[part.wire.itemsize]
        cur, ref = part.view.reshape(-1), _ref_part(msg, part).reshape(-1)
        if kern is not None and delta_native.appliable(part.view, part.wire):  # one call, no torch ops
            here = kern.sample(cur.data_ptr(), ref.data_ptr(), part.numel, part.wire.itemsize, _RUNS, _RUN)
            changed = here if changed is None else changed + here
            seen += _RUNS * _RUN
            continue
        idx = _sample_at(part.numel, cur.device)
        a = cur.index_select(0, idx) if cur.dtype != torch.bool else cur[idx]
        a = a.to(part.wire).view(it)  # only the sampled elements cast, not the whole part
        b = ref.view(it).index_select(0, idx.to(ref.device)).to(a.device)
        here = (a != b).sum()  # summed on the device: one read of the total below
        changed = here if changed is None else changed + here
        seen += idx.numel()
    return int(changed) / seen if seen else -1.0


def _encode(msg: _Message, key: tuple[int, int] = (0, 0), scratch: _Scratch | None = None,
            dense_above: float | None = None) -> tuple[int, list[int], torch.Tensor]:
    """(encoding, changed count per part, payload) of one message against its reference,
    the reference brought up to date. Sparse only where it is both fewer bytes than the
    message and at most ``dense_above`` of its elements changed (the setting
    ``delta_dense_above``): past that, encoding and scattering the changes cost more time
    than sending every byte."""
    scratch = scratch or _Scratch()
    if dense_above is None:
        dense_above = settings.current().delta_dense_above
    out = _encoded(msg, key, scratch, dense_above)
    numel = sum(p.numel for p in msg.parts)
    scratch.density[key] = 1.0 if out[0] == DENSE else sum(out[1]) / max(1, numel)
    return out


def _encoded(msg: _Message, key: tuple[int, int], scratch: _Scratch,
             dense_above: float) -> tuple[int, list[int], torch.Tensor]:
    # the sample decides only where the last call's diff of this message found it dense
    # or near the line: a diff that passes the line stops there and fills, so a message
    # that stayed sparse saves the sample's reads and (on a GPU) its wait for the count
    last = scratch.density.get(key, 1.0)
    if last > dense_above / 2 and _sampled_density(msg) > dense_above:  # a fill: one copy, cheaper than any diff pass
        return DENSE, [0] * len(msg.parts), _fill(msg)
    currents = _triton_currents(msg)
    if currents is not None:
        return _encode_triton(msg, currents, key, scratch, dense_above)
    kern = delta_native.kernels() if msg.ref.device.type == "cpu" else None
    if kern is not None:
        currents = [_current(part) for part in msg.parts]
        if delta_native.encodable(currents, msg.ref):
            return _encode_native(kern, msg, currents, key, scratch, dense_above)
    positions, values = [], []
    for slot, part in enumerate(msg.parts):
        cur, ref = _current(part), _ref_part(msg, part)
        here = ref if ref.device == cur.device else ref.to(cur.device)  # a host reference
        pos, vals = _diff(cur, here, scratch, slot)
        if here is not ref and len(pos):
            _flat_put(ref, pos.to(ref.device), vals.to(ref.device))
        positions.append(pos)
        values.append(vals)
    changed = sum(len(pos) for pos in positions)
    numel = sum(p.numel for p in msg.parts)
    sparse = sum(sparse_nbytes(p.numel, len(pos), p.wire.itemsize) for p, pos in zip(msg.parts, positions))
    if sparse < msg.nbytes and changed <= dense_above * numel:
        out = scratch.payload(key, sparse, msg.parts[0].view.device)
        return SPARSE, [len(p) for p in positions], _sparse_payload(msg.parts, positions, values, out)
    return DENSE, [0] * len(msg.parts), _fill(msg)


def _encode_native(kern, msg: _Message, currents: list[torch.Tensor], key: tuple[int, int], scratch: _Scratch,
                   dense_above: float) -> tuple[int, list[int], torch.Tensor]:
    """``_encode`` in one native pass per part (``execute.delta_native``): the same
    choice, the same payload bytes."""
    cap = int(dense_above * sum(p.numel for p in msg.parts))
    out = scratch.payload(key, room(msg, dense_above), msg.ref.device)
    got = delta_native.encode_parts(kern, currents, msg.ref, [p.offset for p in msg.parts], out, cap,
                                    delta_native.threads())
    if got is None or got[1] >= msg.nbytes:  # more changed than sparse pays for: dense, as the torch path
        return DENSE, [0] * len(msg.parts), _fill(msg)
    counts, size = got
    return SPARSE, counts, out[:size]


def _triton(device: torch.device) -> bool:
    return settings.current().triton_delta and delta_blocks.available(device.type)


def _triton_currents(msg: _Message) -> list[torch.Tensor] | None:
    """The parts' local views where the Triton diff takes the message: every part
    contiguous on the reference's device, a cast (if any) one the kernel makes."""
    dev = msg.ref.device
    if not _triton(dev):
        return None
    for part in msg.parts:
        v = part.view
        if v.device != dev or not v.is_contiguous() or not delta_blocks.fusable_cast(v.dtype, part.wire):
            return None
    return [part.view for part in msg.parts]


def _encode_triton(msg: _Message, currents: list[torch.Tensor], key: tuple[int, int], scratch: _Scratch,
                   dense_above: float) -> tuple[int, list[int], torch.Tensor]:
    """``_encode`` with the Triton kernels (``kernels.delta_blocks``), once the sample did
    not find the message dense: one pass of the diff over every part, one copy of the
    counts to the host, then the gather of the changed parts into the payload. The same
    choice and payload bytes as the torch ops; where the diff makes the message dense its
    reference already holds the source."""
    dev = msg.ref.device
    kept = scratch.kept(dev)
    numel = sum(p.numel for p in msg.parts)
    cap = int(dense_above * numel)
    diffed = delta_blocks.diff_parts(currents, [_ref_part(msg, p) for p in msg.parts],
                                     [p.wire for p in msg.parts], cap, kept)
    host = diffed.totals.tolist()  # the one copy
    counts = host[len(delta_blocks.CLASSES): len(delta_blocks.CLASSES) + len(msg.parts)]
    sizes = [sparse_nbytes(p.numel, k, p.wire.itemsize) for p, k in zip(msg.parts, counts)]
    if not (sum(sizes) < msg.nbytes and sum(counts) <= cap):
        return DENSE, [0] * len(msg.parts), msg.ref
    out = scratch.payload(key, sum(sizes), dev)
    ats = list(itertools.accumulate(sizes, initial=0))
    delta_blocks.gather(diffed, [(p.numel, p.wire, k, a) for p, k, a in zip(msg.parts, counts, ats)], out, kept)
    return SPARSE, counts, out


def _fill(msg: _Message) -> torch.Tensor:
    """The reference overwritten with the message's current bytes (its dense payload)."""
    for part in msg.parts:
        _ref_part(msg, part).copy_(part.view)
    return msg.ref


# ---------------------------------------------------------------- the receiver's side
def _apply(msg: _Message, counts: list[int], payload: torch.Tensor, scratch: _Scratch | None = None) -> None:
    """Scatter a sparse payload into the message's destination views: one scatter per
    changed part, positions rebuilt in kept buffers."""
    scratch = scratch or _Scratch()
    dev, at = payload.device, 0
    kern = delta_native.kernels() if dev.type == "cpu" else None
    fused = _triton(dev)
    kernel_parts = []  # applied together after the loop: a launch per large part, one per kind of small ones
    for part, k in zip(msg.parts, counts):
        if not k:
            continue
        v = part.view
        if fused and v.device == dev and v.dtype == part.wire and v.is_contiguous():
            kernel_parts.append((at, v, k))
            at += sparse_nbytes(part.numel, k, part.wire.itemsize)
            continue
        if kern is not None and delta_native.appliable(part.view, part.wire):
            delta_native.apply_part(kern, payload, at, part.view, k)
            at += sparse_nbytes(part.numel, k, part.wire.itemsize)
            continue
        nblocks = -(-part.numel // BLOCK)
        c0 = _align(4 * nblocks)
        ends = torch.cumsum(payload[at: at + 4 * nblocks].view(torch.int32), 0)
        idx = torch.arange(k, device=dev, out=scratch.out(("idx",), torch.int64, dev))
        pos = torch.searchsorted(ends, idx, right=True, out=scratch.out(("blocks",), torch.int64, dev))
        low = scratch.out(("low",), torch.int64, dev).resize_(k)
        low.copy_(payload[at + c0: at + c0 + 2 * k].view(torch.int16)).bitwise_and_(0xFFFF)
        pos.bitwise_left_shift_(16).bitwise_or_(low)
        v0 = at + c0 + _align(2 * k)
        vals = payload[v0: v0 + k * part.wire.itemsize].view(part.wire)
        if part.view.dtype != part.wire:  # converted on receipt, as a full refit's unpack does
            vals = vals.to(part.view.dtype)
        _flat_put(part.view, pos, vals)
        at += sparse_nbytes(part.numel, k, part.wire.itemsize)
    if kernel_parts:
        delta_blocks.apply(payload, kernel_parts, scratch.kept(dev))


def _unpack(msg: _Message, payload: torch.Tensor, non_blocking: bool = False,
            skip: frozenset[int] = frozenset()) -> None:
    """A dense payload's parts into their views (but the parts ``skip`` names)."""
    for i, part in enumerate(msg.parts):
        if i in skip:
            continue
        part.view.copy_(payload[part.offset: part.offset + part.nbytes].view(part.wire).view(part.view.shape),
                        non_blocking=non_blocking)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)


# --------------------------------------------------------------------- running
def encode_sends(d: DeltaRounds) -> dict[int, list[tuple[int, list[int], torch.Tensor]]]:
    """Per receiving peer, each message's (encoding, changed counts, payload): diffed
    against its reference where the pair exchanges patches this call (``d.pairs``),
    else dense, the reference filled on the way."""
    rounds = max([len(ms) for ms in d.sends.values()], default=0)
    by_round = [_encode_round(d, m) for m in range(rounds)]
    return {p: [r[p] for r in by_round if p in r] for p in d.sends}


def header_words(encoded: list[tuple[int, list[int], torch.Tensor]]) -> list[int]:
    """One pair's header: per message its encoding, then each part's changed count."""
    return [x for e, ks, _ in encoded for x in (e, *ks)]


def header_numel(msgs: list[_Message]) -> int:
    """Words of the header of a pair exchanging ``msgs``."""
    return sum(1 + len(m.parts) for m in msgs)


def run_delta(d: DeltaRounds, transport: RoundsTransport) -> DeltaStats:
    """One call, collective with the plan's peers: round ``m`` carries message ``m`` of
    every pair and the headers of message ``m + 1`` (the headers of message 0 go in a round
    of their own). A sender encodes message ``m + 2`` while round ``m`` is on the wire;
    a receiver posts round ``m + 1`` (whose sizes round ``m``'s headers gave) before it
    applies message ``m``, so the wire never waits for an apply."""
    rounds = max([len(ms) for ms in (*d.sends.values(), *d.recvs.values())], default=0)
    staged = pinned_pools(d.wire, d.device)
    totals = [0, 0, 0, 0]  # bytes sent, received; sparse and dense messages received
    step = _header_step(transport)
    encoded = _encode_round(d, 0)
    heads, pieces = _header_buffers(d, 0, step)
    _exchange(transport, _headers(d, encoded, step), pieces, totals)
    ahead = _encode_round(d, 1) if rounds > 1 else {}
    plans = _round_plans(d, 0, heads)
    posted = _post(d, transport, 0, encoded, ahead, plans, staged, step, totals) if rounds else None
    for m in range(rounds):
        handle, landing, heads = posted
        # message m + 2 is diffed (or filled) while round m is on the wire: its payload and
        # reference are buffers of their own, and the round's sent buffers are not touched
        later = _encode_round(d, m + 2) if m + 2 < rounds else {}
        if handle is not None:
            transport.finish(handle)
        if m + 1 < rounds:
            following = _round_plans(d, m + 1, heads)
            posted = _post(d, transport, m + 1, ahead, later, following, staged, step, totals)
        _land(d, plans, m, landing, staged, totals)
        if staged and landing:  # the copies out of this round's pinned pool landed before round m + 2 reuses it
            torch.cuda.current_stream(d.device).synchronize()
        encoded, ahead = ahead, later
        plans = following if m + 1 < rounds else {}
    d.last = DeltaStats(*totals)
    return d.last


def _post(d: DeltaRounds, transport: RoundsTransport, m: int, encoded: dict, ahead: dict, plans: dict,
          staged: bool, step: int, totals: list[int]) -> tuple[object, dict, dict[int, torch.Tensor]]:
    """Start round ``m``: message ``m``'s payloads out, the headers of message ``m + 1``
    (``ahead``) with them; message ``m``'s receive buffers and ``m + 1``'s header pieces
    posted. Returns (the transport's handle, what :func:`_land` takes, the headers)."""
    heads, pieces = _header_buffers(d, m + 1, step)
    sends = _send_buffers(d, [(p, piece) for p, enc in sorted(encoded.items()) if enc[2].numel()
                              for piece in _wire_pieces(d.sends[p][m], enc[0], enc[2])], staged)
    sends += _headers(d, ahead, step)
    recvs, landing = _receive_buffers(d, plans, m, staged)
    totals[0] += sum(b.nbytes for _, b in sends)
    totals[1] += sum(b.nbytes for _, b in (*recvs, *pieces))
    handle = transport.start(sends, recvs + pieces) if sends or recvs or pieces else None
    return handle, landing, heads


def _encode_round(d: DeltaRounds, m: int) -> dict[int, tuple[int, list[int], torch.Tensor]]:
    """Message ``m`` to each peer, encoded: sparse or dense where the pair exchanges
    patches, dense (the reference filled on the way) where it does not."""
    send_delta = d.pairs[0]
    above = settings.current().delta_dense_above
    return {p: (_encode(ms[m], (p, m), d.scratch, above) if p in send_delta else
                (DENSE, [0] * len(ms[m].parts), _fill(ms[m])))
            for p, ms in d.sends.items() if m < len(ms)}


def _headers(d: DeltaRounds, encoded: dict, step: int) -> list[tuple[int, torch.Tensor]]:
    """Per patching pair: the message's encoding and each part's changed count, as bytes
    in pieces of at most ``step`` (:func:`_header_step`)."""
    return [(p, piece) for p, (e, ks, _) in sorted(encoded.items()) if p in d.pairs[0]
            for piece in _pieces(_on(torch.tensor([e, *ks], dtype=torch.int32), d.wire).view(torch.uint8), step)]


def _header_buffers(d: DeltaRounds, m: int, step: int) -> tuple[dict[int, torch.Tensor], list]:
    """Message ``m``'s headers from each patching peer: whole, and as the pieces received."""
    whole = {p: torch.empty(4 * (1 + len(ms[m].parts)), dtype=torch.uint8, device=d.wire)
             for p, ms in sorted(d.recvs.items()) if p in d.pairs[1] and m < len(ms)}
    return whole, [(p, piece) for p, h in whole.items() for piece in _pieces(h, step)]


def _header_step(transport: RoundsTransport) -> int:
    """Bytes of a header piece: a transport's messages may be bounded (nvshmem's inbox
    slots hold the largest payload message, which the header of a message of many small
    parts can exceed); both ends cut a header alike, and a round carries every piece."""
    limit = transport.largest_message()
    return 1 << 62 if limit is None else max(4, limit // 4 * 4)


def _pieces(t: torch.Tensor, step: int) -> list[torch.Tensor]:
    return [t[lo: lo + step] for lo in range(0, t.numel(), step)]


def _exchange(transport: RoundsTransport, sends, recvs, totals: list[int]) -> None:
    if sends or recvs:
        transport.finish(transport.start(sends, recvs))
    totals[0] += sum(b.nbytes for _, b in sends)
    totals[1] += sum(b.nbytes for _, b in recvs)


def _round_plans(d: DeltaRounds, m: int, headers: dict[int, torch.Tensor]) -> dict[int, tuple[int, list[int], int]]:
    """Per peer sending message ``m`` here: (encoding, changed counts, payload bytes)."""
    out = {}
    for p, msgs in d.recvs.items():
        if m >= len(msgs):
            continue
        msg = msgs[m]
        if p not in headers:
            out[p] = (DENSE, [], msg.nbytes)
            continue
        flat = headers[p].view(torch.int32).tolist()
        enc, counts = flat[0], flat[1:]
        size = msg.nbytes if enc == DENSE else sum(
            sparse_nbytes(part.numel, k, part.wire.itemsize) for part, k in zip(msg.parts, counts))
        out[p] = (enc, counts, size)
    return out


def _land(d: DeltaRounds, plans: dict, m: int, landing: dict[int, tuple[torch.Tensor, frozenset[int]]],
          staged: bool, totals: list[int]) -> None:
    """Round ``m``'s payloads into their destinations: dense parts copied out of the pool
    (where they did not land in place), sparse payloads applied."""
    for p in sorted(plans):
        enc, counts, size = plans[p]
        msg = d.recvs[p][m]
        if enc == DENSE:
            got, direct = landing.get(p, (None, frozenset()))
            if got is not None:  # else every part landed in its view
                _unpack(msg, got, non_blocking=staged, skip=direct)
            totals[3] += 1
        else:
            if size:  # applied where the views live: the device, or host-staged twins
                _apply(msg, counts, landing[p][0].to(msg.parts[0].view.device, non_blocking=staged), d.scratch)
            totals[2] += 1


#: a dense message's parts of at least this many bytes travel as messages of their own
#: (runs of smaller ones as one), so each lands straight in its destination view
LAND_APART = 1 << 20


def _dense_pieces(msg: _Message) -> list[tuple[int, int, tuple[int, ...]]]:
    """A dense message's byte ranges on the wire, each (start, end, its parts): both ends
    cut alike, from the message alone."""
    out: list[tuple[int, int, tuple[int, ...]]] = []
    run: list[int] = []
    for i, part in enumerate(msg.parts):
        if part.nbytes >= LAND_APART:
            if run:
                out.append(_span(msg, run))
                run = []
            out.append(_span(msg, [i]))
        else:
            run.append(i)
    return out + [_span(msg, run)] if run else out


def _span(msg: _Message, idx: list[int]) -> tuple[int, int, tuple[int, ...]]:
    first, last = msg.parts[idx[0]], msg.parts[idx[-1]]
    return first.offset, last.offset + last.nbytes, tuple(idx)


def _wire_pieces(msg: _Message, enc: int, payload: torch.Tensor) -> list[torch.Tensor]:
    """What a sender puts on the wire for one message: a sparse payload whole, a dense
    one as :func:`_dense_pieces`."""
    if enc != DENSE:
        return [payload]
    return [payload[lo: hi] for lo, hi, _ in _dense_pieces(msg)]


def _in_place(msg: _Message, wire: torch.device) -> torch.Tensor | None:
    """The destination's own bytes where a dense message can land in them directly (one
    contiguous region, no conversion, on the wire's device), as a full refit receives."""
    if len(msg.parts) != 1:
        return None
    return _part_in_place(msg.parts[0], wire)


def _part_in_place(part: _Part, wire: torch.device) -> torch.Tensor | None:
    v = part.view
    if v.dtype != part.wire or v.device != wire or not v.is_contiguous():
        return None
    return v.reshape(-1).view(torch.uint8)


def _send_buffers(d: DeltaRounds, payloads: list[tuple[int, torch.Tensor]],
                  staged: bool) -> list[tuple[int, torch.Tensor]]:
    """Round ``m``'s payloads on the wire's device. Where the wire is the host and the
    payloads are on a GPU (gloo with CUDA tensors), they are copied into pinned host
    memory kept across calls, all on the stream and waited for once: a copy into a fresh
    pageable buffer per message (pages faulted in, the driver's bounce buffer) cost
    several times the wire's own time for dense messages."""
    if not staged:
        return [(p, _on(b, d.wire)) for p, b in payloads]
    far = [b.numel() for _, b in payloads if b.device != d.wire]
    if not far:
        return payloads
    buf = d.scratch.pinned(("send",), sum(_align(n) for n in far))
    out, at = [], 0
    for p, b in payloads:
        if b.device == d.wire:
            out.append((p, b))
            continue
        out.append((p, buf[at: at + b.numel()].copy_(b, non_blocking=True)))
        at += _align(b.numel())
    torch.cuda.current_stream(d.device).synchronize()  # the bytes are in host memory before gloo reads them
    return out


def _receive_buffers(d: DeltaRounds, plans: dict[int, tuple[int, list[int], int]], m: int, staged: bool = False
                     ) -> tuple[list[tuple[int, torch.Tensor]], dict[int, tuple[torch.Tensor | None, frozenset[int]]]]:
    """Round ``m``'s receive buffers, and per peer what :func:`_land` takes (the message's
    bytes in the pool, the parts that landed in place). A dense part lands straight in its
    destination view where it can; the rest go in a pool kept across calls (a fresh
    allocation per call would fault its pages in every time on CPU), one per parity of
    ``m``, since round ``m + 1`` is posted before round ``m`` lands; pinned where
    ``staged`` (the wire is the host, the tensors on a GPU: the copies out of it run on
    the stream)."""
    wanted = []  # (peer, size, pieces: (start, end, its parts, the one part's view bytes where it lands there))
    for p in sorted(plans):
        enc, _, size = plans[p]
        if not size:
            continue
        if enc != DENSE:
            wanted.append((p, size, [(0, size, (), None)]))
            continue
        msg = d.recvs[p][m]
        wanted.append((p, size, [(lo, hi, idx, _part_in_place(msg.parts[idx[0]], d.wire) if len(idx) == 1 else None)
                                 for lo, hi, idx in _dense_pieces(msg)]))
    offsets, at = {}, 0
    for p, size, pieces in wanted:
        if any(here is None for *_, here in pieces):
            offsets[p] = at
            at += _align(size)
    pool = d.pool(m % 2, at, staged) if at else None
    out, landing = [], {}
    for p, size, pieces in wanted:
        got = pool[offsets[p]: offsets[p] + size] if p in offsets else None
        out += [(p, here if here is not None else got[lo: hi]) for lo, hi, _, here in pieces]
        landing[p] = (got, frozenset(idx[0] for _, _, idx, here in pieces if here is not None))
    return out, landing


def run_chained(program, chain: Chain, target: str, group: dist.ProcessGroup, timeout: float | None,
                check: bool) -> tuple[object, DeltaStats]:
    """Run ``program`` (a ``Program`` compiled with ``delta=``) as one call of the version
    chain writing ``target``: check storage first (a recompile forgets what the old
    program's references and targets held), agree with every rank on the pairs that
    exchange patches, run, and record what the references and the target now hold.
    Collective over ``group``. Returns the program's run stats and what went on the wire."""
    if check:
        program.check_storage()
    d: DeltaRounds = program.compiled.delta
    epoch = chain.next()
    shadows = any(q.received for q in program.plan.quantize)
    offers = gather_offers(chain.offer(target, d.token, d.ref_epoch, shadows), group, timeout)
    d.arm(*delta_pairs(offers, program.plan.rank, sorted(d.sends), sorted(d.recvs)))
    d.ref_epoch = UNKNOWN  # until every message went: a failed call leaves them partly updated
    try:
        stats = program.run(False)
    except BaseException:
        chain.failed(target)
        raise
    d.ref_epoch = epoch
    chain.done(target, d.token, epoch)
    return stats, d.last
