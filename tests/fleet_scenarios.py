"""Trainer and replica jobs for the fleet tests and benchmark (spawned processes run these).

The trainer job holds the toy model TP2 over 2 ranks and writes seed ``v``'s values into it
before update ``v`` (an optimizer step in place). A replica job holds the toy in its own
TP layout; after each version it installs it compares every local tensor with the toy's
oracle for that seed (plain torch cuts of the global values, independent of torchrefit),
bit for bit, and appends the verdict to a log file, so a replica killed later leaves its
record behind.
"""

from __future__ import annotations

import json
import os
import resource
import time

import torch

import torchrefit.fleet as fleet
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local
from torchrefit.testing.toy import load_seed

SPEC = ModelSpec(layers=2)
TRAINER = Mesh(tp=2, ranks=2)
SECRET = "fleet-test-secret"


def matches(model, mesh: Mesh, rank: int, seed: int) -> bool:
    want = expected_local(SPEC, mesh, rank, seed)
    got = model.state_dict()
    return set(got) == set(want) and all(
        torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def replica(rank: int, world: int, port: int, name: str, staged: bool, logdir: str,
            timeout: float, secret: str = SECRET) -> dict:
    """One replica rank: join, log every installed version's oracle verdict, serve until
    the fleet stops it."""
    mesh = Mesh(tp=world, ranks=world)
    model = build_toy(SPEC, mesh, rank, seed=0)
    log = open(os.path.join(logdir, f"{name}-{rank}-{os.getpid()}.jsonl"), "a", buffering=1)

    def on_version(v: int) -> None:
        log.write(json.dumps({"name": name, "rank": rank, "v": v, "ok": matches(model, mesh, rank, v),
                              "fds": open_fds(), "rss": rss_kib()}) + "\n")

    rep = fleet.join(model, rank, world, "127.0.0.1", port, name=name, secret=secret, staged=staged,
                     timeout=timeout, on_version=on_version)
    while not rep._stop.wait(0.1):
        with rep.lock:  # a forward pass would run here: never on half a commit
            pass
    return {"name": rep.name, "version": rep.version, "mixed": rep.mixed, "dropped": rep.dropped,
            "fds": open_fds()}


def trainer(rank: int, world: int, port: int, updates: int, expect: int, timeout: float,
            drop_after: float, pause: float, ctl: str | None = None, relay: bool = True) -> dict:
    """The trainer job: wait for ``expect`` replicas to be ready (rank 0), then ``updates``
    updates; each rank returns every report and its fd / memory figures."""
    model = build_toy(SPEC, TRAINER, rank, seed=0)
    f = fleet.Fleet(model, rank, world, "127.0.0.1", port, secret=SECRET, timeout=timeout,
                    drop_after=drop_after, join_timeout=120.0)
    if f.coordinator is not None:
        f.coordinator.relay = relay
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(f.replicas()) < expect:
            time.sleep(0.05)
    reports, fds, rss, worst = [], [], [], 0.0
    for v in range(1, updates + 1):
        load_seed(model, SPEC, TRAINER, rank, v)
        if ctl is not None and rank == 0:
            with open(ctl, "a") as c:
                c.write(f"{v}\n")
        t0 = time.monotonic()
        rep = f.update(v)
        worst = max(worst, time.monotonic() - t0)
        reports.append(rep)
        fds.append(open_fds())
        rss.append(rss_kib())
        assert matches(model, TRAINER, rank, v)  # the oracle's trainer side
        time.sleep(pause)
    table = f.replicas()
    f.close()
    return {"reports": reports, "fds": fds, "rss": rss, "worst": worst, "table": table,
            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
