"""Inference-engine backends built on torchrefit.

Each submodule plugs torchrefit into one engine's own weight-transfer API and is
imported only where that engine is installed:

* :mod:`torchrefit.engines.vllm`: vLLM's weight-transfer backend ``"torchrefit"``
  (worker and trainer sides; registered through the ``vllm.general_plugins`` entry
  point and on import).
"""
