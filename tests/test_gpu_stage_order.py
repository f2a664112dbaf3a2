"""Stage and commit stream ordering on a real GPU (one process, collocated, local copies).

Each case queues a ~50 ms gate (``torch.cuda._sleep``) on one stream and checks that the
other side's work waited for it: the stage's copies wait for the producer (the trainer's
update queued on the caller's stream before ``stage()``); the commit's copies wait for the
stage's completion (the stage's stream gated); a stage requested right after a commit
waits for the commit's copies (the caller's stream gated) before overwriting staging.
"""

from __future__ import annotations

import pytest
import torch

import torchrefit as tr
from torchrefit.testing import run_world

pytestmark = pytest.mark.gpu


def _models(device):
    torch.manual_seed(0)
    src = torch.nn.Linear(4096, 4096, bias=False, device=device)
    dst = torch.nn.Linear(4096, 4096, bias=False, device=device)
    return src, dst


def _gate(cycles: int) -> None:
    torch.cuda._sleep(cycles)


def _cases(rank: int, world: int, staging: str) -> dict:
    from torchrefit.bench.timing import sleep_cycles_per_ms

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    gate = int(50 * sleep_cycles_per_ms(device))
    src, dst = _models(device)
    r = tr.Refitter(src, dst, transport="gloo", staging=staging)
    out = {}
    with torch.no_grad():
        # the stage reads the source after the producer queued before stage()
        _gate(gate)
        src.weight.fill_(1.0)
        r.stage(wait=False).wait()
        r.commit()
        torch.cuda.synchronize()
        out["producer"] = bool((dst.weight == 1.0).all())

        # the commit's copies wait for the stage's (its stream gated)
        program_run = type(r._stage_program).run

        def gated(self, *a, **k):
            _gate(gate)  # on the stage's stream
            return program_run(self, *a, **k)

        src.weight.fill_(2.0)
        r._stage_program.run = gated.__get__(r._stage_program)
        r.stage(wait=False)
        r.commit()
        torch.cuda.synchronize()
        out["stage_done"] = bool((dst.weight == 2.0).all())
        del r._stage_program.run

        # a stage requested from another stream (a trainer's) right after a commit waits
        # for the commit's copies, queued behind a gate on the engine's stream
        src.weight.fill_(3.0)
        r.stage()
        staged = torch.cuda.Event()
        staged.record()
        _gate(gate)
        r.commit()  # queued behind the gate
        trainer = torch.cuda.Stream(device)
        trainer.wait_event(staged)  # after the stage of 3.0, not behind the gate
        with torch.cuda.stream(trainer):
            src.weight.fill_(4.0)
            handle = r.stage(wait=False)  # overwrites staging unless it waits for the commit
        torch.cuda.synchronize()
        out["commit_read"] = bool((dst.weight == 3.0).all())
        handle.wait()
        r.commit()
        torch.cuda.synchronize()
        out["next"] = bool((dst.weight == 4.0).all())
    return out


@pytest.mark.parametrize("staging", ["device", "host"])
def test_stage_commit_stream_order(staging: str) -> None:
    got = run_world(_cases, 1, staging, timeout=300)[0]
    assert got == {"producer": True, "stage_done": True, "commit_read": True, "next": True}
