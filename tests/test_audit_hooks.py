"""A process with a Python audit hook (``torchrefit._util.identity``).

``id()`` raises the audit event ``builtins.id``, which every audit hook in the process
runs on: filelock 4 installs one on Python >= 3.12, and megatron-core imports filelock.
Building a Refitter and refitting must then not call ``id()`` per tensor or per
module (tens of thousands of calls for a qwen3-shaped megatron-core pair). Two gloo processes
install a hook that counts the event (in the spawned workers, since a hook cannot be
removed), build a TP2 trainer of tied embeddings and many experts into a TP1 engine,
refit twice (the second through ``watch="every"``'s checks) and check the engine
against the oracle.
"""

from __future__ import annotations

import sys

import torch

import torchrefit as tr
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local, run_world

SPEC = ModelSpec(layers=2, experts=64, expert_ffn=8, tie=True)
SRC, DST = Mesh(2, ranks=2), Mesh(1, ranks=2)


def _count_ids(rank: int, world: int) -> tuple[int, int, list[str]]:
    src = build_toy(SPEC, SRC, rank, seed=1)
    dst = build_toy(SPEC, DST, rank, seed=2)
    events = [0]

    def hook(event: str, _args) -> None:
        if event == "builtins.id":
            events[0] += 1

    sys.addaudithook(hook)
    r = tr.Refitter(src, dst)
    r.refit()
    r.refit()
    r.rebind()
    counted = events[0]
    want = expected_local(SPEC, DST, rank, 1)
    wrong = sorted(k for k, v in dst.state_dict().items() if not torch.equal(v, want[k]))
    tensors = sum(1 for _ in src.parameters()) + sum(1 for _ in dst.parameters())
    r.close()
    return counted, tensors, wrong


def test_refitter_calls_id_a_bounded_number_of_times():
    for rank, (counted, tensors, wrong) in enumerate(run_world(_count_ids, 2)):
        assert not wrong, f"rank {rank}: wrong after refit: {wrong[:5]}"
        assert tensors > 300, tensors  # enough that a per-tensor id() stands out
        # a few per model or group (memo keys of whole models), never one per tensor
        assert counted < 64, f"rank {rank}: {counted} id() calls for {tensors} tensors"
