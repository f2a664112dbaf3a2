"""Decisions a refit makes only where tensors live on a GPU, checked on CPU as pure functions.

Covers how the message rounds stage a host transport's bytes (gloo from CUDA tensors:
pinned host pools, and the host ordered against the GPU stream before each send and
before a pool is reused; NCCL or CPU tensors: neither) and how ``Program.run`` orders a
refit on streams (a captured graph with nothing to exchange replays on the caller's
stream; no local copies: the exchange alone there; else the copies on side streams,
one for a graph, every lane otherwise), for every combination.
"""

from __future__ import annotations

import itertools

import torch

from torchrefit.execute.program import run_streams
from torchrefit.execute.rounds import host_synchronized, pinned_pools
from torchrefit.transport.gloo import GlooTransport
from torchrefit.transport.nccl import NcclTransport

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_gloo_from_cuda_stages_through_pinned_host_memory() -> None:
    assert pinned_pools(CPU, CUDA)  # gloo's wire is the host; the tensors are on a GPU
    assert not pinned_pools(CPU, CPU)  # CPU tensors: plain host memory
    assert not pinned_pools(CUDA, CUDA)  # NCCL's wire is the GPU


def test_host_staged_transports_order_the_host_against_the_gpu() -> None:
    assert GlooTransport.host_staged and not NcclTransport.host_staged
    assert host_synchronized(GlooTransport.host_staged, CUDA)
    assert not host_synchronized(GlooTransport.host_staged, CPU)
    assert not host_synchronized(NcclTransport.host_staged, CUDA)


def test_program_run_stream_choice() -> None:
    want = {
        # (exchanges, local copies, captured graph): (how, side streams)
        (False, True, True): ("replay", None),
        (False, False, True): ("replay", None),
        (True, False, False): ("exchange", None),
        (True, False, True): ("exchange", None),
        (False, False, False): ("exchange", None),
        (True, True, True): ("side", 1),
        (True, True, False): ("side", None),
        (False, True, False): ("side", None),
    }
    for case in itertools.product((False, True), repeat=3):
        assert run_streams(*case) == want[case], case
