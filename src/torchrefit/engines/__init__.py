"""Inference-engine backends built on torchrefit.

Each submodule plugs torchrefit into one engine's own weight-transfer API and is
imported only where that engine is installed:

* :mod:`torchrefit.engines.sglang`: an SGLang plugin (``sglang.srt.plugins`` entry point)
  and a trainer-side sender; every TP worker takes its shards in place.
* :mod:`torchrefit.engines.vllm`: vLLM's weight-transfer backend ``"torchrefit"``
  (worker and trainer sides; registered through the ``vllm.general_plugins`` entry
  point and on import).
* :mod:`torchrefit.engines.vllm_fleet`: vLLM engines as replicas of a ``tr.Fleet``
  (a worker extension whose ``join_fleet`` a launcher calls through ``collective_rpc``).
"""
