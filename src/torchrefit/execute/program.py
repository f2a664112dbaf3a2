"""A rank's plan compiled against its local tensors, replayed on every refit.

``Program`` composes one program per protocol, each compiled into frozen value
types in :meth:`Program._compile`, the one place compiled state is built:

* ``execute.local``: the plan's local copies (runs contiguous on both sides merged
  into one copy by ``execute.runs``, large ones on parallel side-stream branches,
  small ones fused per dtype pair; with ``cuda_graph`` captured once);
* ``execute.rounds``: message rounds through a rounds transport (nccl, gloo, nvshmem);
* ``execute.one_sided_program``: reads or writes of peers' registered memory through a
  one-sided transport (ipc, nixl), with the cross-process ordering;
* ``execute.quantize``: the plan's FP8 quantize steps, before the exchange (from the
  source) and after it (from shadows), on the caller's stream.

Ordering, all through ``streams.SideStreams``: local copies run on side streams
that first wait for the caller's stream and that the caller's stream waits for
before ``run`` returns; the exchange (rounds or one-sided) overlaps them on the
caller's stream. With nothing to exchange and a captured graph, the graph replays
on the caller's stream (ordered by stream order, the fork and join inside).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from .._native.watch import views_check
from .._util.caller_state import outside_inference
from .._util.gc_pause import gc_paused
from ..errors import LayoutError
from ..layout._types import Box
from ..layout.binding import Meta, check_same_meta, meta_of
from ..plan.types import LocalCopy, RankPlan
from ..transport.base import RoundsTransport, Transport
from ..transport.one_sided.protocol import OneSidedTransport
from .delta import DeltaRounds, compile_delta, run_delta
from .delta_one_sided import DeltaOneSided, compile_delta_one_sided, run_delta_one_sided
from .local import LANES, Copy, LocalCopies, compile_copies, differing
from .one_sided_program import OneSidedProgram, compile_one_sided
from .quantize import Quantizes, compile_quantize
from .rounds import MessagePools, Rounds, compile_rounds, run_rounds, unpack_round
from .streams import SideStreams
from .views import Views

__all__ = ["Program", "Compiled", "RunStats"]


@dataclass(frozen=True)
class RunStats:
    rounds: int
    messages_sent: int
    messages_received: int
    pool_bytes: int


@dataclass(frozen=True)
class Compiled:
    """Everything one compile decided: the local copies, the exchange of its protocol
    (None where the plan has no remote transfers), the destination keys that alias
    source storage, and the tensors that are watched: each with an alias taken then
    (same storage, offset, sizes and strides) and its side, key, shape, dtype and device."""

    local: LocalCopies
    rounds: Rounds | None
    one_sided: OneSidedProgram | None
    shared: tuple[str, ...]
    watched: tuple[torch.Tensor, ...]
    pointers: list[int]  # their data pointers as compiled
    refs: tuple[torch.Tensor, ...]  # detached aliases of ``watched`` as compiled
    quantize: Quantizes
    metas: tuple[tuple[str, str, Meta], ...]  # side, key, what the tensor was
    native: object | None = None  # ``_native.watch.views_check`` of watched and refs, where built
    delta: DeltaRounds | None = None  # the exchange as patches (``execute.delta``), in place of rounds
    #: over a one-sided transport, what carries ``delta``'s patches (``execute.delta_one_sided``)
    delta_one_sided: DeltaOneSided | None = None

    @functools.cached_property
    def exchanges(self) -> bool:
        return (bool(self.rounds and self.rounds.rounds) or bool(self.one_sided and not self.one_sided.idle)
                or bool(self.delta and not self.delta.idle))

    @functools.cached_property
    def stats(self) -> RunStats:
        """The same every run: made once (a refit's tail is host time its caller waits for)."""
        if self.rounds is not None:
            r = self.rounds
            return RunStats(len(r.rounds), r.messages_sent, r.messages_received, r.pool_bytes)
        if self.delta is not None:
            d = self.delta
            return RunStats(max(map(len, (*d.sends.values(), *d.recvs.values())), default=0),
                            sum(map(len, d.sends.values())), sum(map(len, d.recvs.values())), 0)
        if self.one_sided is not None:
            c = self.one_sided.compiled
            return RunStats(0, c.messages_sent, c.messages_received, 0)
        return RunStats(0, 0, 0, 0)


def _grad_off() -> bool:
    """Grad mode off, returning the caller's (restore it with ``torch._C._set_grad_enabled``):
    what ``torch.no_grad()`` does for the copies into leaves that require grad, without
    its Python context manager. A refit runs right after its host waited, caches cold,
    where that manager's enter and exit cost 2-3x this."""
    was = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    return was


def run_streams(exchanges: bool, local: bool, graph: bool) -> tuple[str, int | None]:
    """How ``Program.run`` orders a refit, from what it holds: ``("replay", None)``, a
    captured graph of the local copies with nothing to exchange, replayed on the
    caller's stream (a side stream there would only add the fork and join's host work
    to every refit); ``("exchange", None)``, no local copies: the exchange alone on the
    caller's stream; else ``("side", lanes)``: the local copies on side streams
    overlapping the exchange, one side stream for a graph (it forks and joins inside),
    every lane (None) otherwise."""
    if not exchanges and graph:
        return "replay", None
    if not local:
        return "exchange", None
    return "side", 1 if graph else None


class Program:
    """Compiled refit of one rank. Build on every rank; ``run`` is collective over the
    peers in the plan."""

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
        pools: MessagePools | None = None,
        fp8_block: tuple[int, int] = (128, 128),
        device: torch.device | None = None,
        delta: str | None = None,
    ) -> None:
        self.plan = plan
        self.src_tensors = src_tensors
        self.dst_tensors = dst_tensors
        self.transport = transport
        self._one_sided = isinstance(transport, OneSidedTransport)  # may take turns (run)
        self.message_limit = message_limit
        self.compare = compare  # verify mode: receive into the pools and compare, never write
        self.cuda_graph = cuda_graph
        self.share_storage = share_storage and not compare
        self.pools = pools  # message pools shared with programs run one after another, or None
        self.fp8_block = fp8_block
        self.delta = delta  # where the references live ("device" | "host"), or None: full bytes
        # given where destination tensors are staged in host memory: the rank's device
        self.device = device if device is not None else _device_of(plan, src_tensors, dst_tensors)
        self.side = SideStreams(self.device, LANES)
        self.compiled = self._compile()

    # ----------------------------------------------------------------- compiling
    @outside_inference  # what it keeps must stay writable outside inference mode
    @gc_paused
    def _compile(self) -> Compiled:
        views = Views(self.plan, self.src_tensors, self.dst_tensors)
        shared = _alias_whole_tensors(self.plan, views) if self.share_storage else ()
        skip = set(shared)
        planned = [c for c in self.plan.local if c.dst_key not in skip]
        one = self.transport if isinstance(self.transport, OneSidedTransport) else None
        rank = self.plan.rank
        patches = self.delta is not None and not self.compare
        # on a GPU shared with other ranks, another process may copy for this one
        # (transport.delegates): its local copies then go with the exchange; delta
        # refits apply their own patches (execute.delta_one_sided)
        handed = one is not None and one.pull and not patches and one.copier_of(rank, self.compare) != rank
        copies = [] if handed else [
            Copy(views.view("dst", c.dst_key, c.dst_box), views.view("src", c.src_key, c.src_box), c.name)
            for c in planned]
        local = compile_copies(copies, self.side, self.cuda_graph)
        rounds, one_sided, delta, delta_one = None, None, None, None
        remote = bool(self.plan.sends or self.plan.recvs)
        if one is not None and patches:
            delta = compile_delta(views, self.delta, self.device, self.device, self.message_limit)
            delta_one = compile_delta_one_sided(delta, views, one)
        elif one is not None:
            if remote or handed or one.copies_for(rank, self.compare):
                one_sided = OneSidedProgram(
                    compile_one_sided(views, one, planned if handed else (), self.compare), one,
                    self.device, self.cuda_graph)
        elif patches and isinstance(self.transport, RoundsTransport):
            delta = compile_delta(views, self.delta, self.device, self.transport.wire_device(),
                                  self.message_limit)
        elif remote or isinstance(self.transport, RoundsTransport):
            rounds = compile_rounds(views, self.transport, self.message_limit, self.compare, self.device,
                                    self.pools)
        # verify quantizes with the torch reference: a witness independent of the kernel
        quantize = compile_quantize(self.plan.quantize, views, self.fp8_block, kernel=not self.compare)
        used = views.used()  # after aliasing, which moves destination storage
        watched = tuple(t for _, _, t in used)
        metas = tuple((side, key, meta_of(t)) for side, key, t in used)
        refs = tuple(views.base(side, key) for side, key, _ in used)
        return Compiled(local, rounds, one_sided, tuple(shared), watched, [t.data_ptr() for t in watched],
                        refs, quantize, metas, views_check(watched, refs), delta, delta_one)

    # ------------------------------------------------------------ compiled state
    @property
    def local(self) -> LocalCopies:
        return self.compiled.local

    @property
    def shared(self) -> tuple[str, ...]:
        return self.compiled.shared

    @property
    def pools_current(self) -> bool:
        """False when the shared message pools grew after this program took its pools."""
        r = self.compiled.rounds
        return self.pools is None or r is None or r.pools is self.pools.pools or not r.rounds

    # -------------------------------------------------------------------- running
    def storage_moved(self) -> bool:
        """Whether a tensor's storage moved since compiling (``param.data = new``, an
        engine that freed and re-allocated its weights, a storage resized in place and
        back, as FSDP does), or the tensor now views the same storage otherwise
        (``param.data = param.data.t()``: other strides, a narrower shape): the compiled
        views (and a CUDA graph's addresses) still read and write the bytes where and as
        the tensor held them, so a refit through them would be silently wrong."""
        # One C++ call where ``torchrefit native build`` built it (``_native.watch``; any
        # answer but "unchanged" comes here too), else two C-level passes (map), on every
        # refit: the data pointers (a storage resized in place keeps its identity, not its
        # address), then is_set_to against an alias taken when compiling (same storage,
        # offset, sizes and strides; strides and sizes read apart cost more)
        c = self.compiled
        if c.native is not None and c.native.unchanged():  # the same answer in one C++ call
            return False
        return (list(map(torch.Tensor.data_ptr, c.watched)) != c.pointers
                or not all(map(torch.Tensor.is_set_to, c.watched, c.refs)))

    def renew_native(self) -> None:
        """Take the native views check now (a build landed since this program compiled)."""
        c = self.compiled
        if c.native is None:
            self.compiled = replace(c, native=views_check(c.watched, c.refs))

    def check_storage(self) -> None:
        """Recompile where storage moved or was re-viewed; raise :class:`LayoutError`
        (before any byte moves on this rank) where a tensor's shape, dtype or device
        changed with it."""
        if self.storage_moved():
            rank = self.plan.rank
            for (side, key, was), now in zip(self.compiled.metas, self.compiled.watched):
                check_same_meta(side, key, was, now, rank)
            self.compiled = self._compile()

    def run(self, check: bool = True) -> RunStats:
        """Replay the refit. Collective with the plan's peers. ``check=False`` skips
        :meth:`check_storage` (O(tensors) host time): the caller calls it itself when
        storage may have moved (``Refitter(watch="manual")`` and ``Refitter.rebind``)."""
        # Before any copy, never after: a caller may re-use the old storage (an engine
        # that swaps weight buffers), so even one replay into it would corrupt. Nor in
        # stages overlapping the copies (check a part, replay its copies, check the
        # next): a tensor that no longer fits, found in a later stage, would raise after
        # earlier stages wrote, leaving a torn model: a refit is all or nothing.
        if check:
            self.check_storage()
        c = self.compiled
        if self._one_sided and self.transport.turn is not None and c.delta is None:
            return self._run_in_turn(c)
        was = _grad_off()
        try:
            # FP8 from the source first: the side streams and the exchange wait for the
            # caller's stream, so they see the FP8 buffers the sends carry
            c.quantize.before.run()
            how, lanes = run_streams(bool(c.exchanges), bool(c.local), c.local.graph is not None)
            if how == "replay":
                c.local.graph.replay()
            elif how == "exchange":
                self._exchange(c, compare=False)  # on the caller's stream, ordered by stream order
            else:
                with self.side.session(lanes):
                    c.local.run_in_session(self.side)  # on side streams: overlaps the exchange
                    self._exchange(c, compare=False)
            c.quantize.after.run()  # from the shadows, now joined into the caller's stream
        finally:
            torch._C._set_grad_enabled(was)
        return c.stats

    def _run_in_turn(self, c: Compiled) -> RunStats:
        """``run`` on a GPU shared with other ranks that copy (``transport.turns``): the
        ready header first, then this rank's copies once the previous rank's finished,
        its turn word behind them, and only then the wait for its readers' done tokens."""
        one = c.one_sided if c.one_sided is not None and not c.one_sided.idle else None
        was = _grad_off()
        try:
            c.quantize.before.run()
            remote = None
            if one is not None:
                one.announce()
                remote = one.reach()  # headers, tables, pulls compiled: not on the turn's clock
            self.transport.wait_turn()
            if one is None and c.local.graph is not None:
                c.local.graph.replay()
            else:
                with self.side.session(1 if c.local.graph is not None else None):
                    c.local.run_in_session(self.side)
                    if one is not None:
                        one.initiate(remote=remote)
            self.transport.post_turn()  # the caller's stream has joined every copy
            if one is not None:
                one.finish()
            c.quantize.after.run()
        finally:
            torch._C._set_grad_enabled(was)
        return c.stats

    def mismatches(self) -> list[str]:
        """Verify mode: exchange like ``run`` but compare instead of writing; the
        regions (names and peers) whose destination differs from the source."""
        self.check_storage()
        c = self.compiled
        with torch.no_grad():
            c.quantize.stage()
            return (c.local.mismatches("local copy") + self._exchange(c, compare=True)
                    + c.quantize.mismatches())

    def _exchange(self, c: Compiled, compare: bool) -> list[str]:
        if c.one_sided is not None and not c.one_sided.idle:
            return c.one_sided.run(compare)
        if c.delta is not None:
            if c.delta.idle:
                pass
            elif c.delta_one_sided is not None:
                run_delta_one_sided(c.delta_one_sided)
            else:
                run_delta(c.delta, self.transport)
            return []
        bad: list[str] = []
        if c.rounds is not None and c.rounds.rounds:
            unpack = (lambda r: bad.extend(differing(r.unpack_dst, r.unpack_src, r.unpack_names))) \
                if compare else unpack_round
            run_rounds(c.rounds, self.transport, self.device, unpack)
        return bad


def _alias_whole_tensors(plan: RankPlan, views: Views) -> list[str]:
    """Destination tensors made to share source storage (see ``_alias``)."""
    by_dst: dict[str, list[LocalCopy]] = defaultdict(list)
    for c in plan.local:
        by_dst[c.dst_key].append(c)
    return [key for key, copies in by_dst.items() if _alias(key, copies, views)]


def _alias(key: str, copies: list[LocalCopy], views: Views) -> bool:
    """Make destination tensor ``key`` share the source's storage where its local
    copies, together, are one contiguous source region of the same shape, dtype
    and device, with every piece at the same local place on both sides."""
    tensor = views.tensor("dst", key)
    src_keys = {c.src_key for c in copies}
    if len(src_keys) != 1 or any(c.src_box.offset != c.dst_box.offset for c in copies):
        return False
    if sum(c.dst_box.numel for c in copies) != tensor.numel():
        return False
    origin = min(c.src_box.offset for c in copies)
    src = views.view("src", copies[0].src_key, Box(origin, tuple(tensor.shape)))
    if (src.shape != tensor.shape or src.dtype != tensor.dtype or src.device != tensor.device
            or not src.is_contiguous()):
        return False
    with torch.no_grad():
        if isinstance(tensor, torch.nn.Parameter):
            tensor.data = src
        else:
            tensor.set_(src)
    views.forget("dst", key)
    return True


def _device_of(plan: RankPlan, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> torch.device:
    devices = {t.device for t in (*src.values(), *dst.values())}
    if len(devices) > 1:
        raise LayoutError(
            f"rank {plan.rank}: local tensors live on several devices {sorted(map(str, devices))}; "
            "torchrefit expects one device per rank"
        )
    return devices.pop() if devices else torch.device("cpu")
