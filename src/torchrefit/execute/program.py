"""A rank's plan compiled against its local tensors, replayed on every refit.

Compiling (once) turns every region into tensor views, cuts each peer's regions
into messages (``messages.cut_messages``), lays staged messages out in two
staging pools (even and odd rounds) and decides per message whether it can go
zero-copy: a message of one contiguous region, on the wire device and in the
wire dtype, is sent from (or received into) the tensor itself. The hot path
(:meth:`Program.run`) only replays: pack, post, complete, unpack, local copies.

Local copies whose destinations and sources are both back to back (expert tensors
the allocator placed in order on both models) are merged into one copy each while
compiling (``runs.merge_local``); verify still compares tensor by tensor.

Ordering, all through ``streams.SideStreams``: local copies run on side streams
that first wait for the caller's stream and that the caller's stream waits for
before ``run`` returns (large copies on two parallel streams; with ``cuda_graph``
the same fork and join are captured once and replayed); packing and unpacking run
on the caller's stream, which the NCCL process group orders its own stream against.

A peer-mapped transport (CUDA IPC) has no rounds: the receiver copies its regions
out of the senders' mapped tensors on the caller's stream, after the transport made
that stream wait for each sender's interprocess "sources ready" event; the sender's
stream in turn waits for the receivers' "read" events (``transport.ipc``).
"""

from __future__ import annotations

import itertools
import warnings
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..errors import LayoutError, TransportError
from ..layout._types import Box, dtype_from_name
from ..plan.types import RankPlan, Transfer
from ..transport.base import Transport
from ..transport.ipc import Outgoing
from .messages import ALIGN, Message, cut_messages, rows_of
from .runs import merge_local
from .streams import SideStreams, host_wait_current

__all__ = ["Program", "RunStats", "SMALL_COPY_BYTES", "balance_by_bytes"]

#: local copies below this size go through ``torch._foreach_copy_`` (one per dtype pair)
SMALL_COPY_BYTES = 1 << 20
#: large local copies run on this many parallel side streams (graph branches): one
#: copy's tail overlaps another's body (1.007x the flat-copy floor on an H200, against
#: 1.035x on one stream; benchmarks/local_copy_lab.py). Eight, not two: models of many
#: 2-20 MB tensors need more copies in flight (0.5 B dense: 1.17x with 2, 1.03x with 8;
#: the seed's model 0.999x either way; benchmarks/diagnose_moe_copies.py). The small
#: copies get one more stream of their own, so their many short kernels overlap the
#: large copies instead of lengthening a branch (benchmarks/diagnose_megatron_copies.py).
_BRANCHES = 8
_SMALL_LANE = _BRANCHES
_GENERATIONS = itertools.count(1)


@dataclass
class _Round:
    sends: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    recvs: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    pack_dst: list[torch.Tensor] = field(default_factory=list)
    pack_src: list[torch.Tensor] = field(default_factory=list)
    unpack_dst: list[torch.Tensor] = field(default_factory=list)
    unpack_src: list[torch.Tensor] = field(default_factory=list)
    unpack_names: list[str] = field(default_factory=list)


@dataclass
class _CopyGroup:
    """Small local copies one ``torch._foreach_copy_`` moves in one fused kernel: the
    fused path needs one destination dtype, one source dtype and dense pairs of equal
    strides, else it falls back to a kernel per tensor (on an H200 1.4 ms instead of
    0.05 ms for megatron-core's bf16 biases mixed with fp32 layer norms)."""

    dst: list[torch.Tensor] = field(default_factory=list)
    src: list[torch.Tensor] = field(default_factory=list)
    names: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RunStats:
    rounds: int
    messages_sent: int
    messages_received: int
    staging_bytes: int


class Program:
    """Compiled refit of one rank. Build on every rank; ``run`` is collective over the
    peers in the plan (each round pairs with the same round on every peer)."""

    def __init__(
        self,
        plan: RankPlan,
        src_tensors: Mapping[str, torch.Tensor],
        dst_tensors: Mapping[str, torch.Tensor],
        transport: Transport | None,
        message_limit: int,
        *,
        compare: bool = False,
        cuda_graph: bool = False,
        share_storage: bool = False,
    ) -> None:
        self.plan = plan
        self.src_tensors = src_tensors
        self.dst_tensors = dst_tensors
        self.transport = transport
        self.message_limit = message_limit
        self.compare = compare  # verify mode: receive into staging and compare, never write
        self.cuda_graph = cuda_graph
        self.share_storage = share_storage and not compare
        self.shared: list[str] = []  # destination keys that alias source storage
        self.device = _device_of(plan, src_tensors, dst_tensors)
        self.side = SideStreams(self.device, _BRANCHES + 1)
        self._compile()

    # ----------------------------------------------------------------- compiling
    def _compile(self) -> None:
        self._bases: dict[tuple[str, str], torch.Tensor] = {}
        self._graph = None
        # unique per compile of any program in this process: a peer-mapped transport's
        # receivers re-map whenever it changes (a refit and a verify program alternate)
        self._generation = next(_GENERATIONS)
        self._outgoing: dict[int, Outgoing] = {}
        self._incoming: dict[int, tuple[list[torch.Tensor], list[str]]] = {}
        self._compile_local()
        self._branch_of = self._balance_branches()
        if self.transport is not None and self.transport.peer_mapped:
            self._compile_mapped()
        else:
            self._compile_rounds()
        if self.cuda_graph and self.device.type == "cuda" and (self._big or self._small):
            self._graph = self._capture_local()
        # after aliasing, which moves destination storage
        self._watch_tensors = self._watched()
        self._watch_ptrs = [t.data_ptr() for t in self._watch_tensors]

    def _watched(self) -> list[torch.Tensor]:
        used = {("src", c.src_key) for c in self.plan.local} | {("dst", c.dst_key) for c in self.plan.local}
        used |= {("src", t.key) for t in self.plan.sends} | {("dst", t.key) for t in self.plan.recvs}
        return [self._tensor(side, key) for side, key in sorted(used)]

    def _tensor(self, side: str, key: str) -> torch.Tensor:
        table = self.src_tensors if side == "src" else self.dst_tensors
        try:
            return table[key]
        except KeyError:
            raise LayoutError(f"local tensor {key!r} ({side}) is missing from the model") from None

    def _view(self, side: str, key: str, box: Box) -> torch.Tensor:
        base = self._bases.get((side, key))
        if base is None:
            base = self._bases[(side, key)] = self._tensor(side, key).detach()
        return base[box.slices()] if box.ndim else base

    def _compile_local(self) -> None:
        self.shared = self._alias_whole_tensors() if self.share_storage else []
        shared = set(self.shared)
        #: every local copy as planned, for verify (which names the tensor that differs)
        self._local: list[tuple[torch.Tensor, torch.Tensor, str]] = []
        for c in self.plan.local:
            if c.dst_key in shared:
                continue
            dst = self._view("dst", c.dst_key, c.dst_box)
            src = self._view("src", c.src_key, c.src_box)
            if src.dim() != dst.dim():  # one expert of stacked experts: unit dims differ
                src = src.view(dst.shape)
            if dst.data_ptr() == src.data_ptr() and dst.stride() == src.stride() and dst.dtype == src.dtype:
                continue  # the destination is the source itself: nothing to copy
            self._local.append((dst, src, c.name))
        self._big: list[tuple[torch.Tensor, torch.Tensor, str]] = []
        small: dict[tuple, _CopyGroup] = defaultdict(_CopyGroup)
        for dst, src, name in merge_local(self._local):
            if max(dst.nbytes, src.nbytes) >= SMALL_COPY_BYTES:
                self._big.append((dst, src, name))
            else:
                dense = dst.is_contiguous() and src.is_contiguous()
                group = small[(dst.dtype, src.dtype, dense)]
                group.dst.append(dst)
                group.src.append(src)
                group.names.append(name)
        self._small = list(small.values())

    def _alias_whole_tensors(self) -> list[str]:
        """Destination tensors made to share source storage (see ``_alias``)."""
        by_dst: dict[str, list] = defaultdict(list)
        for c in self.plan.local:
            by_dst[c.dst_key].append(c)
        return [key for key, copies in by_dst.items() if self._alias(key, copies)]

    def _alias(self, key: str, copies: list) -> bool:
        """Make destination tensor ``key`` share the source's storage where its local
        copies, together, are one contiguous source region of the same shape, dtype
        and device, with every piece at the same local place on both sides."""
        tensor = self._tensor("dst", key)
        src_keys = {c.src_key for c in copies}
        if len(src_keys) != 1 or any(c.src_box.offset != c.dst_box.offset for c in copies):
            return False
        if sum(c.dst_box.numel for c in copies) != tensor.numel():
            return False
        origin = min(c.src_box.offset for c in copies)
        src = self._view("src", copies[0].src_key, Box(origin, tuple(tensor.shape)))
        if (src.shape != tensor.shape or src.dtype != tensor.dtype or src.device != tensor.device
                or not src.is_contiguous()):
            return False
        with torch.no_grad():
            if isinstance(tensor, torch.nn.Parameter):
                tensor.data = src
            else:
                tensor.set_(src)
        self._bases.pop(("dst", key), None)
        return True

    def _capture_local(self) -> torch.cuda.CUDAGraph | None:
        """Capture the local copies (with their branches) once; each refit replays
        them with one launch. Falls back to eager copies where capture fails."""
        graph = torch.cuda.CUDAGraph()
        # capture_begin/end rather than torch.cuda.graph(): that context also runs
        # gc.collect() and empties the allocator cache, side effects a trainer should
        # not pay for; these copies allocate nothing.
        capture = torch.cuda.Stream(device=self.device)
        capture.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.no_grad(), torch.cuda.stream(capture):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    with self.side.session():  # captured as the graph's fork and join
                        self._copy_local()
                finally:
                    graph.capture_end()
        except RuntimeError as e:
            warnings.warn(f"torchrefit: CUDA graph capture of local copies failed ({e}); "
                          "copying eagerly", stacklevel=3)
            return None
        return graph

    def _balance_branches(self) -> list[int]:
        return balance_by_bytes([dst.nbytes for dst, _, _ in self._big], _BRANCHES)

    def _compile_mapped(self) -> None:
        """Peer-mapped transport (CUDA IPC): what this rank exports to each receiver (its
        source tensors and regions, in plan order) and, per sender, the destination
        views its mapped regions are copied into. No rounds, no staging."""
        index: dict[tuple[int, str], int] = {}  # (peer, source key) -> its place in out.tensors
        for t in self.plan.sends:
            out = self._outgoing.setdefault(t.peer, Outgoing())
            i = index.get((t.peer, t.key))
            if i is None:
                i = index[(t.peer, t.key)] = len(out.tensors)
                out.tensors.append(self._tensor("src", t.key))
            out.regions.append((i, t.local_box))
        for t in self.plan.recvs:
            views, names = self._incoming.setdefault(t.peer, ([], []))
            views.append(self._view("dst", t.key, t.local_box))
            names.append(f"{t.name}{t.region} from rank {t.peer}")
        self._rounds, self._pools, self.staging_bytes = [], [], 0
        self.messages_sent = len(self.plan.sends)
        self.messages_received = len(self.plan.recvs)

    def _run_mapped(self, each) -> None:
        """One handshake per peer pair (see ``transport.ipc``); ``each(dst views, mapped
        source views, names)`` copies or compares on the caller's stream, which the
        transport has made wait for the sender's producer."""
        transport = self.transport
        transport.post(self._outgoing, self._generation, sorted(self._incoming))
        for peer in sorted(self._incoming):
            views, names = self._incoming[peer]
            mapped = transport.incoming(peer)
            if [v.numel() for v in mapped] != [v.numel() for v in views]:
                raise TransportError(f"rank {peer}'s mapped regions do not match what this rank "
                                     f"receives from it (first: {names[0]}); the plans disagree")
            # one expert of stacked experts differs from its source only in unit dims
            mapped = [m if m.shape == v.shape else m.view(v.shape) for m, v in zip(mapped, views)]
            each(views, mapped, names)
            transport.read(peer)
        transport.complete()

    def _compile_rounds(self) -> None:
        limit = self.message_limit
        sends = _by_peer(self.plan.sends)
        recvs = _by_peer(self.plan.recvs)
        send_msgs = {p: cut_messages(p, ts, limit) for p, ts in sends.items()}
        recv_msgs = {p: cut_messages(p, ts, limit) for p, ts in recvs.items()}
        n = max([len(m) for m in (*send_msgs.values(), *recv_msgs.values())], default=0)
        if n and self.transport is None:
            raise AssertionError("a plan with remote transfers needs a transport")
        wire = self.transport.wire_device() if self.transport is not None else self.device
        self._pinned = wire.type == "cpu" and self.device.type == "cuda"
        layout = [self._stage_layout(m, send_msgs, recv_msgs, sends, recvs, wire) for m in range(n)]
        sizes = [max((used for m, (_, used) in enumerate(layout) if m % 2 == p), default=0) for p in (0, 1)]
        self._pools = [torch.empty(s, dtype=torch.uint8, device=wire, pin_memory=self._pinned and s > 0)
                       for s in sizes]
        self.staging_bytes = sum(sizes)
        self._rounds = [self._build_round(m, plan_m) for m, (plan_m, _) in enumerate(layout)]
        self.messages_sent = sum(len(m) for m in send_msgs.values())
        self.messages_received = sum(len(m) for m in recv_msgs.values())

    def _stage_layout(self, m, send_msgs, recv_msgs, sends, recvs, wire):
        """For round m: each message with its transfers and its pool offset (None: zero-copy)."""
        entries, used = [], 0
        for kind, msgs, table in (("send", send_msgs, sends), ("recv", recv_msgs, recvs)):
            for peer in sorted(msgs):
                if m >= len(msgs[peer]):
                    continue
                msg = msgs[peer][m]
                ts = table[peer]
                if self._zero_copy(kind, msg, ts, wire):
                    entries.append((kind, msg, ts, None))
                else:
                    used = -(-used // ALIGN) * ALIGN
                    entries.append((kind, msg, ts, used))
                    used += msg.nbytes
        return entries, used

    def _zero_copy(self, kind: str, msg: Message, ts: list[Transfer], wire: torch.device) -> bool:
        if len(msg.chunks) != 1 or (kind == "recv" and self.compare):
            return False
        ch = msg.chunks[0]
        t = ts[ch.index]
        if t.wire_dtype != t.local_dtype:
            return False
        side = "src" if kind == "send" else "dst"
        view = self._view(side, t.key, rows_of(t.local_box, ch.rows))
        return view.device == wire and view.is_contiguous()

    def _build_round(self, m: int, entries) -> _Round:
        r = _Round()
        pool = self._pools[m % 2]
        for kind, msg, ts, offset in entries:
            side = "src" if kind == "send" else "dst"
            if offset is None:
                ch = msg.chunks[0]
                t = ts[ch.index]
                view = self._view(side, t.key, rows_of(t.local_box, ch.rows))
                wire = view.reshape(-1).view(torch.uint8)
            else:
                wire = pool[offset: offset + msg.nbytes]
                for ch in msg.chunks:
                    t = ts[ch.index]
                    box = rows_of(t.local_box, ch.rows)
                    typed = wire[ch.offset: ch.offset + ch.nbytes].view(dtype_from_name(t.wire_dtype))
                    typed = typed.view(box.size)
                    local = self._view(side, t.key, box)
                    if kind == "send":
                        r.pack_dst.append(typed)
                        r.pack_src.append(local)
                    else:
                        r.unpack_dst.append(local)
                        r.unpack_src.append(typed)
                        r.unpack_names.append(f"{t.name}{rows_of(t.region, ch.rows)} from rank {t.peer}")
            (r.sends if kind == "send" else r.recvs).append((msg.peer, wire))
        return r

    # -------------------------------------------------------------------- running
    def _storage_moved(self) -> bool:
        """Whether a tensor's storage moved since compiling (``param.data = ...``, an
        engine that freed and re-allocated its weights): the compiled views still point
        at the old storage (kept alive by them), so writing through them would be silent."""
        # one C-level pass (map) rather than a Python loop: this runs on every refit and
        # is most of its host time (~500 tensors for the seed's model)
        return list(map(torch.Tensor.data_ptr, self._watch_tensors)) != self._watch_ptrs

    def _check_storage(self) -> None:
        if self._storage_moved():
            self._compile()

    def run(self) -> RunStats:
        """Replay the refit. Collective with the plan's peers."""
        # Before any copy, never after: a caller may re-use the old storage (an engine
        # that swaps weight buffers), so even one replay into it would corrupt.
        self._check_storage()
        with torch.no_grad():
            if not self._rounds and not self._mapped_peers() and self._graph is not None:
                # Nothing to overlap: replay on the caller's stream (ordered after the
                # producer and before the consumer by stream order; the branches inside
                # are the fork and join captured through SideStreams). A side stream
                # here would cost ~0.2 ms of host time per refit on an H200.
                self._graph.replay()
            else:
                with self.side.session(1 if self._graph is not None else None):
                    self._local_copies()  # on side streams: overlaps the exchange below
                    if self._mapped_peers():
                        self._run_mapped(_copy_mapped)
                    else:
                        self._run_rounds(self._unpack)
        return RunStats(len(self._rounds), self.messages_sent, self.messages_received,
                        self.staging_bytes)

    def mismatches(self) -> list[str]:
        """Verify mode: exchange like ``run`` but compare instead of writing; the
        regions (names and peers) whose destination differs from the source."""
        self._check_storage()
        bad: list[str] = []
        with torch.no_grad():
            bad += [f"{name} (local copy)" for dst, src, name in self._local if not _same(dst, src)]
            if self._mapped_peers():
                self._run_mapped(lambda dsts, srcs, names: bad.extend(_differing(dsts, srcs, names)))
            else:
                self._run_rounds(lambda r: bad.extend(_differing(r.unpack_dst, r.unpack_src, r.unpack_names)))
        return bad

    def _mapped_peers(self) -> bool:
        return bool(self._outgoing or self._incoming)

    def _local_copies(self) -> None:
        """Inside ``side.session()``: replay the captured graph on side stream 0, or copy."""
        if self._graph is not None:
            with self.side.placed(0):
                self._graph.replay()
        elif self._big or self._small:
            self._copy_local()

    def _copy_local(self) -> None:
        """Inside a session of all side streams: large copies spread over the branches,
        small ones, one foreach per group, on a stream of their own."""
        for branch, (dst, src, _) in zip(self._branch_of, self._big):
            with self.side.placed(branch):
                dst.copy_(src)
        with self.side.placed(_SMALL_LANE):
            for g in self._small:
                torch._foreach_copy_(g.dst, g.src)

    def _run_rounds(self, unpack) -> None:
        rounds, transport = self._rounds, self.transport
        if not rounds:
            return
        host = transport.host_staged and self.device.type == "cuda"
        events: list[torch.cuda.Event | None] = [None, None]
        handles: list[object] = [None] * len(rounds)
        for m, r in enumerate(rounds):
            if host and events[m % 2] is not None:
                events[m % 2].synchronize()  # pinned pool free: unpack of round m-2 landed
            if r.pack_dst:
                torch._foreach_copy_(r.pack_dst, r.pack_src, non_blocking=True)
            if host:
                host_wait_current(self.device)
            handles[m] = transport.start(r.sends, r.recvs)
            if m:
                events[(m - 1) % 2] = self._complete(rounds[m - 1], handles[m - 1], unpack, host)
        self._complete(rounds[-1], handles[-1], unpack, host)

    def _complete(self, r: _Round, handle, unpack, host: bool):
        self.transport.finish(handle)
        unpack(r)
        if not host:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @staticmethod
    def _unpack(r: _Round) -> None:
        if r.unpack_dst:
            torch._foreach_copy_(r.unpack_dst, r.unpack_src, non_blocking=True)


def _copy_mapped(dsts: list[torch.Tensor], srcs: list[torch.Tensor], names: list[str]) -> None:
    torch._foreach_copy_(dsts, srcs)


def balance_by_bytes(sizes: list[int], lanes: int) -> list[int]:
    """Lane of each copy: largest first onto the least loaded lane, so the lanes carry
    about the same bytes and end together."""
    load = [0] * lanes
    lane = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        b = load.index(min(load))
        lane[i] = b
        load[b] += sizes[i]
    return lane


def _same(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``dst`` holds what a refit would copy from ``src`` (cast and moved as it)."""
    return torch.equal(dst, src.to(device=dst.device, dtype=dst.dtype))


def _differing(dsts: list[torch.Tensor], srcs: list[torch.Tensor], names: list[str]) -> list[str]:
    return [name for dst, src, name in zip(dsts, srcs, names) if not _same(dst, src)]


def _by_peer(transfers) -> dict[int, list[Transfer]]:
    out: dict[int, list[Transfer]] = defaultdict(list)
    for t in transfers:
        out[t.peer].append(t)
    return dict(out)


def _device_of(plan: RankPlan, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> torch.device:
    devices = {t.device for t in (*src.values(), *dst.values())}
    if len(devices) > 1:
        raise LayoutError(
            f"rank {plan.rank}: local tensors live on several devices {sorted(map(str, devices))}; "
            "torchrefit expects one device per rank"
        )
    return devices.pop() if devices else torch.device("cpu")
