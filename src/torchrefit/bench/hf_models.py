"""Hugging Face-named destinations for ``torchrefit bench --map hf [--fp8]``.

Each rank builds the whole engine a Megatron-style toy trainer maps onto through
``tr.maps.megatron_to_hf``: split ``q_proj`` / ``k_proj`` / ``v_proj`` and
``gate_proj`` / ``up_proj``, ``transformers`` 5 stacked experts, renamed norms and
embeddings. With ``fp8`` every projection and stacked expert tensor is
``float8_e4m3fn`` with a float32 ``_scale_inv`` grid of ``block`` blocks; the rest
keeps the trainer's dtype.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..maps.megatron_hf import _readers
from ..testing.toy import ModelSpec, global_table

__all__ = ["hf_destination_shapes", "build_hf_destination"]

_FUSED = re.compile(r"\.(qkv_proj|gate_up_proj)\.|\.experts\.\d+\.")
_FP8 = re.compile(r"_proj\.weight$|\.experts\.(gate_up_proj|down_proj)$")


def hf_destination_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> global shape of every tensor the engine holds."""
    heads, groups, d = spec.heads, spec.groups, spec.head_dim
    out: dict[str, tuple[int, ...]] = {}
    for name, t in global_table(spec).items():
        if not t.persistent:
            continue
        for hf, expert in _readers(name):
            if _FUSED.search(hf) or hf in out:
                continue
            shape = tuple(t.shape)
            if hf.endswith(("q_proj.weight", "q_proj.bias")):
                shape = (heads * d,) + shape[1:]
            elif re.search(r"[kv]_proj\.(weight|bias)$", hf):
                shape = (groups * d,) + shape[1:]
            elif re.search(r"(gate|up)_proj\.(weight|bias)$", hf):
                shape = (shape[0] // 2,) + shape[1:]
            elif expert is not None:
                shape = (spec.experts,) + shape
            out[hf] = shape
    if "lm_head.weight" not in out and not spec.tie:
        raise AssertionError("the toy's output layer has no Hugging Face name")
    return out


def build_hf_destination(spec: ModelSpec, device: torch.device, *, fp8: bool,
                         block: tuple[int, int]) -> nn.Module:
    """The engine on this rank (random values, not the trainer's)."""
    root = nn.Module()
    for name, shape in hf_destination_shapes(spec).items():
        quantized = fp8 and len(shape) >= 2 and _FP8.search(name) is not None
        dtype = torch.float8_e4m3fn if quantized else spec.dtype
        _register(root, name, torch.empty(shape, device=device).normal_().to(dtype))
        if quantized:
            grid = shape[:-2] + (-(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
            _register(root, name + "_scale_inv", torch.ones(grid, device=device))
    return root


def _register(root: nn.Module, name: str, t: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    mod.register_parameter(leaf, nn.Parameter(t, requires_grad=False))
