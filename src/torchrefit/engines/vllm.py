"""torchrefit as vLLM's weight-transfer backend ``"torchrefit"``.

vLLM moves a trainer's weights through its weight-transfer API: the trainer calls
``init_weight_transfer_engine`` once, then per update ``start_weight_update`` ->
``update_weights`` -> ``finish_weight_update(weight_version=...)``, through any client
(the in-process ``LLM``, ``HTTPVLLMWeightSyncClient`` against ``vllm serve``). This
module is both sides of a backend for it:

* worker side, :class:`TorchrefitWeightTransferEngine` (registered with vLLM's
  ``WeightTransferEngineFactory`` by the ``vllm.general_plugins`` entry point
  :func:`register`): on ``init_transfer_engine`` it joins the trainer
  (:func:`torchrefit.connect`), decides per tensor of the worker's live model how an
  update reaches it (:func:`decide_routes`: *direct*, written in place where the vLLM
  parameter is the weight the kernels read; *load_weights*, through vLLM's layerwise
  reload and the model's ``load_weights``, where vLLM keeps a packed or post-processed
  copy instead) and plans once. Each update then *receives* (every trainer rank sends
  its own shards; no gather on the trainer) and *applies* (vLLM's post-load steps, as a
  fresh load runs them);
* trainer side, :class:`TorchrefitTrainerWeightTransferEngine` (registered with
  ``WeightTransferTrainerFactory`` when this module is imported), built from
  :class:`TorchrefitTrainerInitInfo` on every trainer rank; ``send_weights()`` on every
  rank drives start / update / finish through rank 0's client concurrently with its
  own sending. The trainer's tensors may be named the Hugging Face, torchtitan or
  Megatron-core way (``name_map``: ``hf_to_vllm``, ``torchtitan_to_vllm``,
  ``megatron_to_vllm``); the map reaches the workers as a JSON description and is
  rebuilt there (:mod:`._source_maps`).

With ``TorchrefitTrainerInitInfo(serve_while_staging=True)`` an update is staged
while the engine serves (vLLM's ``defers_processing`` contract): the worker's
``update_weights`` starts a stage and returns at once, the bytes stream into staging
(``Refitter.stage()`` twins for the in-place tensors, the held ``load_weights`` buffer
for the others) while the engine keeps generating from version v, and
``finish_weight_update`` commits: the in-place twins are copied into the live
tensors and the held tensors go through vLLM's layerwise reload, so the engine stalls
only there (docs/vllm.md).

Both sides check at init that they refit with the same name map, ``skip``,
``cast`` and staging; an exception in the engine (``load_weights`` included) reaches every trainer
rank when the update ends, wrapped in :class:`~torchrefit.RefitError`.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from ..errors import PlanError, RefitError
from ..layout import describe
from ..layout._described import named_refit_tensors
from ..layout.sink import load_weights_mirror, load_weights_sink
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

__all__ = [
    "BACKEND", "DIRECT", "LOAD_WEIGHTS", "Route", "decide_routes", "register",
    "TorchrefitInitInfo", "TorchrefitUpdateInfo", "TorchrefitWeightTransferEngine",
    "TorchrefitTrainerInitInfo", "TorchrefitTrainerWeightTransferEngine",
    "open_reload", "load_whole", "close_reload", "repack_after_reload",
]

_log = logging.getLogger(__name__)

#: the name both factories know this backend by (``WeightTransferConfig(backend=...)``)
BACKEND = "torchrefit"
#: how an update reaches a tensor: written in place, or through vLLM's ``load_weights``
DIRECT, LOAD_WEIGHTS = "direct", "load_weights"
_DEFAULT_BUCKET_BYTES = 1 << 30  # the largest tensor must fit (a 0.5 B float32 vocabulary: 544 MB)
_DEFAULT_TIMEOUT = 300.0
_ALL_AT_ONCE = 1 << 62  # a staged sink's bucket: its buffer is what the worker wants, once


def register() -> None:
    """Register both sides with vLLM's factories (the ``vllm.general_plugins`` entry
    point; also run on import). Registering twice is harmless."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, __name__, "TorchrefitWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, __name__, "TorchrefitTrainerWeightTransferEngine")


# ------------------------------------------------------------------ init and update info
@dataclass
class TorchrefitInitInfo(WeightTransferInitInfo):
    """What the engine's workers are told at ``init_weight_transfer_engine`` (plain
    JSON values: the HTTP server carries it). Trainer rank 0 fills it in from
    :class:`TorchrefitTrainerInitInfo`; users do not build it."""

    master_address: str
    master_port: int
    trainer_world_size: int
    #: how the trainer names its tensors: None, the Hugging Face way; else the declared
    #: description of its map to Hugging Face names (``_source_maps.SOURCE_MAPS``)
    source_map: dict[str, Any] | None = None
    skip: list[str] = field(default_factory=list)
    cast: str | bool = "buffers"
    group_backend: str = "gloo"
    timeout: float = _DEFAULT_TIMEOUT
    bucket_bytes: int = _DEFAULT_BUCKET_BYTES
    staged: bool = False
    delta: str | None = None


@dataclass
class TorchrefitUpdateInfo(WeightTransferUpdateInfo):
    """Per update: the trainer's count of updates (for logs); the weights travel apart."""

    update: int = 0


@dataclass
class TorchrefitTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info, the same on every trainer rank.

    ``master_address`` / ``master_port``: where trainer rank 0 hosts the rendezvous
    (it uses ``master_port`` and ``master_port + 1``); the engine's workers must reach
    it. ``rank``: this rank in the trainer's default process group (the default).
    ``name_map``: the trainer's names to vLLM's, as ``tr.Refitter`` would take it:
    ``tr.maps.hf_to_vllm(config)`` for Hugging Face names (the default, from the source
    model's ``config``), ``tr.maps.torchtitan_to_vllm(model_config)`` for a torchtitan
    trainer, ``tr.maps.megatron_to_vllm(config)`` for a Megatron-core one; the engine
    rebuilds it (the Hugging Face -> vLLM part from its own config) and both sides check
    they agree. ``skip`` / ``cast``: as ``tr.Refitter``'s, sent to the engine.
    ``group_backend``: ``"gloo"`` (CPU, or CUDA staged through the host) or ``"nccl"``.
    ``timeout``: seconds any rank waits for a peer. ``bucket_bytes``: the engine's
    buffer for tensors going through ``load_weights``. ``serve_while_staging``: each
    update is staged while the engine serves and installed by ``finish_weight_update``
    (the engine then holds a staging copy of the bytes it receives: in-place tensors'
    twins, and every tensor bound for ``load_weights`` at once instead of a bucket).
    ``delta``: ``Refitter(delta=...)`` on both sides (``"device"`` or ``"host"``: where
    the trainer keeps its reference): updates carry only the changed elements. In-place
    tensors are patched; the engine keeps a copy of every tensor bound for
    ``load_weights``, patches it and hands the whole tensors to ``load_weights`` (its
    memory, instead of a bucket; docs/delta.md).
    """

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    rank: int | None = field(default=None, kw_only=True)
    name_map: NameMap | None = None
    skip: tuple[str, ...] = ()
    cast: str | bool = "buffers"
    group_backend: str = "gloo"
    timeout: float = _DEFAULT_TIMEOUT
    bucket_bytes: int = _DEFAULT_BUCKET_BYTES
    serve_while_staging: bool = False
    delta: str | None = None

    def __post_init__(self) -> None:
        if self.rank is None:
            self.rank = dist.get_rank() if dist.is_initialized() else 0


# ------------------------------------------------------------------------ routes
@dataclass(frozen=True)
class Route:
    """How an update reaches one tensor of the live vLLM model, and why."""

    way: str  # DIRECT or LOAD_WEIGHTS
    why: str


def decide_routes(model: nn.Module) -> dict[str, Route]:
    """Per tensor of a live vLLM model (vLLM's names; engine state left out): direct
    where the parameter is what the kernels read, else through ``load_weights``."""
    modules = dict(model.named_modules())
    routes = {}
    for name, t in named_refit_tensors(model):
        if is_engine_state(name):
            continue
        parent, _, leaf = name.rpartition(".")
        routes[name] = _route(modules.get(parent, model), leaf, t)
    return routes


def _route(module: nn.Module, leaf: str, t: torch.Tensor) -> Route:
    if t.numel() == 0:
        return Route(LOAD_WEIGHTS, "emptied by vLLM: the kernel reads a packed copy")
    packed = getattr(module, "cpu_linear", None)
    if packed is not None and packed is not F.linear:
        return Route(LOAD_WEIGHTS, "vLLM CPU's GEMM reads a packed copy of it")
    method = getattr(module, "quant_method", None)
    if hasattr(module, "w13_weight") and _on_cpu(t):
        return Route(LOAD_WEIGHTS, "vLLM CPU's MoE kernel reads prepacked experts")
    if method is not None and not type(method).__name__.startswith("Unquantized"):
        return Route(LOAD_WEIGHTS, f"{type(method).__name__} post-processes it")
    return Route(DIRECT, "the live weight")


def _on_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _loaded_shapes(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Meta tensors of the shapes ``names`` had before vLLM processed them (vLLM records
    them for reloading), for tensors vLLM emptied or repacked."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    modules = dict(model.named_modules())
    out = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        params, buffers = get_layerwise_info(modules[parent]).restore_metadata
        meta = params.get(leaf, buffers.get(leaf))
        live = getattr(modules[parent], leaf)
        if meta is None and live.numel() > 0:  # kept as loaded (a bias beside a packed weight)
            meta = live.to("meta")
        if meta is None:
            raise PlanError(f"{name}: vLLM recorded no shape for it before processing; it "
                            "cannot be routed through load_weights", tensor=name)
        out[name] = meta
    return out


# ------------------------------------------------------------------- worker side
class TorchrefitWeightTransferEngine(
        WeightTransferEngine[TorchrefitInitInfo, TorchrefitUpdateInfo]):
    """vLLM's worker-side engine for backend ``"torchrefit"`` (see the module docstring).

    ``routes`` (after init): ``{vLLM name: Route}`` for this worker's tensors.
    ``last_stage_error``: staged updates only, why the last staged update installed
    nothing (its stage failed: a trainer rank died, say), or None.
    """

    init_info_cls = TorchrefitInitInfo
    update_info_cls = TorchrefitUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.routes: dict[str, Route] = {}
        self._conn = self._store = None
        self._direct: Refitter | None = None
        self._reload: Refitter | None = None
        self._sink = None
        self._mirror: dict[str, torch.Tensor] = {}  # with delta: the load_weights tensors, kept
        self._load_error: tuple[str, str] | None = None
        self._reloading = False
        self._staged = False  # serve while staging: update_weights stages, finish commits
        self._stager: ThreadPoolExecutor | None = None
        self._pending: Future | None = None  # the update being staged
        self._held: list | None = None  # staged tensors bound for load_weights
        self.last_stage_error: str | None = None

    # -- init
    def init_transfer_engine(self, init_info: TorchrefitInitInfo) -> None:
        from vllm.distributed.parallel_state import get_tp_group, get_world_group

        world = get_world_group()
        tp = get_tp_group()
        self._release()  # a trainer's earlier link (one whose peer died, say) is replaced
        self._conn, self._store = join("engine", world.rank_in_group, world.world_size,
                          init_info.master_address, init_info.master_port,
                          peer_world_size=init_info.trainer_world_size,
                          backend=init_info.group_backend, timeout=init_info.timeout)
        try:
            name_map = self._name_map(init_info.source_map)
            key = repr(name_map.cache_key())
        except PlanError as e:  # told to every rank by the agreement below
            name_map, key = None, f"unusable: {e}"
        terms = Terms(key, tuple(init_info.skip), init_info.cast, init_info.staged, init_info.delta)
        self._staged = self.defers_processing = init_info.staged
        self.routes = decide_routes(self.model)
        seen = agree(self._conn, terms, {k: (r.way, r.why) for k, r in self.routes.items()})
        source: dict[str, tuple[tuple[int, ...], str]] = {}  # what every trainer rank holds
        for role, _, _, extra in seen:
            if role == "trainer":
                source.update(extra)
        ways = {r.way for role, _, _, extra in seen if role == "engine"
                for r in map(lambda v: Route(*v), extra.values())}
        heads = vllm_part(name_map).num_heads, vllm_part(name_map).num_kv_heads
        maps = route_maps(name_map)
        direct, reload, error = {}, [], None
        try:
            direct, reload = self._destinations(name_map, source, tp.rank_in_group,
                                                tp.world_size, heads)
        except Exception as e:
            error = failure(e, f"engine rank {self._conn.rank} planning")
        agree_status(self._conn, error, "planning the vLLM refit", applied=False)
        kw = dict(group=self._conn, skip=tuple(init_info.skip), cast=init_info.cast,
                  timeout=init_info.timeout, delta=init_info.delta)
        if DIRECT in ways:
            self._direct = Refitter(None, direct or None, dst_layout=vllm_tp_specs(
                direct, tp.rank_in_group, tp.world_size, num_heads=heads[0],
                num_kv_heads=heads[1]) if direct else None, name_map=maps[DIRECT], **kw)
        if LOAD_WEIGHTS in ways and init_info.delta is not None:
            # a patch needs the previous version: a kept copy, whole tensors to load_weights
            self._mirror, layout = load_weights_mirror(reload, self.device) if reload else ({}, None)
            self._reload = Refitter(None, self._mirror or None, dst_layout=layout,
                                    name_map=maps[LOAD_WEIGHTS], **kw)
        elif LOAD_WEIGHTS in ways:
            # staged: one bucket holding every tensor until the commit (the staging area)
            self._sink = load_weights_sink(
                self._hold if self._staged else self._load_bucket, reload,
                bucket_bytes=_ALL_AT_ONCE if self._staged else init_info.bucket_bytes,
                device=self.device) if reload else None
            # staged, the version is stamped at the commit (on the direct Refitter's tensors)
            self._reload = Refitter(None, (nn.Module() if self._staged else self.model)
                                    if reload else None, dst_layout=self._sink,
                                    name_map=maps[LOAD_WEIGHTS], **kw)
        counts = {w: sum(r.way == w for r in self.routes.values()) for w in (DIRECT, LOAD_WEIGHTS)}
        _log.info("torchrefit: engine rank %d: %d tensors written in place, %d through "
                  "load_weights", self._conn.rank, counts[DIRECT], counts[LOAD_WEIGHTS])
        for name, route in self.routes.items():
            _log.debug("torchrefit: %s: %s (%s)", name, route.way, route.why)

    def _name_map(self, source_map: dict[str, Any] | None) -> NameMap:
        """The trainer's map, rebuilt: vLLM's part from this engine's config, the
        trainer's part from its description."""
        return compose(hf_to_vllm(self.model_config.hf_text_config),
                       source_map_from(source_map))

    def _destinations(self, name_map, source, tp_rank, tp_size, heads):
        """This worker's direct tensors ``{name: live tensor}`` and what its sink wants
        ``[(source name, shape, dtype)]`` for the tensors routed through load_weights."""
        direct = {n: t for n, t in named_refit_tensors(self.model)
                  if n in self.routes and self.routes[n].way == DIRECT}
        later = [n for n, r in self.routes.items() if r.way == LOAD_WEIGHTS]
        metas = _loaded_shapes(self.model, later)
        specs = vllm_tp_specs(metas, tp_rank, tp_size, num_heads=heads[0], num_kv_heads=heads[1])
        shapes = {n: (specs[n].global_shape if n in specs else tuple(m.shape))
                  for n, m in metas.items()}
        wanted = sink_tensors(name_map, shapes, source)
        return direct, [(n, shape, getattr(torch, dtype)) for n, shape, dtype in wanted]

    # -- update: start, receive, apply
    def start_weight_update(self) -> None:
        if (self._sink is not None or self._mirror) and not self._staged:  # tensors routed through load_weights
            open_reload(self.model)
            self._reloading = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        info = self.parse_update_info(update_info)
        if self._staged:  # stage in the background; the engine keeps serving version v
            if self._pending is not None:
                raise RuntimeError("torchrefit: update_weights while the previous update is "
                                   "still staged: call finish_weight_update first")
            if self._stager is None:
                self._stager = ThreadPoolExecutor(1, thread_name_prefix="torchrefit-vllm-stage")
            self._pending = self._stager.submit(self.stage_weights, info)
            return
        self.receive_weights(info)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def stage_weights(self, update_info: TorchrefitUpdateInfo) -> None:
        """Stage (on the worker's stage thread): every byte of the update into staging,
        nothing live written; every rank then learns whether any failed."""
        self._held = None
        error = None
        try:
            if self._direct is not None:
                self._direct.stage()
            if self._reload is not None:
                self._reload.refit()  # into the held buffer: load_weights runs at the commit
                if self._mirror:
                    self._held = list(self._mirror.items())
        except Exception as e:
            error = failure(e, f"engine rank {self._conn.rank} staging")
        agree_status(self._conn, error, f"vLLM weight update {update_info.update} (staging)",
                     applied=False)

    def _hold(self, pairs) -> None:
        """The staged sink's ``load_weights``: keep the one bucket for the commit."""
        self._held = list(pairs)

    def drain_pending(self) -> None:
        """Install a staged update (as ``finish_weight_update`` does before it returns)."""
        self._commit_staged()

    def _commit_staged(self) -> None:
        """Wait for the stage; if it completed on every rank, install it: the in-place
        twins into the live tensors, the held tensors through vLLM's layerwise reload. A
        stage that failed (already raised on every trainer rank) installs nothing."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except RefitError as e:
            self.last_stage_error = f"{type(e).__name__}: {e}"
            _log.warning("torchrefit: the staged update failed; nothing committed", exc_info=True)
            return
        self.last_stage_error = None
        if self._direct is not None:
            self._direct.commit()
        held, self._held = self._held, None
        if held:
            open_reload(self.model)
            self._reloading = True
            self._load_error = None
            self._load_bucket(held)
            if self._load_error is not None:
                self._abandon()
                raise RefitError(f"committing the staged update: {self._load_error[1].splitlines()[0]}",
                                 rule="update failed", detail=self._load_error[1])

    def receive_weights(self, update_info: TorchrefitUpdateInfo) -> None:
        """Receive: every refit of this update runs; tensors routed through load_weights
        reach the model bucket by bucket. Every rank then learns whether any failed."""
        if self._conn is None:
            raise RuntimeError("torchrefit: init_weight_transfer_engine was not called")
        self._load_error = None
        error = None
        try:
            for refitter in (self._direct, self._reload):
                if refitter is not None:
                    refitter.refit()
            if self._mirror:  # patched in place: whole tensors to load_weights (it copies them)
                self._load_bucket(list(self._mirror.items()))
        except Exception as e:
            error = failure(e, f"engine rank {self._conn.rank} receiving")
        error = error or self._load_error
        if error is not None:
            self._abandon()
        agree_status(self._conn, error, f"vLLM weight update {update_info.update}")

    def _load_bucket(self, pairs) -> None:
        """The sink's ``load_weights``: one bucket into vLLM's loaders. An exception is
        kept (reported to every rank when the update ends), not raised mid-exchange,
        which would leave the trainer's ranks waiting for this one."""
        if self._load_error is not None:
            return
        try:
            # copies: the sink's next bucket overwrites this one's buffer
            load_whole(self.model, [(n, t.clone()) for n, t in pairs])
        except Exception as e:
            self._load_error = failure(e, f"engine rank {self._conn.rank}: vLLM's load_weights "
                                          f"({', '.join(n for n, _ in pairs[:3])}...)")

    def _abandon(self) -> None:
        """After a failed update: close vLLM's layerwise reload (layers that received
        nothing get their previous tensors back)."""
        if self._reloading:
            self._reloading = False
            try:
                self._apply()
            except Exception:
                _log.exception("torchrefit: closing vLLM's layerwise reload after a failure")

    def finish_weight_update(self) -> None:
        """Apply: vLLM's post-load steps for what went through load_weights (staged: the
        commit first)."""
        if self._staged:
            self._commit_staged()
        if self._reloading:
            self._reloading = False
            self._apply()

    def _apply(self) -> None:
        close_reload(self.model, self.model_config)

    def _release(self) -> None:
        """Drop the link to a trainer and what was planned over it: an update left open
        is closed first (vLLM's layerwise reload), so the live model is whole."""
        self._abandon()
        self._direct = self._reload = self._sink = None
        self._mirror = {}
        self._pending = self._held = None  # a stage over the old link: never committed
        self.routes = {}
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # a link whose peer died: nothing left to close cleanly
                _log.warning("torchrefit: closing the previous trainer link", exc_info=True)
            self._conn = self._store = None

    def shutdown(self) -> None:
        self._release()


# ------------------------------------------------- vLLM's reload, as a fresh load runs it
def open_reload(model: nn.Module) -> None:
    """Open vLLM's layerwise reload of a live ``model``: each layer then takes what
    ``load_whole`` gives it and is rebuilt once complete; layers given nothing keep
    their tensors when it is closed."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def load_whole(model: nn.Module, pairs) -> None:
    """``(name, tensor)`` pairs, whole tensors named as vLLM's ``load_weights`` takes them,
    into ``model``'s loaders inside an open reload (a model with MTP layers takes them
    without its completeness check). The reload keeps each tensor until its layer is
    complete: give it tensors nothing else writes meanwhile (copies)."""
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    with disable_mtp_completeness_check():
        model.load_weights(pairs)


def close_reload(model: nn.Module, model_config) -> None:
    """Close vLLM's layerwise reload (vLLM's post-load steps for each layer it rebuilt),
    then the steps it leaves out (``repack_after_reload``)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)
    repack_after_reload(model)


def repack_after_reload(model: nn.Module) -> None:
    """vLLM's post-load steps that its layerwise reload leaves out, so that the model
    computes as a fresh load of the same weights would (vLLM CPU):

    * a layer sharing its weight with another (a tied ``lm_head``) loads nothing
      itself, so reload never re-packs it: its kernel kept the old matrix;
    * a MoE layer's reload runs the update path of its method, which skips the CPU
      kernel's prepacking of the experts.
    """
    owners: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        w = m._parameters.get("weight") if hasattr(m, "_parameters") else None
        if w is not None:
            owners.setdefault(id(w), []).append(m)
    for shared in owners.values():
        for m in shared[1:]:
            method = getattr(m, "quant_method", None)
            if method is not None and getattr(m, "cpu_linear", None) is not None:
                method.process_weights_after_loading(m)
    for m in model.modules():
        kernel = getattr(getattr(m, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(m, "w13_weight") and _on_cpu(m.w13_weight):
            experts.process_weights_after_loading(m)


# ------------------------------------------------------------------- trainer side
class TorchrefitTrainerWeightTransferEngine(
        TrainerWeightTransferEngine[TorchrefitTrainerInitInfo]):
    """Trainer-side engine for backend ``"torchrefit"``, on every trainer rank.

    ``routes`` (after init): engine rank 0's ``{vLLM name: Route}``. ``reports``: this
    rank's :class:`~torchrefit.RefitReport` of each refit of the last update (its bytes
    sent are its own shards only).
    """

    init_info_cls = TorchrefitTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.routes: dict[str, Route] = {}
        self._conn = self._store = None
        self._refitters: list[Refitter] = []
        self._ways: list[str] = []  # the route each Refitter serves
        self._staged = False
        self._stage_failed: BaseException | None = None  # the last stage_weights' error
        self.reports: list = []
        self._updates = 0
        self._rpc = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrefit-rpc")

    @classmethod
    def trainer_init(cls, init_info: TorchrefitTrainerInitInfo, *, client, source=None):
        model = _module(source)
        world = dist.get_world_size() if dist.is_initialized() else 1
        engine = cls(client=client, source=source, is_sender=init_info.rank == 0)
        name_map = init_info.name_map or hf_to_vllm(getattr(model, "config", None))
        source_map = describe_source(name_map)  # what the engine rebuilds the map from
        meta = _global_tensors(model)
        pending: Future | None = None
        if engine.is_sender:
            worker = TorchrefitInitInfo(
                init_info.master_address, init_info.master_port, world, source_map,
                list(init_info.skip), init_info.cast, init_info.group_backend,
                init_info.timeout, init_info.bucket_bytes, init_info.serve_while_staging, init_info.delta)
            pending = engine._rpc.submit(client.init_weight_transfer_engine, asdict(worker))
        try:
            engine._connect(init_info, world, name_map, meta, model)
        except BaseException:
            if pending is not None:  # the engine fails alike: let its RPC return
                wait([pending], timeout=init_info.timeout)
            engine._rpc.shutdown(wait=False)
            raise
        engine._raise_shared(engine._on_sender(pending.result) if pending else None,
                             "initializing the vLLM weight transfer")
        return engine

    def _connect(self, info, world, name_map, meta, model) -> None:
        self._conn, self._store = join("trainer", info.rank, world, info.master_address, info.master_port,
                          peer_world_size=None, backend=info.group_backend, timeout=info.timeout)
        terms = Terms(repr(name_map.cache_key()), tuple(info.skip), info.cast,
                      info.serve_while_staging, info.delta)
        self._staged = info.serve_while_staging
        seen = agree(self._conn, terms, meta)
        engines = [extra for role, _, _, extra in seen if role == "engine"]
        self.routes = {k: Route(*v) for k, v in engines[0].items()}
        ways = {way for extra in engines for way, _ in extra.values()}
        agree_status(self._conn, None, "planning the vLLM refit", applied=False)
        kw = dict(group=self._conn, skip=tuple(info.skip), cast=info.cast, timeout=info.timeout,
                  delta=info.delta)
        maps = route_maps(name_map)
        self._ways = [way for way in (DIRECT, LOAD_WEIGHTS) if way in ways]
        self._refitters = [Refitter(model, None, name_map=maps[way], **kw) for way in self._ways]

    def send_weights(self, weight_version: str | None = None) -> None:
        """One update, on every trainer rank: rank 0 starts it, runs the engine's
        ``update_weights`` while every rank sends, and finishes it with
        ``weight_version`` (what ``llm.get_weight_version()`` then reports). With
        ``serve_while_staging``: :meth:`stage_weights`, then :meth:`commit_weights`."""
        if self._staged:
            self.stage_weights()
            self.commit_weights(weight_version)
            return
        self._updates += 1
        started = self._on_sender(self.client.start_weight_update) if self.is_sender else None
        self._raise_shared(started, "starting the vLLM weight update")
        pending = (self._rpc.submit(self.client.update_weights,
                                    asdict(TorchrefitUpdateInfo(self._updates)))
                   if self.is_sender else None)
        error = None
        try:
            self.reports = [refitter.refit() for refitter in self._refitters]
        except Exception as e:
            error = failure(e, f"trainer rank {self._conn.rank} sending")
        try:
            agree_status(self._conn, error, f"vLLM weight update {self._updates}")
        except RefitError:
            if pending is not None:  # the engine raised the same error: let its RPC return
                wait([pending], timeout=self._conn.timeout)
            raise
        finished = None
        if pending is not None:  # the engine's own answer (its RPC may fail after the exchange)
            finished = (self._on_sender(_answer, pending, self._conn.timeout)
                        or self._on_sender(self.client.finish_weight_update, weight_version))
        self._raise_shared(finished, "finishing the vLLM weight update")

    def stage_weights(self) -> None:
        """``serve_while_staging``, every trainer rank: rank 0 starts the update and calls
        the engine's ``update_weights`` (which starts a stage and returns: the engine
        keeps serving its current version), then every rank sends. Returns once every
        byte is in the engine's staging; the engine installs it at :meth:`commit_weights`.
        A failure raises on every rank with nothing installed (the engine's update is
        closed, its version unchanged)."""
        if not self._staged:
            raise RefitError("stage_weights(): pass TorchrefitTrainerInitInfo("
                             "serve_while_staging=True) at init (the engine agreed on it then)")
        self._updates += 1
        self._stage_failed = None
        started = self._on_sender(self.client.start_weight_update) if self.is_sender else None
        self._raise_shared(started, "starting the vLLM weight update")
        queued = (self._on_sender(self.client.update_weights,
                                  asdict(TorchrefitUpdateInfo(self._updates)))
                  if self.is_sender else None)
        self._raise_shared(queued, "starting the staged vLLM weight update")
        error = None
        try:
            self.reports = [r.stage() if way == DIRECT else r.refit()
                            for way, r in zip(self._ways, self._refitters)]
        except Exception as e:
            error = failure(e, f"trainer rank {self._conn.rank} sending")
        try:
            agree_status(self._conn, error, f"vLLM weight update {self._updates} (staging)",
                         applied=False)
        except RefitError as e:
            self._stage_failed = e
            if self.is_sender:  # close the engine's update, version unchanged
                self._on_sender(self.client.finish_weight_update, None)
            raise

    def commit_weights(self, weight_version: str | None = None) -> None:
        """After :meth:`stage_weights`, every trainer rank: rank 0 calls the engine's
        ``finish_weight_update``, which installs the staged update (the engine's only
        stall: pause and resume it around this call, if it must not generate meanwhile)
        and then reports ``weight_version``. Refused after a :meth:`stage_weights` that
        failed: the engine installed nothing, and must not report ``weight_version``."""
        if self._stage_failed is not None:
            raise RefitError(f"commit_weights({weight_version!r}): nothing staged to commit, the "
                             f"last stage_weights() failed ({self._stage_failed}); the engine "
                             "keeps its version", rule="nothing staged")
        finished = (self._on_sender(self.client.finish_weight_update, weight_version)
                    if self.is_sender else None)
        self._raise_shared(finished, "committing the staged vLLM weight update")

    @staticmethod
    def _on_sender(call, *args) -> tuple[str, str] | None:
        try:
            call(*args)
            return None
        except Exception as e:
            return failure(e, "trainer rank 0's client")

    def _raise_shared(self, error: tuple[str, str] | None, what: str) -> None:
        """Rank 0's client call, told to every trainer rank (its default group)."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            raise RefitError(f"{what} failed on the engine (seen by trainer rank 0's client): "
                             f"{error[1].splitlines()[0]}; this trainer's model is unchanged",
                             rule="update failed", detail=error[1])

    def shutdown(self) -> None:
        self._rpc.shutdown(wait=False)
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _global_tensors(model: nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
    """This trainer rank's global tensors, ``{global name: (global shape, dtype)}``, as its
    layout reads them (FSDP2 / DTensor, Megatron-core's TP shards, pipeline stages and
    expert ranks): the engine plans its ``load_weights`` tensors from every rank's."""
    return {t.name: (tuple(t.global_shape), t.dtype) for _, t in describe(model).layout}


def _answer(pending: Future, timeout: float) -> None:
    """The engine's ``update_weights`` RPC, once every rank has finished the exchange: it
    has nothing left to wait for, so an engine that died after the exchange (its worker
    done, its server gone) is told by a timeout, not a hang."""
    try:
        pending.result(timeout=timeout)
    except TimeoutError as e:
        raise TimeoutError(f"the engine's update_weights did not answer within {timeout:g} s "
                           "of the exchange's end (did the engine die?)") from e


def _module(source) -> nn.Module:
    if isinstance(source, nn.Module):
        return source
    if isinstance(source, ModuleSource):
        return source._module
    raise TypeError("torchrefit's vLLM backend reads the trainer's model itself: pass "
                    f"source=ModuleSource(model) or the nn.Module, not {type(source).__name__}")


register()
