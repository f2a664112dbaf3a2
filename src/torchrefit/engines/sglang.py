"""torchrefit inside SGLang: every trainer rank sends its own shards straight into the
live, tensor-parallel-sharded parameters of each SGLang TP worker.

SGLang has no weight-transfer registry; it has general plugins (the entry point group
``sglang.srt.plugins``, loaded in every engine process) and ``Engine.collective_rpc``,
which calls a scheduler method on every TP rank. This module is both sides:

* engine side: :func:`register` (the entry point) adds the scheduler methods
  ``torchrefit_init`` / ``torchrefit_update`` / ``torchrefit_stage`` /
  ``torchrefit_commit`` / ``torchrefit_close``. On init each TP worker joins the
  trainer (:func:`torchrefit.connect`, through :mod:`._link`), checks that both jobs
  refit with the same name map, ``skip``, ``cast`` and staging, and plans once: each
  tensor of its live model is written in place (:func:`decide_routes`); SGLang's
  Qwen2 / Llama hold ``qkv_proj`` and ``gate_up_proj`` fused per TP shard as vLLM does,
  so the layout is :func:`~torchrefit.layout.vllm_tp.vllm_tp_specs` and the name map
  :func:`~torchrefit.maps.hf_to_vllm` (composed after the trainer's own). A tensor
  that cannot be written in place (a quantized linear's, or one SGLang CPU repacked
  for AMX), or one the trainer names in ``SGLangInitInfo.load_weights``, goes through
  the model's own ``load_weights`` instead: the worker receives the whole Hugging Face
  tensors it is made from (a :func:`~torchrefit.layout.sink.load_weights_sink`; every
  trainer rank still sends only its shards) and hands them to ``load_weights`` inside
  the same weight-update window;
* trainer side: :func:`init_sender` on every trainer rank (rank 0 holds the client:
  the ``sglang.Engine``) returns a :class:`SGLangSender`; ``send_weights`` wraps each
  update as SGLang requires (``begin_weight_update``, the transfer and the scheduler's
  ``flush_cache``, ``end_weight_update``, the weight version through the tokenizer
  manager), all through SGLang's own client. ``serve_while_staging=True``: :meth:`SGLangSender.stage_weights`
  streams the update into staging while the engine keeps serving (the scheduler's RPC
  returns at once and a thread of the worker receives), and
  :meth:`SGLangSender.commit_weights` installs it.

An error on any rank of either job (a mismatch at init, an exception inside the engine,
a trainer rank that died) raises on every rank; a failed update records no weight
version, and a failed stage commits nothing (the engine keeps serving its version).
"""

from __future__ import annotations

import json
import logging
import sys
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import PlanError, RefitError, TransportError
from ..layout import describe
from ..layout._described import named_refit_tensors
from ..layout.sink import load_weights_sink
from ..layout.vllm_tp import vllm_tp_specs
from ..maps.base import NameMap
from ..maps.hf_vllm import hf_to_vllm, is_engine_state
from ..refitter import Refitter
from ._link import Terms, agree, agree_status, failure, join
from ._source_maps import (
    compose,
    describe_source,
    route_maps,
    sink_tensors,
    source_map_from,
    vllm_part,
)
from .sglang_http_client import HTTPClient

__all__ = ["DIRECT", "LOAD_WEIGHTS", "Route", "decide_routes", "register", "EngineClient",
           "SGLangInitInfo", "SGLangSender", "init_sender"]

_log = logging.getLogger(__name__)

#: how an update reaches a tensor: written in place, or through the model's ``load_weights``
DIRECT, LOAD_WEIGHTS = "direct", "load_weights"
_DEFAULT_BUCKET_BYTES = 1 << 30
_DEFAULT_TIMEOUT = 300.0
_SCHEDULER = "sglang.srt.managers.scheduler"
_METHODS = ("torchrefit_init", "torchrefit_update", "torchrefit_stage", "torchrefit_commit",
            "torchrefit_close")


# ---------------------------------------------------------------------- the plugin
def register() -> None:
    """The ``sglang.srt.plugins`` entry point: give SGLang's ``Scheduler`` the methods
    ``Engine.collective_rpc`` calls on every TP rank. Run in every engine process;
    only one whose scheduler module is loaded (a scheduler's own) is changed."""
    module = sys.modules.get(_SCHEDULER)
    scheduler = getattr(module, "Scheduler", None)
    if scheduler is None:
        return
    for name in _METHODS:
        setattr(scheduler, name, _SCHEDULER_METHODS[name])


def _receiver(scheduler) -> _Receiver:
    got = getattr(scheduler, "_torchrefit", None)
    if got is None:
        raise RuntimeError("torchrefit: torchrefit_init was not called on this engine")
    return got


def _scheduler_init(self, info: str) -> None:
    old = getattr(self, "_torchrefit", None)
    if old is not None:  # a trainer's earlier link (one whose peer died, say) is replaced
        self._torchrefit = None
        old.close()
    runner = self.tp_worker.model_runner
    self._torchrefit = _Receiver(runner.model, runner.model_config.hf_text_config,
                                 SGLangWorkerInfo(**json.loads(info)))


def _scheduler_update(self, update: int) -> None:
    _receiver(self).update(self, update)


def _scheduler_stage(self, update: int) -> None:
    _receiver(self).stage(update)


def _scheduler_commit(self, update: int) -> None:
    _receiver(self).commit(self, update)


def _scheduler_close(self) -> None:
    old, self._torchrefit = getattr(self, "_torchrefit", None), None
    if old is not None:
        old.close()


_SCHEDULER_METHODS = {"torchrefit_init": _scheduler_init, "torchrefit_update": _scheduler_update,
                      "torchrefit_stage": _scheduler_stage,
                      "torchrefit_commit": _scheduler_commit,
                      "torchrefit_close": _scheduler_close}


# ------------------------------------------------------------------------ init info
@dataclass(frozen=True)
class SGLangInitInfo:
    """The trainer's settings, the same on every trainer rank.

    ``master_address`` / ``master_port``: where trainer rank 0 hosts the rendezvous (it
    uses ``master_port`` and ``master_port + 1``); every SGLang TP worker must reach it.
    ``rank``: this rank in the trainer's default process group (the default).
    ``name_map``: the trainer's names to SGLang's (which are vLLM's):
    ``tr.maps.hf_to_vllm(config)`` for Hugging Face names (the default, from the model's
    ``config``), ``tr.maps.torchtitan_to_vllm(model_config)`` for a torchtitan trainer,
    ``tr.maps.megatron_to_vllm(config)`` for a Megatron-core one; the engine rebuilds it
    (its Hugging Face -> SGLang part from its own config) and both sides check they
    agree. ``skip`` / ``cast``: as ``tr.Refitter``'s. ``group_backend``: ``"gloo"``
    (CPU, or CUDA staged through the host) or ``"nccl"``. ``timeout``: seconds any rank
    waits for a peer. ``serve_while_staging``: updates are staged while the engine
    serves and installed by :meth:`SGLangSender.commit_weights` (each worker holds a
    staging twin of its shards). ``load_weights``: ``fnmatch`` patterns of SGLang tensor
    names (``"*lm_head*"``) sent through the model's ``load_weights`` even where they could
    be written in place (tensors that cannot be go there anyway); every pattern must match
    a tensor. ``bucket_bytes``: the engine's buffer for tensors bound for ``load_weights``.
    """

    master_address: str
    master_port: int
    rank: int | None = field(default=None, kw_only=True)
    name_map: NameMap | None = None
    skip: tuple[str, ...] = ()
    cast: str | bool = "buffers"
    group_backend: str = "gloo"
    timeout: float = _DEFAULT_TIMEOUT
    serve_while_staging: bool = False
    load_weights: tuple[str, ...] = ()
    bucket_bytes: int = _DEFAULT_BUCKET_BYTES


@dataclass(frozen=True)
class SGLangWorkerInfo:
    """What every TP worker is told at init (JSON through ``collective_rpc``, whose
    arguments are plain scalars). Trainer rank 0 fills it in; users do not build it."""

    master_address: str
    master_port: int
    trainer_world_size: int
    source_map: dict[str, Any] | None = None
    skip: list[str] = field(default_factory=list)
    cast: str | bool = "buffers"
    group_backend: str = "gloo"
    timeout: float = _DEFAULT_TIMEOUT
    staged: bool = False
    load_weights: list[str] = field(default_factory=list)
    bucket_bytes: int = _DEFAULT_BUCKET_BYTES


# ------------------------------------------------------------------------ routes
@dataclass(frozen=True)
class Route:
    """How an update reaches one tensor of the live SGLang model, and why."""

    way: str
    why: str


def decide_routes(model: nn.Module, load_weights: tuple[str, ...] = ()) -> dict[str, Route]:
    """Per tensor of a live SGLang model (its names; engine state left out): in place
    where the parameter is what the kernels read; through ``load_weights`` where SGLang
    keeps a repacked or post-processed copy, or where a ``load_weights`` pattern names
    it; ``"emptied"`` (refused) where SGLang emptied it."""
    modules = dict(model.named_modules())
    routes = {}
    for name, t in named_refit_tensors(model):
        if is_engine_state(name):
            continue
        parent, _, _ = name.rpartition(".")
        routes[name] = _route(modules.get(parent, model), t)
        forced = next((p for p in load_weights if fnmatchcase(name, p)), None)
        if forced is not None and routes[name].way == DIRECT:
            routes[name] = Route(LOAD_WEIGHTS, f"asked for (load_weights pattern {forced!r})")
    return routes


def _route(module: nn.Module, t: torch.Tensor) -> Route:
    if t.numel() == 0:
        return Route("emptied", "SGLang emptied it: a kernel reads another copy")
    if getattr(module, "use_intel_amx_backend", False):
        return Route(LOAD_WEIGHTS, "SGLang CPU's AMX kernel reads a repacked copy of it")
    method = getattr(module, "quant_method", None)
    if method is not None and not type(method).__name__.startswith("Unquantized"):
        return Route(LOAD_WEIGHTS, f"{type(method).__name__} post-processes it")
    return Route(DIRECT, "the live weight")


def _unroutable(routes: dict[str, Route], patterns: list[str], staged: bool) -> PlanError | None:
    """Why this plan cannot run: a tensor neither way takes, a pattern that names no
    tensor, or ``load_weights`` tensors in a staged link."""
    bad = [(n, r) for n, r in routes.items() if r.way not in (DIRECT, LOAD_WEIGHTS)]
    if bad:
        shown = "; ".join(f"{n}: {r.why}" for n, r in bad[:3])
        return PlanError(f"{len(bad)} tensor(s) of the SGLang model can be neither written in "
                         f"place nor loaded ({shown})", tensor=bad[0][0], rule="in place")
    unused = [p for p in patterns if not any(fnmatchcase(n, p) for n in routes)]
    if unused:
        return PlanError(f"SGLangInitInfo.load_weights pattern(s) {unused} match no tensor of "
                         f"the SGLang model (its names: {sorted(routes)[:3]}...)",
                         rule="load_weights")
    loaded = [n for n, r in routes.items() if r.way == LOAD_WEIGHTS]
    if loaded and staged:
        return PlanError(f"{len(loaded)} tensor(s) go through load_weights ({loaded[0]}: "
                         f"{routes[loaded[0]].why}): serve_while_staging stages in-place "
                         "tensors only", tensor=loaded[0], rule="serve_while_staging")
    return None


# ------------------------------------------------------------------- engine side
class _Receiver:
    """One TP worker's end of the link: its planned Refitter over the live shards."""

    def __init__(self, model: nn.Module, hf_config, info: SGLangWorkerInfo) -> None:
        from sglang.srt.distributed.parallel_state import get_tp_group

        tp = get_tp_group()
        self.model = model
        self.staged = info.staged
        self.refitter: Refitter | None = None  # the tensors written in place
        self.loader: Refitter | None = None  # the tensors bound for load_weights
        self._load_error: tuple[str, str] | None = None
        self._stager: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self.conn, self._store = join(
            "engine", tp.rank_in_group, tp.world_size, info.master_address, info.master_port,
            peer_world_size=info.trainer_world_size, backend=info.group_backend,
            timeout=info.timeout)
        try:
            self._plan(info, hf_config, tp.rank_in_group, tp.world_size)
        except BaseException:
            self.close()
            raise

    def _plan(self, info: SGLangWorkerInfo, hf_config, tp_rank: int, tp_size: int) -> None:
        try:
            name_map = compose(hf_to_vllm(hf_config), source_map_from(info.source_map))
            key = repr(name_map.cache_key())
        except PlanError as e:  # told to every rank by the agreement below
            name_map, key = None, f"unusable: {e}"
        routes = decide_routes(self.model, tuple(info.load_weights))
        seen = agree(self.conn, Terms(key, tuple(info.skip), info.cast, info.staged),
                     {k: (r.way, r.why) for k, r in routes.items()})
        source = {}  # every trainer rank's global tensors: what load_weights is fed from
        for role, _, _, extra in seen:
            if role == "trainer":
                source.update(extra)
        ways = {way for role, _, _, extra in seen if role == "engine"
                for way, _ in extra.values()}
        error, live, specs, wanted = None, {}, None, []
        try:
            problem = _unroutable(routes, info.load_weights, info.staged)
            if problem is not None:
                raise problem
            heads = vllm_part(name_map)
            every = {n: t for n, t in named_refit_tensors(self.model) if n in routes}
            specs = vllm_tp_specs(every, tp_rank, tp_size, num_heads=heads.num_heads,
                                  num_kv_heads=heads.num_kv_heads)
            live = {n: t for n, t in every.items() if routes[n].way == DIRECT}
            wanted = sink_tensors(name_map, {
                n: specs[n].global_shape if n in specs else tuple(every[n].shape)
                for n in every if routes[n].way == LOAD_WEIGHTS}, source)
            specs = {n: specs[n] for n in live if n in specs}
        except Exception as e:
            error = failure(e, f"engine rank {self.conn.rank} planning")
        agree_status(self.conn, error, "planning the SGLang refit", applied=False)
        self._build(info, name_map, ways, live, specs, wanted)
        _log.info("torchrefit: SGLang TP rank %d: %d tensors written in place, %d Hugging "
                  "Face tensors through load_weights", tp_rank, len(live), len(wanted))
        for name, route in routes.items():
            if route.way != DIRECT:
                _log.info("torchrefit: %s through load_weights: %s", name, route.why)

    def _build(self, info: SGLangWorkerInfo, name_map, ways, live, specs, wanted) -> None:
        """One Refitter per route any engine rank takes, in the trainer's order."""
        kw = dict(group=self.conn, skip=tuple(info.skip), cast=info.cast, timeout=info.timeout)
        maps = route_maps(name_map)
        if DIRECT in ways:
            self.refitter = Refitter(None, live or None, dst_layout=specs if live else None,
                                     name_map=maps[DIRECT], **kw)
        if LOAD_WEIGHTS in ways:
            device = next(iter(live.values())).device if live else None
            sink = load_weights_sink(
                self._load_bucket, [(n, shape, getattr(torch, dt)) for n, shape, dt in wanted],
                bucket_bytes=info.bucket_bytes, device=device) if wanted else None
            self.loader = Refitter(None, self.model if wanted else None, dst_layout=sink,
                                   name_map=maps[LOAD_WEIGHTS], **kw)

    def _load_bucket(self, pairs) -> None:
        """The sink's ``load_weights``: one bucket into SGLang's weight loaders (which copy
        into the live parameters). An exception is kept and told to every rank when the
        update ends, not raised mid-exchange (the trainer's ranks would wait for this one)."""
        if self._load_error is not None:
            return
        try:
            self.model.load_weights(pairs)
        except Exception as e:
            self._load_error = failure(e, f"engine rank {self.conn.rank}: SGLang's load_weights "
                                          f"({', '.join(n for n, _ in pairs[:3])}...)")

    def update(self, scheduler, update: int) -> None:
        """Receive one update into the live shards, inside SGLang's open weight-update
        window; every rank of both jobs then learns whether any failed. ``scheduler``:
        None where SGLang itself checked the window and flushes after (its
        ``update_weights_from_tensor``, :mod:`.sglang_http`)."""
        error = None
        try:
            if scheduler is not None:
                _session(scheduler)
        except Exception as e:
            error = failure(e, f"engine rank {self.conn.rank} opening the update")
        agree_status(self.conn, error, f"SGLang weight update {update} (opening)",
                     applied=False)
        self._load_error = None
        try:
            for refitter in (self.refitter, self.loader):
                if refitter is not None:
                    refitter.refit()
        except Exception as e:
            error = failure(e, f"engine rank {self.conn.rank} receiving")
        agree_status(self.conn, error or self._load_error, f"SGLang weight update {update}")
        if scheduler is not None:
            _flush(scheduler)

    def stage(self, update: int) -> None:
        """Start staging ``update`` on a thread of this worker and return: the scheduler
        keeps serving its version while the bytes arrive."""
        if not self.staged:
            raise RuntimeError("torchrefit: torchrefit_stage on a link initialized without "
                               "serve_while_staging")
        if self._pending is not None and self._pending.done() and self._pending.exception():
            self._pending = None  # a stage that failed (raised on every trainer rank then)
        if self._pending is not None:
            raise RuntimeError("torchrefit: a staged update is still pending: commit it first")
        if self._stager is None:
            self._stager = ThreadPoolExecutor(1, thread_name_prefix="torchrefit-sglang-stage")
        self._pending = self._stager.submit(self._stage, update)

    def _stage(self, update: int) -> None:
        error = None
        try:
            self.refitter.stage()
        except TransportError:  # a peer lost: every live rank of both jobs raises it itself
            raise
        except Exception as e:
            error = failure(e, f"engine rank {self.conn.rank} staging")
        agree_status(self.conn, error, f"SGLang weight update {update} (staging)",
                     applied=False)

    def commit(self, scheduler, update: int) -> None:
        """Install the staged update (inside SGLang's open weight-update window): wait
        for the stage; if it failed anywhere, install nothing and raise."""
        if scheduler is not None:
            _session(scheduler)
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError(f"torchrefit: commit of update {update}: nothing staged")
        try:
            pending.result()
        except Exception as e:
            raise RefitError(f"SGLang weight update {update}: the stage failed, nothing was "
                             f"installed: {str(e).splitlines()[0]}", rule="nothing staged") from e
        self.refitter.commit()
        if scheduler is not None:
            _flush(scheduler)

    def close(self) -> None:
        if self._pending is not None:
            wait([self._pending], timeout=0)
        if self._stager is not None:
            self._stager.shutdown(wait=False)
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:  # a link whose peer died: nothing left to close cleanly
                _log.warning("torchrefit: closing the trainer link", exc_info=True)
            self.conn = None


def _flush(scheduler) -> None:
    """Flush the cache the old weights produced, in the scheduler, as SGLang's own
    ``update_weights_from_distributed`` / ``_from_tensor`` do: without emptying the
    allocator's cache (their default; on CPU that alone takes ~0.7 s)."""
    if not scheduler.flush_cache(empty_cache=False):
        raise RuntimeError("torchrefit: the weights were updated, but SGLang refused to flush "
                           "its cache (requests still running or queued): retract or finish "
                           "them, then call flush_cache")


def _session(scheduler) -> None:
    """SGLang 0.5.23+ wants every update between ``begin_weight_update`` and
    ``end_weight_update``; the in-place writes need no load, so the end of the window
    runs the model's post-load steps as after any direct (P2P) write."""
    updater = getattr(scheduler, "weight_updater", None)
    if updater is not None and hasattr(updater, "_session") and updater._session is None:
        raise RuntimeError("torchrefit: an update must run between begin_weight_update() "
                           "and end_weight_update()")


# ------------------------------------------------------------------- trainer side
class EngineClient:
    """Trainer rank 0's way to the engine: an in-process ``sglang.Engine``'s own calls
    (``collective_rpc`` to the scheduler methods above; begin / end of the weight-update
    window and the weight version through its tokenizer manager)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def rpc(self, method: str, **kw) -> None:
        try:
            self.engine.collective_rpc(method, **kw)
        except AssertionError as e:  # collective_rpc asserts the scheduler's success
            raise RuntimeError(f"SGLang's {method} failed: {e}") from None

    def begin(self) -> None:
        _check(self.engine.begin_weight_update(), "begin_weight_update")

    def end(self) -> None:
        _check(self.engine.end_weight_update(), "end_weight_update")

    def set_weight_version(self, version: str) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        req = UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False)
        self.engine.loop.run_until_complete(
            self.engine.tokenizer_manager.update_weight_version(req))


def _check(result, what: str) -> None:
    ok, message = result if isinstance(result, tuple) else (True, "")
    if not ok:
        raise RuntimeError(f"SGLang's {what} failed: {message}")


def _client(engine):
    """Rank 0's way to the engine: an in-process ``sglang.Engine``, or an HTTP server's
    URL; anything with ``rpc`` / ``begin`` / ``end`` / ``set_weight_version`` as is."""
    if engine is None or all(hasattr(engine, m) for m in ("rpc", "begin", "end",
                                                           "set_weight_version")):
        return engine
    if isinstance(engine, str):


        return HTTPClient(engine)
    return EngineClient(engine)


def init_sender(info: SGLangInitInfo, model: nn.Module, engine=None) -> SGLangSender:
    """On every trainer rank (a collective over the trainer's default group): join the
    engine and plan. ``engine``: on rank 0, the ``sglang.Engine`` (or an
    :class:`EngineClient`), or the URL of an SGLang HTTP server (``"http://host:30000"``,
    or an :class:`~torchrefit.engines.sglang_http.HTTPClient`: see that module); None
    elsewhere. Raises the same error on every rank of both
    jobs where they disagree (names, shapes, dtypes, name map, skip, cast, staging)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = info.rank if info.rank is not None else (dist.get_rank() if dist.is_initialized()
                                                    else 0)
    client = _client(engine)
    if (client is not None) != (rank == 0):
        raise ValueError(f"init_sender: trainer rank {rank} "
                         f"{'got' if client else 'needs'} the engine (rank 0 alone holds it)")
    name_map = info.name_map or hf_to_vllm(getattr(model, "config", None))
    sender = SGLangSender(client, rank, info.serve_while_staging)
    pending = None
    if client is not None:
        worker = SGLangWorkerInfo(info.master_address, info.master_port, world,
                                  describe_source(name_map), list(info.skip), info.cast,
                                  info.group_backend, info.timeout, info.serve_while_staging,
                                  list(info.load_weights), info.bucket_bytes)
        pending = sender._rpc.submit(client.rpc, "torchrefit_init",
                                     info=json.dumps(asdict(worker)))
    try:
        sender._connect(info, rank, world, name_map, model)
    except BaseException:
        if pending is not None:  # the engine fails alike: let its RPC return
            wait([pending], timeout=info.timeout)
        sender._rpc.shutdown(wait=False)
        raise
    sender._raise_shared(_outcome(pending, info.timeout), "initializing SGLang's torchrefit link")
    return sender


class SGLangSender:
    """One trainer rank's sender (build it with :func:`init_sender`).

    ``routes``: engine TP rank 0's ``{SGLang name: Route}``. ``reports``: this rank's
    :class:`~torchrefit.RefitReport` of the last update (its bytes sent are its own
    shards only)."""

    def __init__(self, client: EngineClient | None, rank: int, staged: bool) -> None:
        self.client, self.rank, self._staged = client, rank, staged
        self.routes: dict[str, Route] = {}
        self.reports: list = []
        self._conn = self._store = None
        self._refitter: Refitter | None = None  # the in-place route's (staging: the only one)
        self._refitters: list[Refitter] = []  # one per route the engine takes
        self._updates = 0
        self._stage_failed: BaseException | None = None
        self._rpc = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrefit-sglang")

    def _connect(self, info: SGLangInitInfo, rank: int, world: int, name_map: NameMap,
                 model: nn.Module) -> None:
        self._conn, self._store = join("trainer", rank, world, info.master_address,
                                       info.master_port, peer_world_size=None,
                                       backend=info.group_backend, timeout=info.timeout)
        seen = agree(self._conn, Terms(repr(name_map.cache_key()), tuple(info.skip),
                                       info.cast, info.serve_while_staging),
                     {t.name: (tuple(t.global_shape), str(t.dtype))
                      for _, t in describe(model).layout})
        engines = [extra for role, _, _, extra in seen if role == "engine"]
        self.routes = {k: Route(*v) for k, v in engines[0].items()}
        ways = {way for extra in engines for way, _ in extra.values()}
        agree_status(self._conn, None, "planning the SGLang refit", applied=False)
        kw = dict(group=self._conn, skip=tuple(info.skip), cast=info.cast, timeout=info.timeout)
        maps = route_maps(name_map)
        self._refitters = [Refitter(model, None, name_map=maps[way], **kw)
                           for way in (DIRECT, LOAD_WEIGHTS) if way in ways]
        self._refitter = self._refitters[0]

    def send_weights(self, weight_version: str | None = None) -> None:
        """One update, on every trainer rank: rank 0 opens SGLang's weight-update window
        and has every TP worker receive while every rank sends its shards (each worker
        then flushes its cache); then closes the window and records ``weight_version``. With
        ``serve_while_staging``: :meth:`stage_weights`, then :meth:`commit_weights`."""
        if self._staged:
            self.stage_weights()
            self.commit_weights(weight_version)
            return
        self._updates += 1
        self._raise_shared(self._on_client(self.client.begin) if self.client else None,
                           "opening SGLang's weight-update window")
        pending = (self._rpc.submit(self.client.rpc, "torchrefit_update", update=self._updates)
                   if self.client else None)
        error = None
        try:  # the engine's checks before any byte moves (its window open, say)
            agree_status(self._conn, None, f"SGLang weight update {self._updates} (opening)",
                         applied=False)
            try:
                self.reports = [refitter.refit() for refitter in self._refitters]
            except Exception as e:
                error = failure(e, f"trainer rank {self.rank} sending")
            agree_status(self._conn, error, f"SGLang weight update {self._updates}")
        except Exception:
            if pending is not None:  # the engine raised the same error: let its RPC return
                wait([pending], timeout=self._conn.timeout)
                self._on_client(self.client.end)  # the window closes; no version recorded
            raise
        self._raise_shared(self._finish(pending, weight_version) if self.client else None,
                           "finishing the SGLang weight update")

    def _finish(self, pending: Future | None, weight_version: str | None):
        """Rank 0: the engine's answer, the window's end, the version."""
        got = _outcome(pending, self._conn.timeout)  # the update, then the cache flushed
        ended = self._on_client(self.client.end)
        if got or ended or weight_version is None:
            return got or ended
        return self._on_client(self.client.set_weight_version, weight_version)

    def stage_weights(self) -> None:
        """``serve_while_staging``, every trainer rank: rank 0 has every TP worker start a
        stage (the RPC returns at once; the engine keeps serving), every rank sends its
        shards into the workers' staging. A failure anywhere raises on every rank with
        nothing installed."""
        if not self._staged:
            raise RefitError("stage_weights(): pass SGLangInitInfo(serve_while_staging=True) "
                             "at init (the engine agreed on it then)")
        self._updates += 1
        self._stage_failed = None
        started = (self._on_client(self.client.rpc, "torchrefit_stage", update=self._updates)
                   if self.client else None)
        self._raise_shared(started, "starting the staged SGLang weight update")
        error = None
        try:
            self.reports = [self._refitter.stage()]
        except TransportError as e:  # a peer lost: every live rank of both jobs raises it
            self._stage_failed = e  # itself, within the timeout; the link is unusable
            raise
        except Exception as e:
            error = failure(e, f"trainer rank {self.rank} sending")
        try:
            agree_status(self._conn, error, f"SGLang weight update {self._updates} (staging)",
                         applied=False)
        except Exception as e:
            self._stage_failed = e
            raise

    def commit_weights(self, weight_version: str | None = None) -> None:
        """After :meth:`stage_weights`, every trainer rank: rank 0 has every TP worker
        install its staged shards and flush its cache inside SGLang's weight-update
        window (the engine's only stall), then records ``weight_version``. Refused
        after a :meth:`stage_weights` that failed: the engine keeps its version."""
        if self._stage_failed is not None:
            raise RefitError(f"commit_weights({weight_version!r}): nothing staged to commit, the "
                             f"last stage_weights() failed ({self._stage_failed}); the engine "
                             "keeps its version", rule="nothing staged")
        self._raise_shared(self._commit(weight_version) if self.client else None,
                           "committing the staged SGLang weight update")

    def _commit(self, weight_version: str | None):
        begun = self._on_client(self.client.begin)
        if begun:
            return begun
        pending = self._rpc.submit(self.client.rpc, "torchrefit_commit", update=self._updates)
        return self._finish(pending, weight_version)

    @staticmethod
    def _on_client(call, *args, **kw) -> tuple[str, str] | None:
        try:
            call(*args, **kw)
            return None
        except Exception as e:
            return failure(e, "trainer rank 0's SGLang client")

    def _raise_shared(self, error: tuple[str, str] | None, what: str) -> None:
        """Rank 0's client call, told to every trainer rank (its default group)."""
        _raise_shared(error, what)

    def shutdown(self) -> None:
        """Close the link (rank 0 also has every TP worker drop its end)."""
        if self.client is not None:
            self._on_client(self.client.rpc, "torchrefit_close")
        self._rpc.shutdown(wait=False)
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _raise_shared(error: tuple[str, str] | None, what: str) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise RefitError(f"{what} failed on the engine (seen by trainer rank 0's client): "
                         f"{error[1].splitlines()[0]}; this trainer's model is unchanged",
                         rule="update failed", detail=error[1])


def _outcome(pending: Future | None, timeout: float) -> tuple[str, str] | None:
    """The engine's answer to an RPC that has nothing left to wait for: an engine that
    died is told by a timeout, not a hang."""
    if pending is None:
        return None
    try:
        pending.result(timeout=timeout)
        return None
    except TimeoutError:
        return ("TimeoutError", f"the engine's RPC did not answer within {timeout:g} s (did "
                                "the engine die?)")
    except Exception as e:
        return failure(e, "trainer rank 0's SGLang client")
