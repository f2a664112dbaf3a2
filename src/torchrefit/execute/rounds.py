"""The message-rounds program: rounds through a ``RoundsTransport`` (nccl, gloo, nvshmem).

Compiling cuts each peer's regions into messages (``plan.messages.cut_messages``; both
ends cut the same ordered transfers, so message m of a pair goes in round m),
lays staged messages out in two message pools (even and odd rounds, so round m+1
packs while round m is in flight) and sends a message zero-copy where it is one
contiguous region on the wire device in the wire dtype. Running replays: pack,
start, finish, unpack, on the caller's stream, which the NCCL process group
orders its own stream against; for a host-staged transport (gloo fed from GPU)
the host waits for the packed bytes and for a pool's unpack before reusing it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..layout._types import dtype_from_name
from ..plan.messages import ALIGN, Message, cut_messages, rows_of
from ..plan.types import Transfer
from ..transport.base import RoundsTransport, host_wait_current
from .views import Views

__all__ = ["Round", "Rounds", "MessagePools", "compile_rounds", "run_rounds"]


@dataclass(frozen=True)
class Round:
    """One round: the buffers exchanged with each peer and the device copies that pack
    sends into the pools before and unpack receives after."""

    sends: tuple[tuple[int, torch.Tensor], ...]
    recvs: tuple[tuple[int, torch.Tensor], ...]
    pack_dst: tuple[torch.Tensor, ...]
    pack_src: tuple[torch.Tensor, ...]
    unpack_dst: tuple[torch.Tensor, ...]
    unpack_src: tuple[torch.Tensor, ...]
    unpack_names: tuple[str, ...]


@dataclass(frozen=True)
class Rounds:
    rounds: tuple[Round, ...]
    pools: tuple[torch.Tensor, ...]
    pool_bytes: int
    messages_sent: int
    messages_received: int


class MessagePools:
    """The two message pools (even and odd rounds), shared by programs that run one
    after another: a refit into a ``load_weights`` sink runs one program per bucket,
    and each having its own pools would multiply the pools' memory by the number
    of buckets. Sharing is safe because a program's rounds finish (host-staged: the
    host waits for the stream before the next message goes) before the next starts.

    A request larger than the pools grows them; programs compiled before keep the
    old, smaller pools (correct, but memory no longer shared) until recompiled."""

    def __init__(self) -> None:
        self.pools: tuple[torch.Tensor, ...] = ()

    def take(self, sizes: list[int], wire: torch.device, pinned: bool) -> tuple[torch.Tensor, ...]:
        have = [p.numel() for p in self.pools] or [0, 0]
        if not self.pools or any(s > h for s, h in zip(sizes, have)) or self.pools[0].device != wire:
            self.pools = _pools([max(s, h) for s, h in zip(sizes, have)], wire, pinned)
        return self.pools



def _pools(sizes: list[int], wire: torch.device, pinned: bool) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty(s, dtype=torch.uint8, device=wire, pin_memory=pinned and s > 0) for s in sizes)


@dataclass(frozen=True)
class _Placed:
    """A message of round m, its transfers and where its bytes live: ``staged`` at
    ``offset`` in the round's pool, or zero-copy in the tensor itself."""

    kind: str  # "send" | "recv"
    message: Message
    transfers: tuple[Transfer, ...]
    staged: bool
    offset: int = 0


def pinned_pools(wire: torch.device, device: torch.device) -> bool:
    """Whether the round pools are pinned host memory: the messages travel from the host
    (gloo's wire) while the tensors live on a GPU, whose copies into and out of pinned
    pools run asynchronously on the caller's stream."""
    return wire.type == "cpu" and device.type == "cuda"


def host_synchronized(host_staged: bool, device: torch.device) -> bool:
    """Whether rounds order the host against the GPU: a transport that reads and writes
    message bytes from the host (gloo) must wait for the packs queued on the stream
    before sending, and for the unpacks of round m-2 before reusing its pool."""
    return host_staged and device.type == "cuda"


def compile_rounds(views: Views, transport: RoundsTransport | None, limit: int, compare: bool,
                   device: torch.device, shared: MessagePools | None = None) -> Rounds:
    """Cut, place and lay out the plan's messages; pools from ``shared`` when given
    (shared with other programs), else this program's own."""
    plan = views.plan
    sends, recvs = _by_peer(plan.sends), _by_peer(plan.recvs)
    msgs = {"send": {p: cut_messages(p, ts, limit) for p, ts in sends.items()},
            "recv": {p: cut_messages(p, ts, limit) for p, ts in recvs.items()}}
    n = max([len(m) for table in msgs.values() for m in table.values()], default=0)
    if n and transport is None:
        raise AssertionError("a plan with remote transfers needs a transport")
    wire = transport.wire_device() if transport is not None else device
    pinned = pinned_pools(wire, device)
    transfers = {"send": sends, "recv": recvs}
    placed = [_place(m, msgs, transfers, views, wire, compare) for m in range(n)]
    sizes = [max((_used(p) for m, p in enumerate(placed) if m % 2 == parity), default=0) for parity in (0, 1)]
    pools = shared.take(sizes, wire, pinned) if shared is not None else _pools(sizes, wire, pinned)
    rounds = tuple(_build_round(p, pools[m % 2], views) for m, p in enumerate(placed))
    return Rounds(rounds, pools, sum(p.numel() for p in pools),
                  sum(len(m) for m in msgs["send"].values()), sum(len(m) for m in msgs["recv"].values()))


def _place(m: int, msgs, transfers, views: Views, wire: torch.device, compare: bool) -> list[_Placed]:
    """Round m's messages, sends then receives, peers ascending, staged ones packed at
    aligned offsets of one pool."""
    out, used = [], 0
    for kind in ("send", "recv"):
        for peer in sorted(msgs[kind]):
            if m >= len(msgs[kind][peer]):
                continue
            msg, ts = msgs[kind][peer][m], tuple(transfers[kind][peer])
            if _zero_copy(kind, msg, ts, views, wire, compare):
                out.append(_Placed(kind, msg, ts, staged=False))
            else:
                used = -(-used // ALIGN) * ALIGN
                out.append(_Placed(kind, msg, ts, staged=True, offset=used))
                used += msg.nbytes
    return out


def _used(placed: list[_Placed]) -> int:
    return max((p.offset + p.message.nbytes for p in placed if p.staged), default=0)


def _zero_copy(kind: str, msg: Message, ts: tuple[Transfer, ...], views: Views, wire: torch.device,
               compare: bool) -> bool:
    if len(msg.chunks) != 1 or (kind == "recv" and compare):  # verify never writes the destination
        return False
    ch = msg.chunks[0]
    t = ts[ch.index]
    if t.wire_dtype != t.local_dtype:
        return False
    view = views.view(_side(kind), t.key, rows_of(t.local_box, ch.rows))
    return view.device == wire and view.is_contiguous()


def _side(kind: str) -> str:
    return "src" if kind == "send" else "dst"


def _build_round(placed: list[_Placed], pool: torch.Tensor, views: Views) -> Round:
    sends, recvs, pack, unpack = [], [], [], []
    for p in placed:
        side = _side(p.kind)
        if not p.staged:
            ch = p.message.chunks[0]
            t = p.transfers[ch.index]
            wire = views.view(side, t.key, rows_of(t.local_box, ch.rows)).reshape(-1).view(torch.uint8)
        else:
            wire = pool[p.offset: p.offset + p.message.nbytes]
            for ch in p.message.chunks:
                t = p.transfers[ch.index]
                box = rows_of(t.local_box, ch.rows)
                typed = wire[ch.offset: ch.offset + ch.nbytes].view(dtype_from_name(t.wire_dtype)).view(box.size)
                local = views.view(side, t.key, box)
                if p.kind == "send":
                    pack.append((typed, local))
                else:
                    unpack.append((local, typed, f"{t.name}{rows_of(t.region, ch.rows)} from rank {t.peer}"))
        (sends if p.kind == "send" else recvs).append((p.message.peer, wire))
    return Round(tuple(sends), tuple(recvs), tuple(d for d, _ in pack), tuple(s for _, s in pack),
                 tuple(d for d, _, _ in unpack), tuple(s for _, s, _ in unpack), tuple(n for _, _, n in unpack))


def run_rounds(compiled: Rounds, transport: RoundsTransport, device: torch.device,
               unpack: Callable[[Round], None]) -> None:
    """Replay every round on the caller's stream; ``unpack(round)`` after each lands.
    Collective with the plan's peers (round m pairs with round m on every peer)."""
    rounds = compiled.rounds
    if not rounds:
        return
    host = host_synchronized(transport.host_staged, device)
    events: list[torch.cuda.Event | None] = [None, None]
    handles: list[object] = [None] * len(rounds)
    for m, r in enumerate(rounds):
        if host and events[m % 2] is not None:
            events[m % 2].synchronize()  # pinned pool free: unpack of round m-2 landed
        if r.pack_dst:
            torch._foreach_copy_(r.pack_dst, r.pack_src, non_blocking=True)
        if host:
            host_wait_current(device)
        handles[m] = transport.start(list(r.sends), list(r.recvs))
        if m:
            events[(m - 1) % 2] = _complete(transport, rounds[m - 1], handles[m - 1], unpack, host, device)
    _complete(transport, rounds[-1], handles[-1], unpack, host, device)


def _complete(transport: RoundsTransport, r: Round, handle, unpack, host: bool, device: torch.device):
    transport.finish(handle)
    unpack(r)
    if not host:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def unpack_round(r: Round) -> None:
    if r.unpack_dst:
        torch._foreach_copy_(r.unpack_dst, r.unpack_src, non_blocking=True)


def _by_peer(transfers) -> dict[int, list[Transfer]]:
    out: dict[int, list[Transfer]] = defaultdict(list)
    for t in transfers:
        out[t.peer].append(t)
    return dict(out)
