"""Delta refits on GPUs (marked ``gpu``): the CPU suite's every-dtype scenario
(``test_delta._dtypes_world``: every dtype, a cast, block-FP8 targets, densities 0 to
100%, NaN payloads and -0.0) with CUDA tensors, checked bit for bit against a full refit
into a second destination. Over gloo with both processes on one GPU (the diff and the
patch run on the device, the messages through host memory), and over NCCL with one GPU
per process (needs 2 GPUs), and over CUDA IPC between 2 processes (on one GPU where the
machine has one; ``execute.delta_one_sided``: the receiver applies patches straight out of
the sender's registered slots and copies dense messages out of its sources), with the
version chain's stage / commit sequence (``test_delta._chain_world``) too, and the done
order: a receiver whose reads are queued behind a gate still gets the version it was
sent, although the sender bumps its sources and refits again (its next diff rewriting
the slots it reads) as soon as its ``refit()`` returns; ``TORCHREFIT_BREAK_DONE_WAIT=1``
(``test_gpu_stale_read``) removes the sender's wait to show that the test then fails. CUDA tensors take the Triton kernels (``settings.triton_delta``)
unless turned off: both forms run, and the Triton kernels also against the torch ops
message by message (``test_delta_triton_interpreted``'s cases on the GPU, with NaN payloads
through the fused cast).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from test_delta import _chain_world, _dtypes_world, check_chain, check_dtypes
from test_delta_triton_interpreted import _CODE

import torchrefit as tr
from torchrefit.testing import run_world


@pytest.mark.gpu
@pytest.mark.parametrize("delta, triton", [("device", True), ("device", False), ("host", True)])
def test_gloo_with_cuda_tensors(delta: str, triton: bool) -> None:
    check_dtypes(run_world(_dtypes_world, 2, delta, "cuda", "gloo", True, triton, timeout=300))


@pytest.mark.gpu
def test_triton_kernels_match_the_torch_ops_on_the_gpu() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _CODE.replace("DEVICE", "cuda")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("EXACT"), out.stdout


@pytest.mark.gpu
def test_nccl_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL cannot pair two ranks on one GPU; needs 2 GPUs")
    check_dtypes(run_world(_dtypes_world, 2, "device", "cuda", "nccl", backend="cpu:gloo,cuda:nccl",
                           timeout=300))


@pytest.mark.gpu
@pytest.mark.parametrize("delta, triton", [("device", True), ("device", False), ("host", True)])
def test_ipc_two_processes(delta: str, triton: bool) -> None:
    check_dtypes(run_world(_dtypes_world, 2, delta, "cuda", "ipc", True, triton, timeout=300))


@pytest.mark.gpu
def test_ipc_version_chain_with_stage_and_commit() -> None:
    check_chain(run_world(_chain_world, 2, "ipc", "cuda", timeout=300)[1]["rows"])


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["gloo", "ipc"])
def test_version_chain_into_host_staged_twins(transport: str) -> None:
    """CUDA tensors staged in host memory (``staging="host"``): patches are applied into the
    twins where they live, on the host."""
    check_chain(run_world(_chain_world, 2, transport, "cuda", "host", timeout=300)[1]["rows"])


def _delta_overwrite(rank: int, world: int, transport: str, done_wait: str, density: float) -> list[str]:
    """Rank 0 sends to rank 1 over ipc with ``delta``; in the second refit rank 1's
    stream is gated right after it read the header (a host read, so a gate queued before
    the refit would be waited out there), so its reads of the payloads queue behind the
    gate; rank 0 bumps its sources and refits again at once (its diff rewrites the slots
    and references), and so does rank 1, its host not waiting for those reads (every
    delta call starts with the ranks' version offers: a rank 1 that waited would hold
    rank 0's next diff back itself). Rank 1 must hold the second refit's version: a
    patch (``density`` 1%, read out of the slots) or dense (50%, read out of the sources)."""
    from test_gpu_stale_read import GATE_MS, _break_done_wait, _ipc_defaults, _order

    from torchrefit.bench.timing import sleep_cycles_per_ms
    from torchrefit.execute import delta_one_sided
    _ipc_defaults(done_wait=done_wait)
    if os.environ.get("TORCHREFIT_BREAK_DONE_WAIT") == "1":
        _break_done_wait()
    transport = _order(transport)
    torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(0)
    shapes = {"a": (4096, 4096), "b": (4096, 1024), "c": (333,)}
    src = {k: torch.randn(s, generator=g).to("cuda", torch.bfloat16) for k, s in shapes.items()} if rank == 0 else None
    dst = {k: torch.zeros(s, dtype=torch.bfloat16, device="cuda") for k, s in shapes.items()} if rank == 1 else None
    r = tr.Refitter(src, dst, transport=transport, delta="device")
    r.refit()  # compile, fill the references
    if rank == 0:
        for t in src.values():
            t[(torch.rand(t.shape, generator=g) < density).cuda()] += 1.0
    sent = [{k: v.cpu() for k, v in src.items()} if rank == 0 else None]
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:  # the engine busy again once the header is in: the payload reads wait behind it
        rows, cycles = delta_one_sided._rows, int(GATE_MS * sleep_cycles_per_ms(torch.device("cuda")))

        def gated(*args):
            out = rows(*args)
            torch.cuda._sleep(cycles)
            return out
        delta_one_sided._rows = gated
    r.refit()
    if rank == 1:
        delta_one_sided._rows = rows
    if rank == 0:  # the next step and the next refit, at once
        for t in src.values():
            t.view(-1)[::3] += 7.0
    else:  # a copy queued behind the gated reads, no host wait: rank 1 joins the next refit
        got = {k: v.clone() for k, v in dst.items()}  # at once, so rank 0's next diff is not held back by it
    r.refit()
    torch.cuda.synchronize()
    dist.broadcast_object_list(sent, src=0)
    if rank == 0:
        return []
    return [k for k in shapes if not torch.equal(got[k].cpu().view(torch.int16), sent[0][k].view(torch.int16))]


OVERWRITE = [("ipc", "host"), ("ipc:event", "stream"), ("ipc:event", "host")]


@pytest.mark.gpu
@pytest.mark.parametrize("density", [0.01, 0.5])
@pytest.mark.parametrize("transport,done_wait", OVERWRITE, ids=[f"{t}-{w}" for t, w in OVERWRITE])
def test_ipc_sender_never_rewrites_what_a_receiver_reads(transport: str, done_wait: str, density: float) -> None:
    results = run_world(_delta_overwrite, 2, transport, done_wait, density, timeout=180)
    assert results[1] == [], f"rank 1 read slots or sources the next step had rewritten: {results[1]}"
