"""``Refitter``: the public entry point (``swap`` wraps it in Megatron's drop-in).

Construction is collective over ``group``: every rank describes what it holds,
the rosters are gathered deduplicated (a digest per rank, then each distinct roster
once: bytes that grow with the distinct layouts, not the world), every rank validates the
whole refit and plans its own part, and one more small gather makes sure all
ranks agree before any byte moves (a rank that failed makes every rank raise).
``refit()`` is collective too: the first call compiles the plan against the
local tensors, later calls only replay it. ``stage()`` (collective) and ``commit()``
(local) split a refit so that an engine stalls only for a local copy (``stage_commit``,
docs/staging.md).
"""

from __future__ import annotations

import logging
import numbers
import socket
import traceback
import warnings
from dataclasses import astuple, dataclass, replace
from time import perf_counter

import torch
import torch.distributed as dist

from . import settings
from ._native.build import BUILD_MIN_TENSORS, BackgroundBuild, start_background_build
from ._util.caller_state import caller_state, outside_inference, set_aside
from ._util.gc_pause import gc_paused
from ._util.weak_models import weak
from .connect import Connection
from .errors import LayoutError, PlanError, RefitError, TransportError, VerificationError
from .execute.delta import DeltaStats, run_chained
from .execute.program import Program, RunStats
from .execute.quantize import fp8_buffers
from .execute.rounds import MessagePools
from .execute.staged import STAGING, Commit, compile_commit, make_twins, written_boxes
from .layout import NAMED_LAYOUTS, Described, LayoutArg, describe, layout_kind
from .layout.binding import Binding
from .layout.sink import SinkDescribed
from .layout.walk import shared_walks
from .maps import Identity, NameMap
from .plan.buckets import plan_buckets, split_plan
from .plan.cache import PlanCache, plan_key
from .plan.delta_chain import Chain
from .plan.planner import CastPolicy, Planner
from .plan.roster import encode_roster
from .plan.types import RankPlan
from .stage_commit import CommitReport, StageHandle, Stager, StageReport
from .transport.base import DEFAULT_TIMEOUT, Transport, get_transport, registered, transport_class
from .transport.collectives import (
    all_gather_pickled,
    all_gather_rosters,
    collective,
    collective_device,
)
from .transport.gloo import GlooTransport
from .transport.one_sided.protocol import OneSidedTransport
from .verify import Witness, check
from .versions import stamp_version

__all__ = ["Refitter", "RefitReport", "DEFAULT_POOL_BYTES",
           "VERIFY_MODES", "WATCH_MODES", "DELTA_MODES"]

#: ``Refitter(verify=...)``: never check automatically, after the first refit, after every one
VERIFY_MODES = ("never", "first", "every")
#: ``Refitter(watch=...)``: look for replaced or moved tensors before every refit, or only
#: when the caller says so (``rebind()``)
WATCH_MODES = ("every", "manual")
#: ``Refitter(delta=...)``: where a sender keeps the reference of what it last sent
DELTA_MODES = (None, "device", "host")

_log = logging.getLogger(__name__)

#: memory a rank may use for its message pools (packed messages (both pools, sends and receives)
DEFAULT_POOL_BYTES = 1 << 30
_MIN_MESSAGE = 4096
# After a stage lost a peer, each live rank waits for the others to say they are alive (a
# dead rank never says so): two refit timeouts from the first rank's word, at most
# _NAMING_WINDOW. A live rank blocked on the dead one gives up within one timeout, but a
# live rank blocked on a live one that stopped for the failure (a second-hand wait) gives
# up up to one timeout after that: with one timeout it was named dead. A live rank still
# blocked past the window is named with the dead ones.
_NAMING_WINDOW = 30.0


@dataclass(frozen=True)
class RefitReport:
    """What one ``refit()`` did on this rank.

    ``seconds`` is host time inside ``refit()``; on GPUs the copies may still be in
    flight when it returns, but the caller's stream is ordered after them.
    """

    version: int
    seconds: float
    bytes_local: int
    bytes_sent: int
    bytes_received: int
    transport: str
    rounds: int
    messages_sent: int
    messages_received: int
    pool_bytes: int
    compiled: bool  # this call compiled the plan (the first refit)
    shared_tensors: int = 0  # destination tensors aliasing source storage (share_storage)
    # FP8 value bytes of this rank's destination quantized on the sender (from a local
    # source, or received as FP8 and scales) and on this rank after receiving them in
    # the source's dtype; RankPlan.explain() says which per tensor and region
    fp8_on_receiver: int = 0
    fp8_on_sender: int = 0
    # memory FP8 holds on this rank besides pool_bytes, allocated once: the sender's
    # FP8 values and float32 scales that sends carry, and the receiver's shadows (the
    # source's dtype) that the exchange fills before the quantize step
    fp8_buffer_bytes: int = 0
    fp8_shadow_bytes: int = 0
    # delta refits (docs/delta.md): the memory this rank's references of what it last sent
    # take, and the bytes that crossed the wire (payloads and headers) where bytes_sent and
    # bytes_received count what a full refit moves
    delta_reference_bytes: int = 0
    wire_bytes_sent: int = 0
    wire_bytes_received: int = 0

    @property
    def bytes_remote(self) -> int:
        return self.bytes_sent + self.bytes_received

    @property
    def staging_bytes(self) -> int:
        """Deprecated: :attr:`pool_bytes` (the message pools' bytes)."""
        warnings.warn("RefitReport.staging_bytes is deprecated: use pool_bytes", DeprecationWarning,
                      stacklevel=2)
        return self.pool_bytes


@dataclass(frozen=True)
class _RankInfo:
    """What each rank contributes to the metadata gather (its rosters travel deduplicated)."""

    error: tuple[str, str] | None  # (error class, message): see _failure
    src: bytes | None
    dst: bytes | None
    pool_bytes: int
    device: str  # "cuda", "cpu", or "" where the rank holds no model
    unavailable: dict[str, str]  # transport name -> why it cannot run on this rank
    host: str  # the machine, for transports that only work within one (ipc)
    kinds: tuple[str, str] = ("", "")  # how the source and destination layouts were found
    bucket_bytes: int | None = None  # a load_weights sink's budget (layout.sink)
    auto: str = ""  # what "auto" means on this rank: settings.transport, or "" (the preferred)


class Refitter:
    """Moves weights from ``src_model`` into ``dst_model`` on every ``refit()``.

    Args:
        src_model / dst_model: this rank's model (or list of virtual-pipeline
            chunks), or None where the rank holds no such model.
        transport: ``"auto"`` (the most preferred registered transport that fits every
            rank: ``ipc``, ``nccl``, ``nvshmem``, ``nixl``, then ``gloo``; for CPU
            tensors ``gloo``; ``report.transport`` says which), a registered name
            (``"nccl"``, ``"gloo"``, ``"ipc"``, ``"nvshmem"``, ``"nixl"``), or a
            :class:`Transport`. Where ``settings.transport`` (environment:
            ``TORCHREFIT_TRANSPORT``) names one (alike on every rank: else every rank
            raises ``TransportError``), ``"auto"`` means that one, checked like a name.
            ``"ipc"`` and ``"nixl"`` are one-sided (receivers read, or senders write,
            the peer's registered memory: GPU memory, or for ``"nixl"`` CPU memory too)
            and exchange small control messages over the group's Gloo backend (e.g. ``"cpu:gloo,cuda:nccl"``).
        group: the process group spanning every participating rank (default: world),
            or the :class:`~torchrefit.connect.Connection` ``tr.connect`` returned (its
            joint group; its rank offsets replace ``src/dst_rank_offset`` left at 0).
        src_layout / dst_layout: None to detect, or a layout (see ``torchrefit.layout``).
        name_map: how destination names map to source names (default: identity,
            with tied-embedding aliases).
        src_rank_offset / dst_rank_offset: the first group rank of each model's ranks,
            as in Megatron's ``swap_model_weights``; checked, not needed for routing,
            since every rank describes what it holds itself.
        cast: ``"buffers"`` (default) converts persistent buffers whose dtype differs,
            ``True`` converts any tensor, ``False`` none.
        skip: glob patterns of destination tensors that may have no source.
        pool_bytes: bound on this rank's message pools (the packed messages of
            two-sided transports). ``staging_bytes=``: its old name, deprecated.
        cuda_graph: on CUDA (the default), capture the local copies in a CUDA graph
            once and replay it on every refit: one launch, less host time, two
            parallel branches for large copies; re-captured if a tensor's storage
            moves. False copies eagerly (same streams, more host time).
        share_storage: collocated only. Where a whole destination tensor is exactly a
            contiguous source region of the same dtype on the same device, make the
            destination alias the source's storage instead of copying; ``refit()`` then
            only orders streams for it. The caller must not write into such
            destination tensors (that writes the trainer's weights), must not train
            while the engine reads them (the engine would see weights change mid
            rollout), and must not free or offload either side separately. An engine
            whose forward replays CUDA graphs captured before the first refit (vLLM,
            SGLang) keeps reading its old storage: it would run on stale weights.
            ``refit()`` reports them in ``shared_tensors``.
        timeout: seconds a refit, ``verify()`` or this constructor waits for a peer
            (default 300) before raising :class:`TransportError` naming it (a peer that
            died or stopped); None leaves it to the process group's own timeout. With a
            ``tr.connect`` Connection, at most the connection's ``timeout`` (None: that
            one). After such an error the group is unusable: every later ``refit()``
            raises too.
        verify: ``"never"`` (default), ``"first"`` or ``"every"``: run :meth:`verify`
            after the first refit or after every refit (it reads both models once).
        staging: where :meth:`stage` puts the next version until :meth:`commit`:
            ``"device"`` (default: twins of the destination tensors the plan writes, on
            their device; the commit is a device-memory copy) or ``"host"`` (pinned host
            memory: no extra device memory, the commit crosses PCIe). Allocated by the
            first stage, once; unused by :meth:`refit`.
        delta: None (default): every refit sends every byte. ``"device"`` or ``"host"``:
            each sending rank keeps a reference of exactly the bytes it last sent (on its
            device, or in pinned host memory), and each refit or stage sends, per message,
            only the elements whose bits changed (or the whole message where that is fewer
            bytes); receivers patch in place (a stage: its twins). A patch is sent only where
            every rank agrees the receiver holds the reference's bytes, else full bytes.
            Every transport (message rounds, and one-sided reads or writes of slots
            registered once: ipc, nixl); ``report.delta_reference_bytes`` and
            ``wire_bytes_*`` say what it costs and saves. See docs/delta.md.
        plan_cache: a :class:`PlanCache` to take this rank's plan from, where it holds one
            made from the same gathered rosters, rank, local names, name map, cast, skip,
            FP8 block and transport class, and to keep the plan in otherwise: Refitters
            between layouts seen before (many engines of one layout, a restarted one) skip
            planning. Ranks need not agree on it: planning is local to each rank (the
            gathers before and after it run either way). None: plan every time.
        watch: ``"every"`` (default): before every refit, this rank checks that each
            described tensor is still the one its module (or mapping) holds and that each
            compiled tensor still views the storage it did (same storage, offset, sizes and
            strides), and follows a replaced, moved or re-viewed tensor (see :meth:`rebind`);
            both checks are one C++ call each where the native checks are built for this
            environment (``torchrefit native build``; a rank watching
            ``_native.build.BUILD_MIN_TENSORS`` tensors or more starts that build in
            the background by itself, once per machine and environment, and switches to
            it at the first refit after it landed), else two C-level passes each
            (a 2-core CPU: ~65 ns per tensor for the first check, ~280 ns for the second).
            ``"manual"``: ``refit()`` checks neither; the caller calls :meth:`rebind` on a
            rank after anything there that may replace or re-allocate a described tensor of
            either side (an engine's sleep / wake, re-wrapping modules, ``param.data =
            ...``, ``module.weight = Parameter(...)``), before the next refit (the first
            one included). What "manual" gives up: a tensor replaced or moved without a
            ``rebind()`` after it is written (destination) or read (source) at its old
            storage, which the model no longer uses, and nothing says so. ``verify()``
            still checks (it reads what the model holds now).

    After construction, ``plan`` is this rank's :class:`RankPlan` and ``metadata`` the
    bytes this rank received gathering the others' metadata (:class:`Gathered`:
    records of every rank, then each distinct roster once).
    """

    @set_aside
    @outside_inference
    @gc_paused
    def __init__(
        self,
        src_model,
        dst_model,
        transport: str | Transport = "auto",
        group: dist.ProcessGroup | Connection | None = None,
        src_layout: LayoutArg = None,
        dst_layout: LayoutArg = None,
        name_map: NameMap | None = None,
        src_rank_offset: int = 0,
        dst_rank_offset: int = 0,
        *,
        cast: CastPolicy = "buffers",
        fp8_block: tuple[int, int] = (128, 128),
        skip: tuple[str, ...] | list[str] = (),
        pool_bytes: int = DEFAULT_POOL_BYTES,
        cuda_graph: bool = True,
        share_storage: bool = False,
        verify: str = "never",
        watch: str = "every",
        timeout: float | None = DEFAULT_TIMEOUT,
        staging: str = "device",
        staging_bytes: int | None = None,
        delta: str | None = None,
        plan_cache: PlanCache | None = None,
    ) -> None:
        t0 = perf_counter()
        self._plan_cache = plan_cache
        pool_bytes = _pool_bytes(pool_bytes, staging_bytes)
        if staging not in STAGING:  # every rank has the same arguments: all raise, none hangs
            raise ValueError(f"staging must be one of {STAGING}, not {staging!r}")
        if delta not in DELTA_MODES:
            raise ValueError(f"delta must be one of {DELTA_MODES}, not {delta!r}")
        self.delta = delta
        self._chain = Chain()
        self.staging = staging
        self.cuda_graph = cuda_graph
        self.share_storage = share_storage
        src_rank_offset, dst_rank_offset = self._join(group, src_rank_offset, dst_rank_offset)
        self.timeout = _timeout(timeout, group)
        self._start_state(dst_model, verify, watch)
        infos = self._describe_and_gather(src_model, dst_model, src_layout, dst_layout, pool_bytes)
        _check_offsets(infos, src_rank_offset, dst_rank_offset)
        self.transport_name = _choose_transport(transport, infos, str(dist.get_backend(self.group)))
        self._transport_cls = type(transport) if isinstance(transport, Transport) else transport_class(
            self.transport_name)
        self.plan = self._plan(infos, name_map or Identity(), cast, skip, fp8_block)
        self._phases = self._bucket(infos)
        self._check_delta()
        self._prepare_transport(transport, infos, max_peers=self._agree())
        self.plan_seconds = perf_counter() - t0
        _log.debug("rank %d: planned in %.3f s (transport %s)\n%s", self.rank, self.plan_seconds,
                   self.transport_name, self.plan)

    # ---------------------------------------------------------------- construction
    def _join(self, group, src_rank_offset: int, dst_rank_offset: int) -> tuple[int, int]:
        """Step 1: this rank's place in the refit group; returns the rank offsets (a
        :class:`Connection`'s where the caller left them at 0)."""
        self._conn = group if isinstance(group, Connection) else None
        if isinstance(group, Connection):
            self.group, self.rank, self.world = group.group, group.joint_rank, group.joint_world
            src_rank_offset = src_rank_offset or group.src_rank_offset
            dst_rank_offset = dst_rank_offset or group.dst_rank_offset
        else:
            if not dist.is_initialized():
                raise RefitError("torch.distributed is not initialized; call init_process_group first")
            self.group = group if group is not None else dist.group.WORLD
            self.rank = dist.get_rank(self.group)
            self.world = dist.get_world_size(self.group)
        if self.rank < 0:
            raise RefitError(f"global rank {dist.get_rank()} is not a member of the refit group; "
                             "only the group's ranks construct a Refitter")
        return src_rank_offset, dst_rank_offset

    def _start_state(self, dst_model, verify: str, watch: str) -> None:
        """Step 2: the state later refits fill in, and the checked modes (every rank has
        the same arguments: all raise, none hangs)."""
        self.version = 0
        self._failed: RefitError | None = None  # a refit that failed leaves the group unusable
        # stamped with each refit's version; held weakly, so that swap_model_weights'
        # cache (which holds this Refitter) drops its entry when the engine goes
        self._dst_chunks = weak(dst_model, None)
        self._program: Program | None = None
        self._phase_programs: list[Program] | None = None  # with a load_weights sink
        self._verifier: Program | None = None  # FP8 destinations: compared through the plan
        self._fp8_buffers: tuple[dict, dict] | None = None  # FP8 shadows and send buffers
        self._fp8_held_bytes = (0, 0)  # their bytes (send buffers, shadows), summed when they are made
        self._witness: Witness | None = None
        self._gloo: Transport | None = None  # the FP8 verify's transport where the refit's cannot compare
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, not {verify!r}")
        self.verify_mode = verify
        if watch not in WATCH_MODES:
            raise ValueError(f"watch must be one of {WATCH_MODES}, not {watch!r}")
        self.watch = watch
        self._unbound: LayoutError | None = None  # what the last rebind() raised, if it did
        self._held_device: torch.device | None = None  # where this rank's described tensors live
        self._pools = MessagePools()  # message pools of the refit's and the stage's programs
        self._stager: Stager | None = None  # stage() and commit(): made by the first stage
        self._stage_program: Program | None = None  # the plan compiled into the twins
        self._twins: dict[str, torch.Tensor] | None = None  # allocated once, kept across rebinds
        self._commit: Commit | None = None
        self._stage_boxes: dict = {}  # per destination key the plan writes, its boxes
        self._staged_version = 0  # the newest version a stage() was asked for

    def _describe_and_gather(self, src_model, dst_model, src_layout: LayoutArg, dst_layout: LayoutArg,
                             pool_bytes: int) -> list[_RankInfo]:
        """Step 3 (collective): describe and bind this rank's models, gather every rank's
        rosters and facts, and raise every rank's layout errors on every rank."""
        with shared_walks():  # describing and binding each model walk its modules once
            self._kinds = (layout_kind(src_model, src_layout), layout_kind(dst_model, dst_layout))
            # the detected kind, not None: a detection reads every tensor of the model
            # (a qwen3-shaped megatron-core model, 8 layers, has ~4200 of them)
            src, dst, error = self._describe(src_model, dst_model, _resolved(src_layout, self._kinds[0]),
                                             _resolved(dst_layout, self._kinds[1]))
            self._src, self._dst = src, dst
            self._bindings = _bindings(src_model, src, dst_model, dst)
        self._native_build = _native_build(self.watch, self._bindings)
        infos = self._gather_infos(src, dst, error, pool_bytes)
        _raise_layout_errors(infos)
        return infos

    def _prepare_transport(self, transport: str | Transport, infos: list[_RankInfo], max_peers: int) -> None:
        """Last step (collective): build the transport, size messages to the smallest
        message-pool budget, and let the transport prepare for the plan."""
        self._transport = self._make_transport(transport)
        if self._phases is not None and isinstance(self._transport, OneSidedTransport):
            self._transport.keep_tables(len(self._phases) + 2)  # each bucket's, a verify's, a spare
        budget = min(i.pool_bytes for i in infos)
        self.message_limit = max(_MIN_MESSAGE, budget // (2 * max(1, max_peers)))
        self._transport.prepare(self.plan, self.message_limit)  # collective

    def _describe(self, src_model, dst_model, src_layout, dst_layout):
        try:
            src, dst = describe(src_model, src_layout), describe(dst_model, dst_layout)
            self._held_device = _held_device(src, dst, self.rank)
            return src, dst, None
        except Exception as e:  # any failure must reach every rank, not hang them
            return None, None, _failure(e)

    def _gather_infos(self, src: Described | None, dst: Described | None, error: tuple[str, str] | None,
                      pool_bytes: int) -> list[_RankInfo]:
        held = self._held_device
        device = "" if held is None else ("cuda" if held.type == "cuda" else "cpu")
        try:
            enc_src = encode_roster(src.layout) if src is not None else None
            enc_dst = encode_roster(dst.layout) if dst is not None else None
        except Exception as e:
            enc_src = enc_dst = None
            error = error or _failure(e)
        unavailable = {cls.name: ok.reason for cls in registered() if not (ok := cls.available())}
        info = _RankInfo(error, None, None, int(pool_bytes), device, unavailable,
                         socket.gethostname(), self._kinds,
                         dst.bucket_bytes if isinstance(dst, SinkDescribed) else None,
                         _auto_setting())
        # The rosters travel deduplicated (each distinct one once); the rest as a plain tuple.
        extras, (srcs, dsts), self.metadata = all_gather_rosters(
            astuple(info), (enc_src, enc_dst), self.group, self.timeout)
        return [replace(_RankInfo(*e), src=s, dst=d) for e, s, d in zip(extras, srcs, dsts)]

    def _plan(self, infos, name_map: NameMap, cast, skip, fp8_block) -> RankPlan:
        """This rank's plan: from ``plan_cache`` where it holds one made from the same
        rosters and arguments, else made now (and kept there)."""
        key = None
        if self._plan_cache is not None:
            key = plan_key(tuple((i.src, i.dst) for i in infos), tuple(i.kinds for i in infos),
                           self.rank, self.world,
                           tuple(k for k, _ in self._src.layout) if self._src else None,
                           tuple(k for k, _ in self._dst.layout) if self._dst else None,
                           name_map, cast, skip, fp8_block, self._transport_cls)
            got = self._plan_cache.get(key)
            if got is not None:
                self._planner, plan = got
                self._plan_error = None
                return plan
        plan = self._make_plan(infos, name_map, cast, skip, fp8_block)
        if key is not None and self._plan_error is None:  # an error is raised on every rank: nothing to keep
            self._plan_cache.put(key, (self._planner, plan))
        return plan

    def _make_plan(self, infos, name_map: NameMap, cast, skip, fp8_block) -> RankPlan:
        planner = Planner.from_rosters([i.src for i in infos], [i.dst for i in infos], name_map,
                                       cast=cast, skip=tuple(skip), sides=_sides(infos),
                                       fp8_block=fp8_block,
                                       sender_transforms=self._transport_cls.protocol != "one_sided")
        planner.validate()  # the same rosters on every rank: the same error everywhere
        self._planner = planner  # bucketed (load_weights sink) refits ask it per bucket
        self._plan_error: tuple[str, str] | None = None
        try:
            plan = planner.plan_rank(
                self.rank, self.world,
                self._src.layout if self._src else None, self._dst.layout if self._dst else None,
            )
        except Exception as e:  # reported to every rank by _agree()
            self._plan_error = _failure(e)
            return RankPlan(self.rank, self.world, (), (), ())
        problem = self._transport_cls.plan_problem(plan)  # also reported by _agree()
        self._plan_error = ("PlanError", problem) if problem else None
        return plan

    def _bucket(self, infos: list[_RankInfo]) -> list[tuple[tuple[str, ...], RankPlan]] | None:
        """Where any rank is a ``load_weights`` sink: the bucket sequence (pure, the same
        on every rank, so errors are too) and this rank's plan cut into one phase per
        bucket; the sink lays its buffer out to match. None: one phase, no sink."""
        sinks = {r: (i.dst, i.bucket_bytes) for r, i in enumerate(infos) if i.bucket_bytes}
        if not sinks:
            return None
        scales = {name: t.scale for name, t in self._planner.fp8.items()}
        buckets = plan_buckets(sinks, sorted(self._planner.dst.tensors), scales)
        if isinstance(self._dst, SinkDescribed):
            self._dst.place(buckets)
        return list(zip(buckets, split_plan(self.plan, buckets)))

    def _check_delta(self) -> None:
        """``delta=`` patches live or staged tensors over any transport (message rounds,
        or one-sided reads and writes: ``execute.delta_one_sided``), not a load_weights
        sink (the same arguments and gathered facts on every rank: all raise or none)."""
        if self.delta is not None and self._phases is not None:
            raise RefitError(f"delta={self.delta!r}: a load_weights sink keeps no tensors to patch "
                             "(docs/delta.md)", rule="delta")

    def _run(self, program: Program, check: bool, target: str) -> tuple[RunStats, DeltaStats | None]:
        """``program.run``, or with ``delta=`` one call of the version chain into ``target``."""
        if self.delta is None:
            return program.run(check), None
        return run_chained(program, self._chain, target, self.group, self.timeout, check)

    def _agree(self) -> int:
        """Second gather: every rank learns whether any rank failed to plan, and the
        largest number of peers any rank talks to (which sizes messages)."""
        peers = len(self.plan.send_peers) + len(self.plan.recv_peers)
        out = all_gather_pickled((self._plan_error, peers), self.group, self.timeout)
        _raise_agreed([err for err, _ in out], PlanError, "planning failed", "planning")
        return max(p for _, p in out)

    def _make_transport(self, transport: str | Transport) -> Transport:
        if not isinstance(transport, Transport):
            transport = get_transport(self.transport_name)(self.group, self._device())
        transport.timeout = self.timeout
        return transport

    def _device(self) -> torch.device:
        if self._held_device is not None:
            return self._held_device
        if self._transport_cls.needs_cuda:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ----------------------------------------------------------------- refitting
    @set_aside
    def refit(self, version: int | None = None) -> RefitReport:
        """Move the source's current weights into the destination. Collective over the group.

        On GPUs the work is ordered after everything already queued on the caller's
        current stream (the optimizer step) and before anything queued after it.
        ``version`` (default: the previous one plus 1, starting at 1; else an int >= 0,
        0 included, stamped as given) is stamped on this rank's destination model once
        the refit succeeded (``tr.weight_version(model)``) and returned in the report;
        pass the same value on every rank. A bool, a non-int or a negative version
        raises ``TypeError`` or ``ValueError`` before any byte moves (every rank, given
        the same arguments, raises alike, and the Refitter stays usable).

        A refit that raises leaves ``self.version`` and ``tr.weight_version(model)`` at
        the previous version on every rank. What it leaves in the destination's weights
        depends on where it failed:

        * ``VerificationError`` (``verify="every"``, or ``"first"`` on the first refit):
          every byte of the refit was written; the destination holds this refit's
          result, which differs from the source somewhere (the error names where). The
          Refitter stays usable: a later refit may be tried.
        * ``TransportError`` (a peer gone or timed out) during the transfer: destination
          tensors may be partly written (some regions new, others old). The Refitter is
          unusable: every later refit or verify raises ``TransportError``.
        * ``LayoutError`` (a described tensor replaced by one that no longer fits): this
          rank writes nothing; its peers raise ``TransportError`` at their timeout. The
          Refitter is unusable, as after a ``TransportError``.
        """
        t0 = perf_counter()
        if self._stager is not None:  # stages are collective too: one thing at a time
            self._stager.settle()
            self._stager.drop()  # a staged older version must never be committed over this one
        self._raise_if_failed()
        version = self._next_version(version)
        try:
            check = self.watch == "every"
            if check:
                if self._native_build is not None and self._native_build.ready():
                    self._use_native()
                self._rebind()
            elif self._unbound is not None:  # the model no longer fits: never write the old storage
                raise self._unbound
            compiled = self._program is None
            if compiled:
                self._program = self._compile(compare=False)
            # a program compiled just now took its tensors as they are: nothing to check yet
            stats, wire = ((self._run(self._program, check and not compiled, "live")) if self._phases is None
                           else (self._run_phases(check), None))
        except (TransportError, LayoutError) as e:  # a peer gone, or a tensor that no longer fits
            self._failed = e
            raise
        self._transport.watch()  # NCCL: abort and raise next time if this refit never completes
        if self._dst is not None and self._dst.after_refit is not None:
            with caller_state():
                self._dst.after_refit()  # e.g. FSDP2 drops unsharded copies of the old weights
        if self.verify_mode == "every" or (self.verify_mode == "first" and compiled):
            self.verify()  # raises on every rank alike, before any rank stamps the version
        self.version = version
        stamp_version([c for ref in self._dst_chunks if (c := ref()) is not None], version)
        report = RefitReport(
            version, perf_counter() - t0, self.plan.bytes_local, self.plan.bytes_sent,
            self.plan.bytes_received, self.transport_name, stats.rounds, stats.messages_sent,
            stats.messages_received, stats.pool_bytes, compiled,
            sum(len(p.shared) for p in self._phase_programs or [self._program]),
            *reversed(self.plan.fp8_bytes), *self._fp8_held_bytes,
            *self._wire(wire),
        )
        _log.debug("rank %d: refit %d in %.3f s: %d B local, %d B sent, %d B received",
                   self.rank, report.version, report.seconds, report.bytes_local,
                   report.bytes_sent, report.bytes_received)
        return report

    def _wire(self, wire: DeltaStats | None, program: Program | None = None) -> tuple[int, int, int]:
        """(reference bytes, wire bytes sent, received) for a report."""
        if wire is None:
            return 0, self.plan.bytes_sent, self.plan.bytes_received
        program = program or self._program
        delta = program.compiled.delta if program is not None else None
        return (delta.reference_bytes if delta is not None else 0), wire.wire_bytes_sent, wire.wire_bytes_received

    # ------------------------------------------------------------ stage and commit
    @set_aside
    def stage(self, version: int | None = None, *, wait: bool = True) -> StageHandle:
        """Move the source's current weights into this rank's staging, leaving the live
        destination weights (and their version) untouched. Collective over the group, like
        :meth:`refit`: every rank calls ``stage`` the same number of times, in the same order.

        ``version`` (default: one more than the newest refitted, committed or staged one) is what
        :meth:`commit` will stamp. With ``wait=False`` the stage runs on this Refitter's
        worker thread and ``stage`` returns at once; the returned handle's ``wait()`` gives
        the :class:`StageReport` or raises the stage's error. With ``wait=True`` (default)
        ``stage`` returns once the stage finished (and raises its error).

        The source is read as the caller's stream leaves it at this call, and must not be
        written before the handle is waited (``wait()`` orders the caller's stream after the
        stage's reads). A stage requested before the previous one was committed supersedes
        it (the commit installs the newest complete stage); a stage that fails leaves the
        live weights and version as they were and nothing to commit. Not with
        ``share_storage`` or a ``load_weights`` sink (both write the destination directly).
        See docs/staging.md.
        """
        self._raise_if_failed()
        if self._phases is not None:
            raise RefitError("stage(): a load_weights sink hands each bucket to the engine as it "
                             "arrives; there are no live tensors to stage for (use refit())")
        if self.share_storage:
            raise RefitError("stage(): share_storage=True makes destination tensors alias the "
                             "source; there is nothing to stage (use refit())")
        if self._stager is None:
            self._stager = Stager(self.staging, self._device())
        stager = self._stager
        version = self._staged_version = self._next_version(version)
        handle = stager.submit(version, lambda: self._stage_now(version))
        if wait:
            handle.wait()
        return handle

    def _stage_now(self, version: int) -> StageReport:
        """On the stage worker, staging marked as written: run the plan into the twins, then
        agree with every rank that each staged all its bytes (one small all-reduce, off the
        engine's path): a stage completes on every rank or on none, so engine ranks never
        commit different versions. A failed stage leaves the group unusable, as a failed
        refit does (messages of its unfinished rounds may still be in flight)."""
        t0 = perf_counter()
        error, failure, compiled, stats, wire = None, None, False, None, None
        try:
            check = self.watch == "every"
            if check:
                self._rebind()
            elif self._unbound is not None:
                raise self._unbound
            compiled = self._stage_program is None
            if compiled:
                self._stage_program = self._compile_stage()
            stats, wire = self._run(self._stage_program, check and not compiled, "twins")
        except TransportError as e:  # a peer gone: no agreement to reach
            raise self._stage_lost(version, e) from e
        except Exception as e:  # told to every rank below
            error, failure = e, _failure(e)  # its traceback, while it is being handled
        try:
            _agree_stage(failure, self.group, self.timeout)
        except TransportError as e:
            if failure is None:  # every byte here, but a peer gone
                raise self._stage_lost(version, e) from e
            # a peer still waits for this rank's unfinished rounds
            self._failed = TransportError(
                f"stage failed on rank {self.rank} ({failure[1].splitlines()[0]}), then agreeing on "
                f"it with the other ranks failed: {e}", ranks=(self.rank,), rule="stage")
            raise self._failed from error
        except RefitError as e:
            self._failed = e
            raise e from error
        self._transport.watch()
        twins = sum(t.nbytes for t in (self._twins or {}).values())
        return StageReport(version, perf_counter() - t0, self.plan.bytes_local, self.plan.bytes_sent,
                           self.plan.bytes_received, self.transport_name, stats.rounds,
                           stats.messages_sent, stats.messages_received, self.staging, twins,
                           stats.pool_bytes, compiled, *self._wire(wire, self._stage_program))

    def _stage_lost(self, version: int, cause: TransportError) -> TransportError:
        """A stage cut short by a peer that died, stopped or left it (``cause``, on this
        rank): the error every live rank raises, naming the ranks that are gone (through
        a ``tr.connect`` link's store, every live rank marking itself; with a plain group,
        the peer this rank's transport saw fail, if any). Marks the group unusable."""
        me = f"rank {self.rank}"
        ranks: tuple[int, ...] = cause.ranks if cause.rule == "timeout" else ()
        who = (f"rank(s) {list(ranks)} died, stopped or left the stage" if ranks else
               "a rank died, stopped or left the stage")
        if self._conn is not None:
            me = str(self._conn)
            window = min(2 * (self.timeout or self._conn.timeout), _NAMING_WINDOW)
            gone = self._conn.absent(f"stage {version}", window)
            if gone is None:
                gone = [("trainer", 0)]  # it hosts the link's store
            if gone:
                who = (f"{', '.join(f'{role} rank {r}' for role, r in gone)} died or stopped "
                       f"(not heard from within {window:.3g} s of the failure)")
                ranks = tuple(r if role == "trainer" else self._conn.trainers + r for role, r in gone)
        e = TransportError(
            f"stage of version {version} failed on {me}: {who}. Nothing live was written: the "
            "live weights and their version are unchanged, and nothing is staged to commit. The "
            f"group is unusable: connect again and build a new Refitter (seen here as: "
            f"{str(cause).split(' (', 1)[0]})", ranks=ranks, rule="stage lost", detail=f"{cause}")
        self._failed = e
        return e

    @gc_paused
    def _compile_stage(self) -> Program:
        """The whole plan with every destination tensor it writes replaced by its twin
        (made once: a recompile after a rebind keeps the staged bytes)."""
        dst = self._dst.tensors if self._dst else {}
        shadows, _ = self._fp8(self._src.tensors if self._src else {}, dst)
        self._stage_boxes = written_boxes(self.plan, frozenset(shadows))
        if self._twins is None:
            self._twins = make_twins(self._stage_boxes, dst, self.staging)
        return self._compile_plan(self.plan, False, self._pools, twins=self._twins)

    @set_aside
    def commit(self) -> CommitReport:
        """Install the staged version: copy staging into the live destination tensors, in
        place, on the caller's current stream, and stamp its version. Local to this rank (no
        collective); an engine calls it at the point it chooses, e.g. between two forward
        passes. Waits for the newest requested stage to finish first (on CUDA the copies
        are also ordered after the stage's completion on the caller's stream). Raises
        :class:`RefitError`, with the live weights and version unchanged, where that stage
        failed or nothing is staged. A source-only rank has nothing to commit (it returns
        a report of zero bytes)."""
        t0 = perf_counter()
        stager = self._stager
        if stager is None:
            raise RefitError("commit() before any stage(): nothing staged to commit")
        staged = stager.wait_staged()  # rule 1: every byte of the newest stage arrived
        waited = perf_counter() - t0
        done = None
        try:  # no stage writes staging until the copies are queued (committed() below)
            if self.watch == "every":
                self._rebind()  # a live tensor replaced since: write the model's own
            elif self._unbound is not None:
                raise self._unbound
            commit = self._commit_copies()
            commit.run()
            self._chain.committed()
            done = staged.version
        finally:
            stager.committed(done)
        self.version = staged.version
        stamp_version([c for ref in self._dst_chunks if (c := ref()) is not None], staged.version)
        if self._dst is not None and self._dst.after_refit is not None:
            with caller_state():
                self._dst.after_refit()
        return CommitReport(staged.version, perf_counter() - t0, waited, commit.nbytes, self.staging,
                            sum(t.nbytes for t in (self._twins or {}).values()))

    def _commit_copies(self) -> Commit:
        live = self._dst.tensors if self._dst else {}
        if self._commit is None or not self._commit.current(live):
            # the refit's own local copies, captured in a CUDA graph where the twins are on
            # the device (the side streams are kept across recompiles)
            side = self._commit.side if self._commit is not None else None
            self._commit = compile_commit(self._stage_boxes, live, self._twins or {}, side,
                                          self.cuda_graph and self.staging == "device")
        return self._commit

    @set_aside
    def rebind(self) -> None:
        """Follow tensors replaced or re-allocated since the last refit, now. This rank
        only (no collective); call it between refits, on each rank where the models
        changed, with ``watch="manual"`` after anything that may replace or re-allocate a
        described tensor of either side (sleep / wake, re-wrapping,
        ``param.data = ...``, ``module.weight = Parameter(...)``) and before the next
        refit. With ``watch="every"`` it is harmless: every refit does the same.

        Takes each tensor the model now holds in place of a described one (same shape,
        dtype and device; the compiled programs are then dropped, compiled again by the
        next refit) and recompiles every compiled program (the refit's, each bucket's,
        the FP8 verify's) whose tensors' storage moved or is viewed another way
        (``param.data = param.data.t()``). Raises :class:`LayoutError`
        naming a tensor that no longer fits (another shape, dtype or device, or removed)
        and writes nothing; a later ``refit()`` on this rank raises it again (before any
        byte moves here; its peers raise :class:`TransportError` at their timeout)
        unless a ``rebind()`` after the model was put right succeeded.

        With ``watch="manual"``, a tensor replaced or moved without a ``rebind()`` after
        it is silently written (destination) or read (source) at its old storage.
        """
        try:
            self._rebind()
            for program in self._programs():
                program.check_storage()
        except LayoutError as e:
            self._unbound = e
            raise
        self._unbound = None

    def _programs(self) -> list[Program]:
        """Every compiled program held, each once (the first bucket's is ``_program`` too)."""
        held = [self._program, *(self._phase_programs or ()), self._verifier, self._stage_program]
        return list({id(p): p for p in held if p is not None}.values())

    def _use_native(self) -> None:
        """The background build landed: every check from now on is one C++ call."""
        self._native_build = None
        for binding in self._bindings.values():
            binding.renew_native()
        for program in self._programs():
            program.renew_native()
        _log.info("rank %d: the native watch checks are built: refits use them from now on", self.rank)

    def _rebind(self) -> None:
        """This rank, before each refit or in ``rebind()`` (no collective): where the
        model now holds another tensor than it was described with (a replaced Parameter,
        buffer or mapping entry), take the model's (same shape, dtype and device, else
        LayoutError naming it) and drop the compiled programs, so that no byte goes to or
        comes from storage the model no longer uses. The plan is unchanged: nothing to
        agree on. (Moved storage of the same tensor objects, FP8 targets and scales
        included, is the program's own check: ``Program.check_storage``.)"""
        stale = False
        try:
            for side, binding in self._bindings.items():
                changed = binding.changed()
                if changed:
                    old = self._src if side == "src" else self._dst
                    new = replace(old, tensors=binding.adopt(old.tensors, changed, self.rank))
                    self._src, self._dst = (new, self._dst) if side == "src" else (self._src, new)
                    stale = True
                    _log.debug("rank %d: %d %s tensor(s) replaced in the model, e.g. %s: recompiling",
                               self.rank, len(changed), side, next(iter(changed)))
        finally:  # one side adopted, the other raised: no program may keep the first's old tensors
            if stale:
                self._program = self._phase_programs = self._verifier = self._stage_program = None
                self._commit = None
                self._fp8_buffers, self._fp8_held_bytes = None, (0, 0)

    def _run_phases(self, check: bool = True) -> RunStats:
        """One phase per bucket, in the agreed order; a sink rank hands each bucket to
        ``load_weights`` before the next phase overwrites its buffer. ``check``: each
        phase's storage check (``Program.run``)."""
        rounds = sent = received = pools = 0
        scales = {t.scale for t in self._planner.fp8.values()}
        for (names, _), program in zip(self._phases, self._phase_programs):
            stats = program.run(check)
            if isinstance(self._dst, SinkDescribed):
                # with their sources' tensors, FP8 scales (they have none: the quantize
                # step of their weight, in this phase, wrote them)
                self._dst.deliver([n for n in names if self._planner.segments(n) is not None
                                   or n in scales])
            rounds, sent, received = (rounds + stats.rounds, sent + stats.messages_sent,
                                      received + stats.messages_received)
            pools = max(pools, stats.pool_bytes)  # the buckets share one pair of pools
        return RunStats(rounds, sent, received, pools)

    def _next_version(self, version: int | None) -> int:
        """``version``, or one more than the newest refitted, committed or staged (the same
        on every rank: each makes the same calls, and a commit installs a staged version).
        Raises on a bad one before any byte moves."""
        if version is None:
            return max(self.version, self._staged_version) + 1
        if isinstance(version, bool) or not isinstance(version, numbers.Integral):
            raise TypeError(f"version=... takes an int >= 0 or None, not "
                            f"{type(version).__name__} {version!r} (rank {self.rank})")
        if version < 0:
            raise ValueError(f"version=... takes an int >= 0 or None, not {version} "
                             f"(rank {self.rank})")
        return int(version)

    @gc_paused
    def _compile(self, compare: bool) -> Program:
        if self._phases is not None:  # one program per bucket; the whole plan's stays unused
            # one pair of message pools for all buckets (they run one after another);
            # a bucket that grew the pools leaves earlier ones holding smaller pools:
            # compile those again so that only the shared pair stays alive
            shared = MessagePools()
            programs = [self._compile_plan(plan, compare, shared) for _, plan in self._phases]
            self._phase_programs = [p if p.pools_current else self._compile_plan(plan, compare, shared)
                                    for p, (_, plan) in zip(programs, self._phases)]
            return self._phase_programs[0]
        return self._compile_plan(self.plan, compare, None if compare else self._pools)

    def _compile_plan(self, plan: RankPlan, compare: bool, pools: MessagePools | None = None,
                      twins: dict[str, torch.Tensor] | None = None) -> Program:
        src = self._src.tensors if self._src else {}
        dst = self._dst.tensors if self._dst else {}
        shadows, fp8_sent = self._fp8(src, dst)
        return Program(
            plan,
            {**src, **fp8_sent},
            {**dst, **shadows, **(twins or {})},
            self._verify_transport() if compare else self._transport, self.message_limit, compare=compare,
            # graphs of copies into pinned host twins are not captured
            cuda_graph=self.cuda_graph and not compare and (twins is None or self.staging == "device"),
            # a sink's tensors are views of one reused buffer: they must not alias sources
            share_storage=self.share_storage and self._phases is None and twins is None,
            pools=pools,
            fp8_block=self._planner.fp8_block,
            device=self._device() if twins is not None else None,
            delta=None if compare else self.delta,
        )

    def _fp8(self, src, dst) -> tuple[dict, dict]:
        """The FP8 shadows and the sender's FP8 buffers, made once: verify compares against the
        shadows the last refit filled."""
        if self._fp8_buffers is None:
            self._fp8_buffers = fp8_buffers(self.plan, src, dst)
            # every refit's report carries their bytes: summed here, not per refit
            self._fp8_held_bytes = tuple(sum(t.nbytes for t in d.values()) for d in reversed(self._fp8_buffers))
        return self._fp8_buffers

    def _verify_transport(self) -> Transport:
        """The FP8 verify moves the bytes into scratch buffers and compares: a push
        transport can only write into the destination, so its verify goes over Gloo rounds."""
        t = self._transport
        if isinstance(t, OneSidedTransport) and not t.pull:
            if self._gloo is None:
                self._gloo = GlooTransport(self.group, self._device())
            return self._gloo
        return t

    @set_aside
    @outside_inference
    def verify(self) -> None:
        """Check that every destination replica holds the source's values. Collective.

        An independent witness (``torchrefit.verify``): each rank checksums its own
        pieces in global coordinates, position-aware, from the rosters and the name map
        alone (not the plan's transfers or messages), and one all-reduce compares the
        sums; raises :class:`VerificationError` on every rank naming the first
        differing tensors, regions and ranks. Costs reading both models once.

        FP8 destinations: the witness's source side quantizes every block that one
        source rank holds whole (``torchrefit.verify.fp8_units``) and compares values and
        scales; blocks that no single source rank holds are then compared through the
        plan (the same bytes as a refit moved into scratch buffers and compared with the
        shadows and the torch quantization of them: the refit's own path, not an
        independent one), and its error says so.
        """
        if self._stager is not None:  # collective: after the stages requested before
            self._stager.settle()
        self._raise_if_failed()
        self._rebind()  # compare what the model holds now
        if self._phases is not None:
            raise VerificationError("verify() cannot check a refit into a load_weights sink: the "
                                    "sink keeps no copy of what it handed to the engine")
        if self._witness is None:
            self._witness = Witness(self._planner, self.rank, self._src.layout if self._src else None,
                                    self._dst.layout if self._dst else None)
        check(self._witness, self._src.tensors if self._src else {},
              self._dst.tensors if self._dst else {}, self.group, self.timeout)
        if self._witness.unchecked:  # the same on every rank: all take this path or none
            self._verify_by_plan()

    def _verify_by_plan(self) -> None:
        if self._verifier is None:
            self._verifier = self._compile(compare=True)
        bad = self._verifier.mismatches()
        out = all_gather_pickled(bad[:5], self.group, self.timeout)
        found = [f"rank {r}: {m}" for r, ms in enumerate(out) for m in (ms or [])]
        if found:
            raise VerificationError(
                "destination differs from source: " + "; ".join(found[:5]) + f" (compared through the "
                f"plan: FP8 blocks that no single source rank holds, {self._unchecked_text()}, are "
                "not covered by the checksum witness)")

    def _unchecked_text(self) -> str:
        u = self._witness.unchecked if self._witness is not None else {}
        return f"{sum(u.values())} in {len(u)} tensor(s), first {min(u)}" if u else "none"

    def _raise_if_failed(self) -> None:
        try:
            self._transport.raise_if_failed()
        except TransportError as e:
            self._failed = e
        if self._failed is not None:
            raise TransportError(f"an earlier refit failed, the group is unusable for refits: "
                                 f"{self._failed}")

    @set_aside
    def close(self) -> None:
        """Release compiled programs, message pools and stage twins. Not collective, except with
        ``transport="nvshmem"``: NVSHMEM frees its symmetric inbox collectively, so
        every rank of the group calls ``close()`` then."""
        if self._stager is not None:
            self._stager.close()
        self._program = None
        self._phase_programs = None
        self._verifier = None
        self._stage_program = self._twins = self._commit = None
        self._witness = None
        for t in (self._transport, self._gloo):
            if t is not None:
                t.close()

    def __repr__(self) -> str:
        return (f"Refitter(rank {self.rank}/{self.world}, transport={self.transport_name}, "
                f"version={self.version})\n{self.plan}")


def _native_build(watch: str, bindings: dict[str, Binding]) -> BackgroundBuild | None:
    """The background build of the native checks this rank waits for, if it watches
    enough tensors to gain from them and they are not built (``_native.build``)."""
    if watch != "every" or sum(map(len, bindings.values())) < BUILD_MIN_TENSORS:
        return None
    return start_background_build()


def _bindings(src_model, src: Described | None, dst_model, dst: Described | None) -> dict[str, Binding]:
    """Per side with a model (not a load_weights sink): where each described tensor lives."""
    out = {}
    for side, model, described in (("src", src_model, src), ("dst", dst_model, dst)):
        if described is not None and not isinstance(described, SinkDescribed):
            out[side] = Binding(model, described.tensors, side)
    return out


def _timeout(timeout: float | None, group) -> float | None:
    """The refit's timeout: with a ``tr.connect`` Connection, at most the connection's
    (its joint group's own timeout bounds every collective anyway)."""
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
    if isinstance(group, Connection):
        return group.timeout if timeout is None else min(float(timeout), group.timeout)
    return timeout


def _sides(infos: list[_RankInfo]) -> str:
    """"source detected as megatron (ranks [0, 1]), destination as replicated (ranks [2, 3])"."""
    parts = []
    for side, i in (("source", 0), ("destination", 1)):
        kinds: dict[str, list[int]] = {}
        for rank, info in enumerate(infos):
            if info.kinds[i]:
                kinds.setdefault(info.kinds[i], []).append(rank)
        parts.append(f"{side} detected as " + " and ".join(
            f"{k} (ranks {r if len(r) <= 8 else f'{r[:8]}...'})" for k, r in sorted(kinds.items())))
    return ", ".join(parts)


def _resolved(layout: LayoutArg, kind: str) -> LayoutArg:
    """``layout`` as ``describe`` takes it, with None replaced by the adapter ``kind``
    names where :func:`layout_kind` detected one (it detects as ``describe`` does)."""
    return kind if layout is None and kind in NAMED_LAYOUTS else layout


def _held_device(src: Described | None, dst: Described | None, rank: int) -> torch.device | None:
    """The one device this rank's described tensors live on (None: it holds none). Raises
    :class:`LayoutError` where they are not on one device that holds data: a meta tensor
    has no storage (a copy into it writes nothing, and says nothing), and one rank's
    copies run on one device."""
    first: dict[torch.device, tuple[str, str]] = {}  # device -> (side, key) of its first tensor
    for side, d in (("source", src), ("destination", dst)):
        for key, t in (d.tensors.items() if d is not None else ()):
            first.setdefault(t.device, (side, key))
    meta = first.get(torch.device("meta"))
    if meta is not None:
        raise LayoutError(f"{meta[0]} tensor {meta[1]!r} on rank {rank} is on the meta device (no storage "
                          "to read or write): materialize the model first (model.to_empty(device=...) and "
                          "load it)", ranks=(rank,), rule="device", tensor=meta[1])
    if len(first) > 1:
        where = "; ".join(f"{side} tensor {key!r} on {dev}" for dev, (side, key) in first.items())
        raise LayoutError(f"rank {rank}: the models' tensors on this rank live on several devices ({where}); "
                          "torchrefit runs one rank's copies on one device", ranks=(rank,), rule="device")
    return next(iter(first), None)


def _agree_stage(failure: tuple[str, str] | None, group: dist.ProcessGroup, timeout: float | None) -> None:
    """Collective: raise on every rank where a stage failed on any (``failure``: this
    rank's, as :func:`_failure` made it; the lowest failing rank's error class, naming the
    ranks); one all-reduce of a flag when none failed."""
    flag = torch.tensor([int(failure is not None)], dtype=torch.int32, device=collective_device(group))
    collective("agreeing that a stage completed", dist.all_reduce, flag, group=group, timeout=timeout,
               op=dist.ReduceOp.MAX)
    if int(flag.item()):
        errors = all_gather_pickled(failure, group, timeout)
        _raise_agreed(errors, RefitError, "stage failed, nothing staged", "stage")


def _raise_layout_errors(infos: list[_RankInfo]) -> None:
    _raise_agreed([i.error for i in infos], LayoutError, "could not describe the models", "describe")


#: errors that travel between ranks as their class (anything else becomes the default)
_AGREED = {cls.__name__: cls for cls in (LayoutError, PlanError, TransportError, VerificationError,
                                         RefitError)}


def _failure(e: BaseException) -> tuple[str, str]:
    """What a rank tells the others about its failure: the class, and a message with a
    short traceback where the error is not torchrefit's own (a bug, not bad input)."""
    if isinstance(e, RefitError):
        return type(e).__name__, str(e)
    return type(e).__name__, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"


def _raise_agreed(errors: list[tuple[str, str] | None], default: type[RefitError], what: str,
                  rule: str) -> None:
    """On every rank, the same error: the class of the lowest failing rank's error (a
    torchrefit error keeps its class, anything else becomes ``default``), naming the
    ranks; one line per rank in the message, tracebacks in ``detail`` only."""
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if not bad:
        return
    first_rank, (name, _) = bad[0]
    cls = _AGREED.get(name, default)
    where = "; ".join(f"rank {r}: {msg.splitlines()[0]}" for r, (_, msg) in bad[:3])
    raise cls(f"{what} on {len(bad)} rank(s), first on rank {first_rank}: {where}",
              ranks=[r for r, _ in bad], rule=rule,
              detail="\n".join(f"rank {r}: {msg}" for r, (_, msg) in bad))


def _check_offsets(infos: list[_RankInfo], src_offset: int, dst_offset: int) -> None:
    for role, offset, attr in (("source", src_offset, "src"), ("destination", dst_offset, "dst")):
        if not isinstance(offset, int) or offset < 0:
            raise PlanError(f"{role} rank offset must be a non-negative int, not {offset!r}")
        early = [r for r, i in enumerate(infos) if getattr(i, attr) is not None and r < offset]
        if early:
            raise PlanError(f"ranks {early[:8]} hold a {role} model below its rank offset {offset}")


def _choose_transport(transport: str | Transport, infos: list[_RankInfo], backend: str) -> str:
    """The transport's name: ``transport`` checked against every rank, or for
    ``"auto"`` the most preferred registered transport that fits every rank."""
    if isinstance(transport, Transport):
        return transport.name
    if transport == "auto":
        transport = _auto_named(infos) or "auto"
    if transport == "auto":
        cpu = any(i.device == "cpu" for i in infos)
        for cls in registered():
            if _misfit(cls, infos, backend) is None and (cls.auto_on_cpu or not cpu):
                return cls.name
        raise TransportError(f"no registered transport fits every rank: "
                             f"{ {c.name: _misfit(c, infos, backend) for c in registered()} }")
    why = _misfit(transport_class(transport), infos, backend)
    if why is not None:
        raise TransportError(f"transport {transport!r} {why}")
    return transport


def _auto_setting() -> str:
    """What ``"auto"`` means on this rank: ``settings.transport`` ("" where unset or "auto")."""
    named = settings.current().transport.strip()
    return "" if named == "auto" else named


def _auto_named(infos: list[_RankInfo]) -> str:
    """The transport ``settings.transport`` names for ``"auto"`` ("" where unset), the
    same on every rank or a TransportError on every rank (each decides from the same
    gathered infos, so none goes ahead with another transport and hangs)."""
    named: dict[str, list[int]] = {}
    for r, i in enumerate(infos):
        named.setdefault(i.auto, []).append(r)
    if len(named) > 1:
        views = "; ".join(f"ranks {ranks[:8]}: {name or 'unset'}" for name, ranks in sorted(named.items()))
        raise TransportError(f"settings.transport ({settings.ENV['transport']}) differs between ranks "
                             f"({views}); set it alike on every "
                             "rank of the refit group, or on none", ranks=tuple(named[min(named)])[:8],
                             rule="transport")
    return next(iter(named))


def _misfit(cls: type[Transport], infos: list[_RankInfo], backend: str) -> str | None:
    """Why transport ``cls`` cannot run this refit, or None where it can."""
    cpu = [r for r, i in enumerate(infos) if i.device == "cpu"]
    if cls.needs_cuda and cpu:
        return f"needs CUDA tensors on every rank with a model; ranks {cpu[:8]} have CPU tensors"
    missing = [(r, i.unavailable[cls.name]) for r, i in enumerate(infos) if cls.name in i.unavailable]
    if missing:
        return f"is not available on ranks {[r for r, _ in missing][:8]}: {missing[0][1]}"
    hosts = sorted({i.host for i in infos if i.device})
    if cls.one_host and len(hosts) > 1:
        return f"needs every rank with a model on one machine; they are on hosts {hosts[:4]}"
    if cls.backend not in backend:
        return (f"needs a process group with a {cls.backend} backend; the refit group's is {backend!r} "
                f"(create it with backend='cpu:gloo,cuda:nccl')")
    return None


def _pool_bytes(pool_bytes: int, staging_bytes: int | None) -> int:
    """``pool_bytes=``, or its deprecated old name ``staging_bytes=`` ("staging" now names
    only stage/commit's twins)."""
    if staging_bytes is None:
        return pool_bytes
    warnings.warn("Refitter(staging_bytes=) is deprecated: use pool_bytes= (the message pools' "
                  "bound; staging= and StageReport.staging_bytes are stage/commit's twins)",
                  DeprecationWarning, stacklevel=3)
    if pool_bytes != DEFAULT_POOL_BYTES and pool_bytes != staging_bytes:
        raise ValueError(f"pool_bytes={pool_bytes} and its deprecated name staging_bytes={staging_bytes} "
                         "disagree: pass pool_bytes= only")
    return staging_bytes
