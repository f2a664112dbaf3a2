"""A fleet on one GPU (marked ``gpu``): a 2-rank TP2 trainer job and three replica jobs
(TP1 unstaged, TP2 staged, TP2 staged), every process its own, all holding their weights
on the one GPU, edges over CUDA IPC between processes (and over gloo with CUDA tensors);
a fourth replica (TP1, staged) joins while updates run, and one more update follows once
it is ready. Each update moves in 4 parts along the relay chain.

Checked against an independent oracle, not ``verify()``: before each update the trainer
writes seed ``v``'s values into its weights and checks them against the toy's oracle
(plain torch cuts of the global values), so its tensors at version ``v`` are the oracle's;
each replica, at every version it installs, compares every local tensor with the same
oracle for ``v``, bit for bit (``torch.equal`` on the bytes). Every replica that was in the
fleet from the start (the trainer waits until their ranks all started) installs every
version, exactly; the late one installs the last; no replica is dropped; each byte leaves
the trainer once (egress within 1.1x one replica's bytes once two replicas are fed).
"""

from __future__ import annotations

import time

import fleet_scenarios as fs
import pytest

from torchrefit.testing.fleet_jobs import Job
from torchrefit.testing.jobs import free_ports

UPDATES, TIMEOUT = 6, 60.0
LAYOUTS = ((1, False), (2, True), (2, True))  # (TP, staged) of the replicas there from the start


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["ipc", "gloo"])
def test_fleet_on_one_gpu_delivers_every_version_exactly(tmp_path, transport: str) -> None:
    port, logdir = free_ports(1)[0], str(tmp_path)
    replicas = [Job(fs.replica, tp, port, f"r{i}", staged, logdir, TIMEOUT, fs.SECRET, "cuda", transport)
                for i, (tp, staged) in enumerate(LAYOUTS)]
    trainer = Job(fs.trainer, 2, port, UPDATES, len(LAYOUTS), TIMEOUT, 10.0, 0.2, None, True,
                  len(LAYOUTS) + 1, 120.0, None, 4, "cuda", transport)
    late = None
    try:
        deadline = time.monotonic() + 300
        while not trainer.finished() and time.monotonic() < deadline:
            if late is None and any(line["v"] >= 2 for line in fs.read_logs(logdir)):
                late = Job(fs.replica, 1, port, "late", True, logdir, TIMEOUT, fs.SECRET, "cuda", transport)
            time.sleep(0.05)
        got = trainer.results(max(1.0, deadline - time.monotonic()))
        ended = [r for j in replicas + [late] if j is not None for r in j.results(60)]
    finally:
        for j in replicas + [trainer] + ([late] if late else []):
            j.kill()
    for g in got:
        assert g is not None and g[0], f"a trainer rank failed:\n{g}"
    assert late is not None, "no replica installed version 2: the late one never started"
    for g in ended:
        assert g is not None and g[0], f"a replica rank failed:\n{g}"
    reports = got[0][1]["reports"]
    last = UPDATES + 1
    assert [r.version for r in reports] == list(range(1, last + 1))
    assert not any(r.dropped for r in reports), "\n".join(map(str, reports))
    assert len(reports[-1].replicas) == 4 and all(
        r.version == last and not r.mixed for r in reports[-1].replicas), str(reports[-1])
    for r in reports:
        fed = [x.bytes for x in r.replicas if x.version == r.version]
        if len(fed) >= 2:
            assert r.trainer_bytes_sent <= 1.1 * max(fed), str(r)

    logs = fs.read_logs(logdir)
    bad = [line for line in logs if not line["ok"]]
    assert not bad, f"replicas installed bytes that differ from the trainer's: {bad[:5]}"
    seen: dict[tuple[str, int], set[int]] = {}
    for line in logs:
        seen.setdefault((line["name"], line["rank"]), set()).add(line["v"])
    for i, (tp, _) in enumerate(LAYOUTS):  # armed before the first update: fed from it on
        for rank in range(tp):
            assert seen.get((f"r{i}", rank)) == set(range(1, last + 1)), (f"r{i}", rank, seen)
    assert last in seen.get(("late", 0), set()), seen
