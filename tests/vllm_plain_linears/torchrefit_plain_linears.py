"""A vLLM plugin for the tests: vLLM CPU keeps its linear weights as plain parameters.

vLLM's CPU build packs every linear weight into a kernel handle at load and leaves the
layer's ``weight`` an empty parameter; its GPU build computes from the parameter
itself. With this directory on ``PYTHONPATH`` (its ``.dist-info`` declares the
``vllm.general_plugins`` entry point, loaded in every vLLM process), the CPU build does
as the GPU build: ``layer.cpu_linear`` is ``torch.nn.functional.linear`` on the live
weight, so torchrefit's backend writes those weights in place.
"""

import torch


def _plain(layer: torch.nn.Module, remove_weight: bool) -> None:
    layer.cpu_linear = torch.nn.functional.linear


def keep_linear_weights() -> None:
    from vllm.model_executor.layers import utils

    utils.dispatch_cpu_unquantized_gemm = _plain
