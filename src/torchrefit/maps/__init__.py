"""Name maps: how destination global tensors are made of source global tensors.

Pass one as ``name_map=`` to :class:`torchrefit.Refitter`. The default,
:class:`Identity`, takes each destination tensor from the source tensor of the same
name (or the tensor that name aliases, e.g. a tied output layer). :class:`Rename`
is a flat table with ``{}`` layer templates; :class:`Compose` chains two maps.
Framework maps: :func:`megatron_to_hf` / :func:`hf_to_megatron` (Megatron-core and
Hugging Face names, fused tensors split as row blocks so that no rank gathers a
full tensor), :func:`hf_to_vllm` / :func:`megatron_to_vllm` (vLLM's fused and
stacked tensors), :func:`torchtitan_to_hf` / :func:`torchtitan_to_vllm` (torchtitan's
Llama 3, Qwen 3 and DeepSeek V3 names). Subclass :class:`NameMap` (implement
``source_name`` or ``segments``) for anything else.

The interface lives in :mod:`.base`; each framework's map in a module of its own
that imports :mod:`.base` (and the maps it builds on), never this package.
"""

from .base import Compose, Identity, NameMap, Rename, Segment, relocate
from .hf_vllm import VLLM_FROM_HF, HfToVllm, hf_to_vllm, megatron_to_vllm
from .megatron_hf import (
                          HF_FROM_MEGATRON,
                          HfToMegatron,
                          MegatronToHF,
                          hf_to_megatron,
                          megatron_to_hf,
)
from .torchtitan import HF_FROM_TORCHTITAN, TorchtitanToHF, torchtitan_to_hf, torchtitan_to_vllm

__all__ = [
    "Segment", "NameMap", "Identity", "Rename", "Compose", "relocate",
    "MegatronToHF", "HfToMegatron", "megatron_to_hf", "hf_to_megatron", "HF_FROM_MEGATRON",
    "HfToVllm", "hf_to_vllm", "megatron_to_vllm", "VLLM_FROM_HF",
    "TorchtitanToHF", "torchtitan_to_hf", "torchtitan_to_vllm", "HF_FROM_TORCHTITAN",
]
