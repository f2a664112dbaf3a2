"""Delta refits over a one-sided transport (ipc, nixl): patches as reads or writes of
memory registered once per compile.

A one-sided exchange moves regions both ends registered and sized when compiling; a
patch's size changes every call. So the compile (next to ``execute.delta``'s messages:
the same cut, references and encodings) registers, on the pair's *target* (the sender
for a pull transport, the receiver for a push one), regions as large as anything a call
can move, and each call moves a prefix of them whose length the pair's header says:

* the **header** (per message its encoding and each part's changed count, int32: a fixed
  size), written by the sender every call where the pair exchanges patches;
* per message a **sparse slot** of ``delta.room`` bytes (the most a sparse payload takes
  at ``settings.delta_dense_above``): the sender's encode writes its payload straight
  into it (pull), or the sender writes its payload into the receiver's (push);
* the **dense** bytes: pull, the sender's source regions themselves (a dense message
  is read as a full refit over the same transport reads it, converted by the receiver's
  copy); push, the receiver's destination where the message lands in place (one
  contiguous region of the wire dtype), else its sparse slot, grown to the message's
  bytes and unpacked from after.

A pair the version chain does not arm for patches (``plan.delta_chain``) exchanges no
header: every message is dense.

The order is the one-sided protocol's (``execute.one_sided_program``): the sender
encodes first, then as target (pull) posts its ready token, ordered after the encode,
and the receiver reads the header and payloads only once it holds that token; the
sender's later work (the next encode, which rewrites its slots and references, and the
next optimizer step) waits for the receiver's done token. Push: the receiver's ready
token orders the writes after its own readers of the slots and destination; it reads
the header and applies only after the sender's done token (the writes landed).
Everything runs on the caller's stream; where several ranks share a GPU they neither
take turns nor hand their copies to a delegate (``transport.turns``,
``transport.delegates``): each applies its own patches.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from .. import settings
from ..errors import TransportError
from ..layout._types import Box
from ..transport.one_sided.protocol import OneSidedTransport
from .delta import (
    DENSE,
    SPARSE,
    DeltaRounds,
    DeltaStats,
    _apply,
    _in_place,
    _Message,
    _unpack,
    encode_sends,
    header_numel,
    header_words,
    room,
)
from .delta_wire import sparse_nbytes
from .one_sided_program import new_generation
from .views import Views

__all__ = ["DeltaOneSided", "compile_delta_one_sided", "run_delta_one_sided"]


@dataclass(frozen=True)
class _Pair:
    """What one rank registered for one peer, and how the peer finds it: the regions of
    its table (per the module docstring, in message order) and, on this side, the
    header and per message the sparse slot and (push) where dense bytes land."""

    peer: int
    regions: tuple[tuple[int, Box], ...]
    header: torch.Tensor  # int32
    slots: tuple[torch.Tensor, ...]  # uint8, per message
    dense: tuple[torch.Tensor | None, ...] = ()  # push: the destination bytes where in place


@dataclass
class DeltaOneSided:
    """A program's delta exchange over a one-sided transport: ``rounds`` holds the
    messages, references and the armed pairs (as for message rounds); ``targets``, the
    pairs whose peer reaches this rank's registered memory."""

    rounds: DeltaRounds
    transport: OneSidedTransport
    generation: int
    exposed: object
    targets: dict[int, _Pair]
    headers: dict[int, torch.Tensor]  # push sender: its header per receiver, written to the peer
    checked: set[tuple[int, int]]  # (peer, generation) whose table was checked


def compile_delta_one_sided(d: DeltaRounds, views: Views, transport: OneSidedTransport) -> DeltaOneSided:
    """Register this rank's side of every pair it is the target of (see the module
    docstring). Sparse slots are sized at the current ``delta_dense_above``; a later,
    larger setting sends what no longer fits dense."""
    above = settings.current().delta_dense_above
    tensors: list[torch.Tensor] = []
    index: dict[object, int] = {}

    def at(key: object, tensor: torch.Tensor) -> int:
        if key not in index:
            index[key] = len(tensors)
            tensors.append(tensor)
        return index[key]

    def buffer(key: object, n: int, dtype: torch.dtype = torch.uint8) -> tuple[int, torch.Tensor]:
        t = torch.zeros(max(n, 1), dtype=dtype, device=d.device)
        return at(key, t), t

    targets: dict[int, _Pair] = {}
    sides = d.sends.items() if transport.pull else d.recvs.items()
    for peer, msgs in sorted(sides):
        i, header = buffer(("header", peer), header_numel(msgs), torch.int32)
        regions: list[tuple[int, Box]] = [(i, Box((0,), (header.numel(),)))]
        slots, dense = [], []
        for m, msg in enumerate(msgs):
            here = _in_place(msg, d.device) if not transport.pull else None
            size = room(msg, above) if transport.pull or here is not None else max(room(msg, above), msg.nbytes)
            i, slot = buffer(("slot", peer, m), size)
            slots.append(slot)
            regions.append((i, Box((0,), (slot.numel(),))))
            if transport.pull:  # dense: the sources, read as a full refit reads them
                d.scratch.keep_payload((peer, m), slot)  # the encode writes into the registered slot
                regions += [(at(("src", p.key), views.tensor("src", p.key)), p.box) for p in msg.parts]
            elif here is not None:
                dense.append(here)
                regions.append((at(("dst", peer, m), here), Box((0,), (msg.nbytes,))))
            else:
                dense.append(None)
                regions.append((i, Box((0,), (msg.nbytes,))))
        targets[peer] = _Pair(peer, tuple(regions), header, tuple(slots), tuple(dense))
    exposed = transport.expose(tensors) if tensors else None
    headers = {} if transport.pull else {
        p: torch.zeros(header_numel(ms), dtype=torch.int32, device=d.device) for p, ms in d.sends.items()}
    return DeltaOneSided(d, transport, new_generation(), exposed, targets, headers, set())


@dataclass
class _Tally:
    sent: int = 0
    received: int = 0
    sparse: int = 0
    dense: int = 0


def run_delta_one_sided(x: DeltaOneSided) -> DeltaStats:
    """One call, collective with the plan's peers: encode, then the one-sided protocol
    (targets announce, initiators move, targets wait for them)."""
    d, t = x.rounds, x.transport
    encoded = encode_sends(d)
    tally = _Tally()
    if t.pull:  # the sender is the target: payloads and headers in place before its ready token
        for peer, encs in encoded.items():
            pair = x.targets[peer]
            encs[:] = [_fitted(msg, e, slot.numel()) for msg, e, slot in zip(d.sends[peer], encs, pair.slots)]
            encs[:] = [_into(e, slot) for e, slot in zip(encs, pair.slots)]
            if peer in d.pairs[0]:
                pair.header.copy_(torch.tensor(header_words(encs), dtype=torch.int32))
                tally.sent += pair.header.nbytes
            tally.sent += sum(_moved(e, m) for e, m in zip(encs, d.sends[peer]))
    _announce(x)
    if t.pull:
        _pull(x, tally)
    else:
        _push(x, encoded, tally)
    _finish(x, tally)
    d.last = DeltaStats(tally.sent, tally.received, tally.sparse, tally.dense)
    return d.last


def _fitted(msg: _Message, enc: tuple[int, list[int], torch.Tensor], room_bytes: int
            ) -> tuple[int, list[int], torch.Tensor]:
    """``enc``, or dense where its sparse payload exceeds the slot registered for it
    (``delta_dense_above`` raised since compiling): the diff brought the reference up to
    date, so it holds the message's current bytes."""
    if enc[0] == SPARSE and enc[2].numel() > room_bytes:
        return DENSE, [0] * len(msg.parts), msg.ref
    return enc


def _into(enc: tuple[int, list[int], torch.Tensor], slot: torch.Tensor) -> tuple[int, list[int], torch.Tensor]:
    """A pull sender's sparse payload in its registered slot: the encode writes there
    (``_Scratch.keep_payload``) unless it asked for more room than the slot has."""
    e, counts, payload = enc
    if e == DENSE or not payload.numel() or payload.data_ptr() == slot.data_ptr():
        return enc
    return e, counts, slot[: payload.numel()].copy_(payload)


def _moved(enc: tuple[int, list[int], torch.Tensor], msg: _Message) -> int:
    return msg.nbytes if enc[0] == DENSE else enc[2].numel()


def _announce(x: DeltaOneSided) -> None:
    """Target: this call's ready token to each initiator, ordered after what this rank's
    stream queued before (pull: the encode into the slots; push: its readers of the
    slots and the destination), with the table the first time."""
    if not x.targets:
        return
    t = x.transport
    token = t.ready()
    for peer, pair in x.targets.items():
        t.post_header(peer, x.generation, (x.exposed, pair.regions), token)


def _reach(x: DeltaOneSided, peer: int, msgs: list[_Message]) -> tuple:
    """Initiator: ``peer``'s regions, once its ready token is held; checked against the
    messages once per table (plans that disagree would move wrong bytes)."""
    t = x.transport
    generation, token, remote = t.recv_header(peer)
    if (peer, generation) not in x.checked:
        want = 1 + sum((1 + len(m.parts)) if t.pull else 2 for m in msgs)
        if len(remote) != want:
            raise TransportError(f"{t.name}: rank {peer} registered {len(remote)} delta regions where this "
                                 f"rank exchanges {want} with it; the plans disagree", ranks=(peer,),
                                 rule="out of step")
        x.checked.add((peer, generation))
    t.wait_ready(peer, token)
    return remote


def _pull(x: DeltaOneSided, tally: _Tally) -> None:
    """Pull receiver: per sender, once its ready token is held, its header (where the
    pair exchanges patches), then each message from its slot (sparse: applied straight
    from the sender's memory) or its sources (dense: copied into place); then the done
    tokens, after the reads."""
    d, t = x.rounds, x.transport
    for peer, msgs in sorted(d.recvs.items()):
        remote = _reach(x, peer, msgs)
        armed = peer in d.pairs[1]
        rows = _rows(remote[0], msgs) if armed else [(DENSE, [], m.nbytes) for m in msgs]
        tally.received += remote[0].nbytes if armed else 0
        at = 1
        for msg, (enc, counts, size) in zip(msgs, rows):
            slot, sources = remote[at], remote[at + 1: at + 1 + len(msg.parts)]
            at += 1 + len(msg.parts)
            if enc == DENSE:
                for part, src in zip(msg.parts, sources):
                    part.view.copy_(src.reshape(part.view.shape))
            elif size:
                _apply(msg, counts, _fit(t, peer, slot, size), d.scratch)
            _count(tally, enc, size)
    if d.recvs:
        token = t.done()
        for peer in sorted(d.recvs):
            t.post_done(peer, token)


def _push(x: DeltaOneSided, encoded: dict, tally: _Tally) -> None:
    """Push sender: per receiver, once its ready token is held, the header (where the
    pair exchanges patches) and each payload, into the receiver's slot or (dense) where
    the receiver said dense bytes land; then, once the writes landed, the done tokens."""
    d, t = x.rounds, x.transport
    for peer, msgs in sorted(d.sends.items()):
        remote = _reach(x, peer, msgs)
        encs = [_fitted(msg, e, t.region_bytes(remote[1 + 2 * m])) for m, (msg, e) in enumerate(zip(msgs, encoded[peer]))]
        local, far = [], []
        if peer in d.pairs[0]:
            header = x.headers[peer]
            header.copy_(torch.tensor(header_words(encs), dtype=torch.int32))
            local.append(header)
            far.append(remote[0])
            tally.sent += header.nbytes
        for m, (msg, (enc, _, payload)) in enumerate(zip(msgs, encs)):
            if enc == DENSE:
                local.append(payload)
                far.append(remote[2 + 2 * m])
            elif payload.numel():
                local.append(payload)
                far.append(_fit(t, peer, remote[1 + 2 * m], payload.numel()))
            tally.sent += _moved((enc, _, payload), msg)
        for mine, theirs in _by_memory(local, far):
            t.write(peer, mine, tuple(theirs))
    if d.sends:
        t.finish_writes()
        token = t.done()
        for peer in sorted(d.sends):
            t.post_done(peer, token)


def _finish(x: DeltaOneSided, tally: _Tally) -> None:
    """Target: this rank's later work waits for each initiator's access; a push
    receiver then applies what landed in its slots."""
    d, t = x.rounds, x.transport
    for peer in x.targets:
        t.wait_done(peer, t.recv_done(peer))
    t.settle()
    if t.pull:
        return
    for peer, pair in x.targets.items():
        msgs = d.recvs[peer]
        armed = peer in d.pairs[1]
        rows = _rows(pair.header, msgs) if armed else [(DENSE, [], m.nbytes) for m in msgs]
        tally.received += pair.header.nbytes if armed else 0
        for msg, (enc, counts, size), slot, here in zip(msgs, rows, pair.slots, pair.dense):
            if enc == DENSE and here is None:  # landed in the slot: unpacked as rounds unpack
                _unpack(msg, slot[: msg.nbytes])
            elif enc == SPARSE and size:
                _apply(msg, counts, slot[:size], d.scratch)
            _count(tally, enc, size)


def _count(tally: _Tally, enc: int, size: int) -> None:
    tally.received += size
    if enc == DENSE:
        tally.dense += 1
    else:
        tally.sparse += 1


def _rows(header: torch.Tensor, msgs: list[_Message]) -> list[tuple[int, list[int], int]]:
    """Per message: (encoding, changed counts, payload bytes), from a pair's header."""
    flat, at, out = header.tolist(), 0, []
    for m in msgs:
        enc, counts = flat[at], flat[at + 1: at + 1 + len(m.parts)]
        at += 1 + len(m.parts)
        if enc not in (DENSE, SPARSE):
            raise TransportError(f"a delta header holds encoding {enc}; the ranks disagree on the messages",
                                 rule="out of step")
        size = m.nbytes if enc == DENSE else sum(
            sparse_nbytes(p.numel, k, p.wire.itemsize) for p, k in zip(m.parts, counts))
        out.append((enc, counts, size))
    return out


def _fit(t: OneSidedTransport, peer: int, region, size: int):
    """The first ``size`` bytes of a registered slot; a header asking for more than the
    slot holds means the ranks disagree."""
    if size > t.region_bytes(region):
        raise TransportError(f"{t.name}: a {size}-byte delta payload exceeds the {t.region_bytes(region)}-byte "
                             f"slot rank {peer} registered; the ranks disagree", ranks=(peer,), rule="out of step")
    return t.narrow(region, size)


def _by_memory(local: list[torch.Tensor], far: list) -> list[tuple[list[torch.Tensor], list]]:
    """The writes grouped by the local tensors' device (one transfer request reads one
    kind of memory: a host reference's dense payloads apart from device slots)."""
    groups: dict[torch.device, tuple[list, list]] = defaultdict(lambda: ([], []))
    for a, b in zip(local, far):
        groups[a.device][0].append(a)
        groups[a.device][1].append(b)
    return [g for g in groups.values() if g[0]]

