"""Transforms applied to what a refit moves: FP8 quantization of destinations (``fp8``,
its CUDA kernel ``execute.kernels.fp8_blocks``).

Dtype casts need no module of their own: the planner puts the narrower dtype on the
wire and the executor's pack (sender) or unpack (receiver) copies convert.
"""

from .fp8 import FP8_DTYPES, check_targets, fp8_targets, quantize_blocks, quantize_tensor

__all__ = ["FP8_DTYPES", "check_targets", "fp8_targets", "quantize_blocks", "quantize_tensor"]
