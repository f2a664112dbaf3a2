"""vLLM engines as fleet replicas: each engine's workers join a ``tr.Fleet`` through
vLLM's own API (docs/fleet.md, "vLLM engines in a fleet").

A launcher starts each engine with this module's worker extension and then tells its
workers to join::

    llm = LLM(model, ..., worker_extension_cls="torchrefit.engines.vllm_fleet.FleetWorkerExtension")
    llm.collective_rpc("join_fleet", kwargs=dict(address="trainer-0", port="29700",
                                                 secret_file="/run/secrets/fleet", name="rollout"))

(``vllm serve --worker-extension-cls ...`` and its ``/collective_rpc`` route take the same
call, string arguments.) Every worker rank then joins the fleet as one rank of a replica
(:func:`torchrefit.fleet.join`, ``staged=True``) and the engine serves as usual.

What a worker receives into is a *mirror*: the weights the way the trainer names and
shapes them (Hugging Face names, on the host by default), cut as vLLM's tensor
parallelism cuts them: a TP1 worker holds a Hugging Face model of the engine's config
(whole tensors), a worker of a TP engine the shard of each tensor its rank holds in vLLM
(``vllm_tp_shards``; the vocabulary's rows as vLLM's padded cut gives them), described
with an explicit layout, so the fleet sends each rank its shard only. Every edge of the
fleet (trainer to engine, engine to engine, a seed) is then a plan between two such
layouts, whatever vLLM packs. Each version that the fleet installs into the mirror is
then put into vLLM the way a fresh load would be, under ``replica.lock`` (taken on every
rank of the engine at one moment: ``hold_every_rank``): vLLM's
layerwise reload, the model's ``load_weights`` over the mirror's tensors (a shard given
as a whole-shaped tensor holding it, of which vLLM's loaders read the rank's own part),
vLLM's post-load steps (``engines/vllm.py``'s ``close_reload``). The worker's
``execute_model`` holds the same lock, and keeps it until ``sample_tokens`` where the
step's logits wait for it, so no forward pass (nor the logits it leaves for sampling)
runs on half a version. An install that fails (in ``load_weights``) may leave vLLM's
model holding layers of two versions: the worker records the error (``fleet_state``) and
leaves the fleet; its launcher restarts it.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .. import settings
from ..fleet import Replica, join
from ..layout._described import named_refit_tensors
from ..layout._types import Box, Piece
from ..layout.explicit import Explicit, TensorSpec
from ..layout.vllm_tp import local_shape, vllm_tp_shards
from .vllm import close_reload, load_whole, open_reload

__all__ = ["FleetWorkerExtension", "EngineMember", "hf_mirror", "tp_mirror", "hold_every_rank",
           "load_into_vllm"]

Mirror = nn.Module | dict[str, torch.Tensor]

_log = logging.getLogger(__name__)


def hf_mirror(hf_config, dtype: torch.dtype, device: torch.device | str = "cpu",
              trust_remote_code: bool = False) -> nn.Module:
    """A Hugging Face causal LM of ``hf_config`` with uninitialized ``dtype`` weights on
    ``device``: what a trainer of the same model describes, tensor for tensor (tied
    weights included), so the fleet plans it as it plans the trainer."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype,
                                                 trust_remote_code=trust_remote_code)
    return model.to_empty(device=device).eval()


def tp_mirror(hf_config, dtype: torch.dtype, model: nn.Module, tp_rank: int, tp_size: int,
              device: torch.device | str = "cpu", trust_remote_code: bool = False
              ) -> tuple[dict[str, torch.Tensor], dict[str, TensorSpec]]:
    """A TP rank's mirror: ``{Hugging Face name: uninitialized shard}`` and the
    ``TensorSpec`` of each tensor cut (the others whole), as vLLM's tensor parallelism
    cuts the live ``model`` on rank ``tp_rank`` of ``tp_size``."""
    whole = dict(named_refit_tensors(hf_mirror(hf_config, dtype, "meta", trust_remote_code)))
    text = hf_config.get_text_config()  # a multimodal config: its language model's
    heads = text.num_attention_heads
    specs = vllm_tp_shards({n: tuple(t.shape) for n, t in whole.items()}, tp_rank, tp_size,
                           num_heads=heads, num_kv_heads=getattr(text, "num_key_value_heads", heads))
    specs.update(_vocab_rows(whole, model))
    mirror = {n: torch.empty(local_shape(specs[n]) if n in specs else t.shape, dtype=t.dtype,
                             device=device) for n, t in whole.items()}
    return mirror, specs


def _vocab_rows(whole: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, TensorSpec]:
    """The vocabulary's tensors as vLLM cuts them: it pads the vocabulary before cutting it,
    so a rank's rows are its module's ``shard_indices``, not an even share."""
    modules = dict(model.named_modules())
    specs = {}
    for name, t in whole.items():
        rows = getattr(modules.get(name.rpartition(".")[0]), "shard_indices", None)
        if rows is None:
            continue
        start, end = rows.org_vocab_start_index, rows.org_vocab_end_index
        zeros = (0,) * (t.dim() - 1)
        box = Box((start, *zeros), (end - start, *t.shape[1:]))
        specs[name] = TensorSpec(name, tuple(t.shape), (Piece(box, (0, *zeros)),))
    return specs


class EngineMember:
    """One vLLM worker's membership of a fleet: its mirror, its replica, its guard.

    ``replica``: the fleet's :class:`~torchrefit.fleet.Replica` of this worker rank (its
    rank in vLLM's world group: TP x PP ranks make one replica). ``mirror`` / ``specs``:
    what it receives into (``specs``: the shards it holds, empty at TP1). ``served``:
    the version vLLM's model holds (the replica's ``version`` is the mirror's, a moment
    earlier). ``error``: why the last install failed, else ``""`` (the worker then leaves
    the fleet: a launcher restarts the engine).
    """

    def __init__(self, worker, address: str, port: int, *, name: str, secret: str | None,
                 secret_file: str | None, timeout: float, device: str) -> None:
        from vllm.distributed.parallel_state import get_tp_group, get_world_group

        self.worker = worker
        self.model = worker.model_runner.get_model()
        self.model_config = worker.model_config
        tp, world = get_tp_group(), get_world_group()
        self.tp = (tp.rank_in_group, tp.world_size)
        self.mirror: Mirror
        self.specs: dict[str, TensorSpec] = {}
        if tp.world_size == 1:
            self.mirror = hf_mirror(self.model_config.hf_config, self.model_config.dtype, device,
                                    self.model_config.trust_remote_code)
        else:
            self.mirror, self.specs = tp_mirror(self.model_config.hf_config, self.model_config.dtype,
                                                self.model, *self.tp, device,
                                                self.model_config.trust_remote_code)
        self.served, self.error = 0, ""
        self._held = ""  # the store word of the last install's pause (its keys go at the next one)
        self._stepping = False  # execute_model left this step's logits for sample_tokens
        args = {"dst_layout": Explicit(self.specs)} if self.specs else None
        self.replica: Replica = join(self.mirror, world.rank_in_group, world.world_size, address, port,
                                     name=name, secret=secret, secret_file=secret_file, staged=True,
                                     timeout=timeout, on_version=self.install, refitter_args=args)
        self._guard()

    # -- the version install (the fleet's thread)
    def install(self, version: int) -> None:
        """Put the mirror's version into vLLM's model as a fresh load would, while no step
        runs on any rank of the engine (every rank's lock at once: ``hold_every_rank``). A
        failure leaves the fleet (raised on the fleet's thread)."""
        r = self.replica
        try:
            self._held = hold_every_rank(r.lock, r.board, f"vllm-install/{r.name}/{version}", r.world, r.timeout,
                                         previous=self._held)
        except TimeoutError as e:
            self.error = f"installing version {version}: {e}"
            _log.error("torchrefit: %s", self.error)
            raise
        try:
            load_into_vllm(self.model, self.model_config, self.mirror, self.specs)
        except Exception as e:
            self.error = f"installing version {version}: {type(e).__name__}: {e}"
            _log.exception("torchrefit: %s", self.error)
            raise
        finally:
            r.lock.release()
        self.served = version

    # -- the engine's steps (the worker's own thread)
    def _guard(self) -> None:
        """Hold the replica's lock from each ``execute_model`` until its logits are used
        (``sample_tokens``, where vLLM defers sampling), so an install waits for the step."""
        worker, lock = self.worker, self.replica.lock
        execute, sample = worker.execute_model, worker.sample_tokens

        def execute_model(*args, **kwargs):
            if not self._stepping:  # (held already where a step's sampling never came: not twice)
                lock.acquire()
            try:
                out = execute(*args, **kwargs)
            except BaseException:
                self._stepping = False
                lock.release()
                raise
            self._stepping = out is None and getattr(worker.model_runner, "execute_model_state", None) is not None
            if not self._stepping:  # else released by sample_tokens, once the logits are used
                lock.release()
            return out

        def sample_tokens(*args, **kwargs):
            try:
                return sample(*args, **kwargs)
            finally:
                if self._stepping:
                    self._stepping = False
                    lock.release()

        self._unguarded = (execute, sample)
        worker.execute_model, worker.sample_tokens = execute_model, sample_tokens

    def state(self) -> dict[str, Any]:
        r = self.replica
        return {"name": r.name, "rank": r.rank, "world": r.world, "tp": list(self.tp),
                "version": r.version, "served": self.served, "ready": r.ready.is_set(),
                "dropped": r.dropped, "error": self.error, "pid": os.getpid(),
                "mirror_bytes": sum(t.numel() * t.element_size()
                                    for _, t in named_refit_tensors(self.mirror))}

    def close(self) -> None:
        self.replica.close()
        self.worker.execute_model, self.worker.sample_tokens = self._unguarded


def hold_every_rank(lock: threading.Lock, board, key: str, world: int, timeout: float,
                    patience: float | None = None, previous: str = "") -> str:
    """Return holding ``lock`` at a moment when every one of the engine's ``world`` ranks
    holds its own (each rank calls it with the same ``key``; ``board``: the fleet's store).

    vLLM runs each step on all of its ranks at once, each under its rank's lock, and the
    ranks wait on one another inside it (tensor parallel collectives): a rank that
    installed alone could run a step with the new version against a peer still running it
    with the old one; a rank that held its lock waiting for the others could block the
    step a peer is finishing while holding its own. So each attempt takes the lock, counts
    itself, and the rank whose count makes ``world`` says yes; a rank not told within
    ``patience`` seconds (default: ``settings.pause_patience``) says no (the first
    word holds), and on no every rank lets go and tries again. Raises ``TimeoutError``
    after ``timeout`` seconds (a rank gone).

    Returns the word of the attempt that held; pass it as ``previous`` to the engine's
    next hold, whose deciding rank deletes that attempt's keys and those of its own failed
    attempts: every rank has read them by then (each rank goes through the attempts in
    order, and the decider's count includes them all), so the store keeps two keys per
    engine, not two per attempt."""
    if patience is None:
        patience = settings.current().pause_patience
    if world == 1:
        lock.acquire()
        return ""
    until = time.monotonic() + timeout
    for attempt in itertools.count():
        lock.acquire()
        word = f"{key}/{attempt}"
        decides = board.add(f"{word}/held", 1) == world
        if decides:
            board.put_once(f"{word}/all", True)
        told = None
        wait_until = time.monotonic() + patience
        while told is None and time.monotonic() < wait_until:  # (store waits that time out warn)
            told = board.get(f"{word}/all")
            if told is None:
                time.sleep(0.002)
        waited = told is None
        if waited:
            told = board.put_once(f"{word}/all", False)
        if told:
            if decides:
                for done in ([previous] if previous else []) + [f"{key}/{a}" for a in range(attempt)]:
                    board.delete(f"{done}/held")
                    board.delete(f"{done}/all")
            return word
        lock.release()
        if time.monotonic() > until:
            raise TimeoutError(f"not every one of the engine's {world} ranks could pause its steps "
                               f"within {timeout:g} s")
        if waited:  # (an attempt the others had already given up: on to the next at once)
            time.sleep(random.uniform(0, patience))


def load_into_vllm(model: nn.Module, model_config, mirror: Mirror,
                   specs: Mapping[str, TensorSpec] | None = None) -> None:
    """Every tensor of ``mirror`` (Hugging Face names; the shards ``specs`` names, whole
    where absent) into a live vLLM ``model`` through vLLM's layerwise reload and
    ``load_weights``, then vLLM's post-load steps: the packed and post-processed copies
    come out as a fresh load of the same weights makes them. The caller holds the lock
    that keeps the engine's steps out."""
    cuda = torch.cuda.is_available()
    if cuda:  # a step launched before the lock was taken may still read the weights
        torch.cuda.synchronize()
    open_reload(model)
    try:
        with torch.no_grad():
            load_whole(model, _whole_copies(mirror, specs or {}))
    finally:  # a failed load is closed too (layers that got nothing keep their tensors)
        close_reload(model, model_config)
    if cuda:
        torch.cuda.synchronize()


def _whole_copies(mirror: Mirror, specs: Mapping[str, TensorSpec]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor as ``load_weights`` takes it, whole and a copy (the reload keeps it until
    its layer is complete): a shard is placed in a whole-shaped tensor, zeros elsewhere,
    of which vLLM's loaders read the rank's own part."""
    for name, t in named_refit_tensors(mirror):
        spec = specs.get(name)
        if spec is None:
            yield name, t.clone()
            continue
        whole = t.new_zeros(spec.global_shape)
        for p in spec.pieces:
            whole[p.box.slices()] = t[p.local_box.slices()]
        yield name, whole


class FleetWorkerExtension:
    """vLLM's ``worker_extension_cls`` for fleets: the methods a launcher calls on every
    worker through ``collective_rpc`` (arguments may be strings, as vLLM's HTTP route
    passes them)."""

    def join_fleet(self, address: str, port: int | str, name: str = "vllm", secret: str | None = None,
                   secret_file: str | None = None, timeout: float | str = 60.0,
                   device: str = "cpu") -> dict[str, Any]:
        """Join the fleet at ``address:port`` (every worker rank; returns once admitted,
        its first version, from a peer or the trainer, follows on the fleet's thread). ``device``: where the
        mirror and the fleet's staging copy live (host memory by default)."""
        if getattr(self, "_torchrefit_fleet", None) is not None:
            raise RuntimeError("join_fleet: this engine is already in a fleet (leave_fleet first)")
        self._torchrefit_fleet = EngineMember(self, address, int(port), name=name, secret=secret,
                                              secret_file=secret_file, timeout=float(timeout),
                                              device=device)
        return self._torchrefit_fleet.state()

    def fleet_state(self) -> dict[str, Any] | None:
        """This worker's replica: name, versions (``version`` in the mirror, ``served`` by
        vLLM), ready, why dropped, install error; None before ``join_fleet``."""
        member = getattr(self, "_torchrefit_fleet", None)
        return None if member is None else member.state()

    def leave_fleet(self) -> None:
        """Leave the fleet (it drops this replica as having left); the engine keeps serving
        the version it holds."""
        member = getattr(self, "_torchrefit_fleet", None)
        if member is not None:
            self._torchrefit_fleet = None
            member.close()

