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

What a worker receives into is a *mirror*: a Hugging Face model of the engine's config
holding the weights the way the trainer names and shapes them (whole tensors, on the
host by default), so every edge of the fleet (trainer to engine, engine to engine, a
seed) is the same plan between Hugging Face models, whatever vLLM packs. Each version
that the fleet installs into the mirror is then put into vLLM the way a fresh load
would be, under ``replica.lock``: vLLM's layerwise reload, the model's ``load_weights``
over the mirror's tensors, vLLM's post-load steps (``engines/vllm.py``'s
``repack_after_reload``). The worker's ``execute_model`` holds the same lock, and keeps
it until ``sample_tokens`` where the step's logits wait for it, so no forward pass (nor
the logits it leaves for sampling) runs on half a version. An install that fails (in
``load_weights``) may leave vLLM's model holding layers of two versions: the worker
records the error (``fleet_state``) and leaves the fleet; its launcher restarts it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from ..fleet import Replica, join
from ..layout._described import named_refit_tensors
from .vllm import repack_after_reload

__all__ = ["FleetWorkerExtension", "EngineMember", "hf_mirror", "load_into_vllm"]

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


class EngineMember:
    """One vLLM worker's membership of a fleet: its mirror, its replica, its guard.

    ``replica``: the fleet's :class:`~torchrefit.fleet.Replica` of this worker rank.
    ``served``: the version vLLM's model holds (the replica's ``version`` is the
    mirror's, a moment earlier). ``error``: why the last install failed, else ``""``
    (the worker then leaves the fleet: a launcher restarts the engine).
    """

    def __init__(self, worker, address: str, port: int, *, name: str, secret: str | None,
                 secret_file: str | None, timeout: float, device: str) -> None:
        from vllm.distributed.parallel_state import get_world_group

        self.worker = worker
        self.model = worker.model_runner.get_model()
        self.model_config = worker.model_config
        self.mirror = hf_mirror(self.model_config.hf_config, self.model_config.dtype, device,
                                self.model_config.trust_remote_code)
        self.served, self.error = 0, ""
        self._stepping = False  # execute_model left this step's logits for sample_tokens
        group = get_world_group()
        self.replica: Replica = join(self.mirror, group.rank_in_group, group.world_size, address, port,
                                     name=name, secret=secret, secret_file=secret_file, staged=True,
                                     timeout=timeout, on_version=self.install)
        self._guard()

    # -- the version install (the fleet's thread)
    def install(self, version: int) -> None:
        """Put the mirror's version into vLLM's model as a fresh load would, while no step
        runs (the lock). A failure leaves the fleet (raised on the fleet's thread)."""
        with self.replica.lock:
            try:
                load_into_vllm(self.model, self.model_config, self.mirror)
            except Exception as e:
                self.error = f"installing version {version}: {type(e).__name__}: {e}"
                _log.exception("torchrefit: %s", self.error)
                raise
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
        return {"name": r.name, "rank": r.rank, "version": r.version, "served": self.served,
                "ready": r.ready.is_set(), "dropped": r.dropped, "error": self.error,
                "pid": os.getpid()}

    def close(self) -> None:
        self.replica.close()
        self.worker.execute_model, self.worker.sample_tokens = self._unguarded


def load_into_vllm(model: nn.Module, model_config, mirror: nn.Module) -> None:
    """Every tensor of ``mirror`` (Hugging Face names, whole) into a live vLLM ``model``
    through vLLM's layerwise reload and ``load_weights``, then vLLM's post-load steps: the
    packed and post-processed copies come out as a fresh load of the same weights makes
    them. The caller holds the lock that keeps the engine's steps out."""
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    cuda = torch.cuda.is_available()
    if cuda:  # a step launched before the lock was taken may still read the weights
        torch.cuda.synchronize()
    initialize_layerwise_reload(model)
    try:
        with torch.no_grad(), disable_mtp_completeness_check():
            # copies: the reload keeps what it is given until a layer is complete
            model.load_weights((n, t.clone()) for n, t in named_refit_tensors(mirror))
    finally:  # a failed load is closed too (layers that got nothing keep their tensors)
        finalize_layerwise_reload(model, model_config)
        repack_after_reload(model)
    if cuda:
        torch.cuda.synchronize()


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

