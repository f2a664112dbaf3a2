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
        torch.equal(got[k].cpu().view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def _device(device: str) -> str:
    if device == "cuda":  # every process of these jobs shares the one GPU
        torch.cuda.set_device(0)
    return device


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def replica(rank: int, world: int, port: int, name: str, staged: bool, logdir: str,
            timeout: float, secret: str = SECRET, device: str = "cpu", transport: str = "auto",
            gate: str | None = None) -> dict:
    """One replica rank: join, log every installed version's oracle verdict, serve until
    the fleet stops it. ``device="cuda"`` holds the model on the one GPU, every edge over
    ``transport`` (e.g. ``ipc``). With ``gate``, the rank's first edge group is never
    built: it writes ``<gate>.<rank>`` there and blocks (for the launcher to kill it)."""
    if gate is not None:
        _gate_group_build(f"{gate}.{rank}")
    mesh = Mesh(tp=world, ranks=world)
    model = build_toy(SPEC, mesh, rank, seed=0, device=_device(device))
    log = open(os.path.join(logdir, f"{name}-{rank}-{os.getpid()}.jsonl"), "a", buffering=1)

    def on_version(v: int) -> None:
        log.write(json.dumps({"name": name, "rank": rank, "v": v, "ok": matches(model, mesh, rank, v),
                              "fds": open_fds(), "rss": rss_kib()}) + "\n")

    rep = fleet.join(model, rank, world, "127.0.0.1", port, name=name, secret=secret, staged=staged,
                     timeout=timeout, on_version=on_version, refitter_args={"transport": transport})
    while not rep._stop.wait(0.1):
        with rep.lock:  # a forward pass would run here: never on half a commit
            pass
    return {"name": rep.name, "version": rep.version, "mixed": rep.mixed, "dropped": rep.dropped,
            "fds": open_fds()}


def _gate_group_build(path: str) -> None:
    """Block this process inside its first edge's group build, before it publishes its
    address to the rendezvous, after saying so in ``path``."""
    from torchrefit.fleet import links

    def gated(*args, **kwargs):
        with open(path, "w"):
            pass
        time.sleep(3600)

    links.build_joint_group = gated


def _capture_warnings() -> list[str]:
    import logging
    got: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    logger = logging.getLogger("torchrefit.fleet")
    logger.addHandler(_Keep(logging.WARNING))
    logger.setLevel(logging.INFO)
    return got


def _wait_allowed(path: str, v: int, limit: float = 180.0) -> None:
    """The chaos launcher holds the trainer back before an update it will kill in until
    the last restart is ready (training would go on; the test wants each kill to land on a
    fleet whose restarts joined)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                if int(f.read().strip() or 0) >= v:
                    return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.01)


def _wait_ready(f, count: int, limit: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and sum(m.state == "ready" for m in f.replicas()) < count:
        time.sleep(0.05)


def trainer(rank: int, world: int, port: int, updates: int, expect: int, timeout: float,
            drop_after: float, pause: float, ctl: str | None = None, relay: bool = True,
            settle: int = 0, join_timeout: float = 120.0, hold: str | None = None, chunks: int = 4,
            device: str = "cpu", transport: str = "auto") -> dict:
    """The trainer job: wait for ``expect`` replicas to have joined, every rank of each
    started (rank 0), then ``updates`` updates; with ``settle``, rank 0 then waits (at most
    120 s) until ``settle`` replicas are ready and one more update runs (restarts that
    joined late are fed too). ``device`` / ``transport``: as for :func:`replica`. With
    ``hold``, rank 0 waits (at most 120 s) for that file before closing the fleet. Each
    rank returns every report, its fd / memory figures and the fleet's warnings."""
    warnings = _capture_warnings()
    model = build_toy(SPEC, TRAINER, rank, seed=0, device=_device(device))
    f = fleet.Fleet(model, rank, world, "127.0.0.1", port, secret=SECRET, timeout=timeout,
                    drop_after=drop_after, join_timeout=join_timeout, chunks=chunks,
                    refitter_args={"transport": transport})
    if f.coordinator is not None:
        f.coordinator.relay = relay
        deadline = time.monotonic() + 120
        # armed: every rank of each started (the first update feeds it; updates before it
        # would feed nobody, and take no time)
        while time.monotonic() < deadline and sum(
                m.state not in ("arming", "dropped") for m in f.replicas()) < expect:
            time.sleep(0.05)
    reports, fds, rss, worst = [], [], [], 0.0
    for v in range(1, updates + 1):
        if ctl is not None and rank == 0:
            _wait_allowed(ctl + ".allow", v)
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
    if settle:
        if rank == 0:
            _wait_ready(f, settle, 120.0)
        load_seed(model, SPEC, TRAINER, rank, updates + 1)
        reports.append(f.update(updates + 1))
    if hold is not None and rank == 0:
        deadline = time.monotonic() + 120
        while not os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.05)
    table = f.replicas()
    plans = (f.plans.built, f.plans.reused)
    seeds = list(f.coordinator.seeds) if f.coordinator is not None else []
    f.close()
    return {"reports": reports, "fds": fds, "rss": rss, "worst": worst, "table": table, "seeds": seeds,
            "plans": plans,
            "warnings": list(warnings),
            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


# ---------------------------------------------------------------------------- chaos
def _current(ctl: str) -> int:
    try:
        with open(ctl) as f:
            lines = f.read().split()
        return int(lines[-1]) if lines else 0
    except FileNotFoundError:
        return 0


def run_chaos(logdir: str, updates: int, kills: int, add_at: int | None, seed: int = 0,
              timeout: float = 10.0, drop_after: float = 3.0, pause: float = 0.05,
              layouts: tuple[tuple[int, bool], ...] = ((1, False), (2, True), (2, True)),
              relay: bool = True, limit: float = 600.0, settle: bool = True, chunks: int = 4) -> dict:
    """A 2-rank trainer, replicas of ``layouts`` ((TP, staged) each), ``updates`` updates;
    during ``kills`` chosen updates a random replica is SIGKILLed a random moment after the
    update began and restarted at once (a new join); a 4th replica (TP2, staged) joins at
    update ``add_at``; each update moves in ``chunks`` parts. Returns the trainer's results,
every replica job's, and the kills."""
    import random

    from torchrefit.testing.fleet_jobs import Job
    from torchrefit.testing.jobs import free_ports

    rnd = random.Random(seed)
    port = free_ports(1)[0]
    ctl = os.path.join(logdir, "ctl")
    live = {i: Job(replica, tp, port, f"r{i}", staged, logdir, timeout) for i, (tp, staged) in enumerate(layouts)}
    spec = dict(enumerate(layouts))
    every: list[Job] = list(live.values())
    final = len(layouts) + (add_at is not None)
    trainer_job = Job(trainer, 2, port, updates, len(layouts), timeout, drop_after, pause, ctl, relay,
                      final if settle else 0, 120.0, None, chunks)
    plan = sorted(rnd.sample(range(3, updates - 2), kills)) if kills else []
    allowed = _allow(ctl, plan[0] if plan else updates + 1, None)
    killed: list[tuple[int, str]] = []
    names = {i: f"r{i}" for i in live}
    restarts, pending, last_look = 0, None, 0.0
    deadline = time.monotonic() + limit
    while not trainer_job.finished() and time.monotonic() < deadline:
        v = _current(ctl)
        if pending is not None and time.monotonic() - last_look > 0.2:
            last_look = time.monotonic()
            if any(line["name"] == pending for line in read_logs(logdir)):
                pending = None  # the restart holds a version: the next kill may come
        allowed = _allow(ctl, updates + 1 if not plan else plan[0] - (pending is not None), allowed)
        if add_at is not None and v >= add_at and 3 not in spec:
            spec[3] = (2, True)
            live[3], names[3] = Job(replica, 2, port, "r3", True, logdir, timeout), "r3"
            every.append(live[3])
        if plan and v >= plan[0]:
            plan.pop(0)
            time.sleep(rnd.uniform(0.0, 0.05))  # somewhere inside the update
            i = rnd.choice(sorted(live))
            live[i].kill()
            killed.append((v, names[i]))
            restarts += 1
            tp, staged = spec[i]
            names[i] = pending = f"r{i}x{restarts}"
            live[i] = Job(replica, tp, port, names[i], staged, logdir, timeout)
            every.append(live[i])
        time.sleep(0.005)
    trained = trainer_job.results(max(1.0, deadline - time.monotonic()))
    replicas = [j.results(30) for j in every]
    return {"trainer": trained, "replicas": replicas, "killed": killed}


def _allow(ctl: str, v: int, before: int | None) -> int:
    if v != before:
        with open(ctl + ".allow.tmp", "w") as f:
            f.write(str(v))
        os.replace(ctl + ".allow.tmp", ctl + ".allow")
    return v


def read_logs(logdir: str) -> list[dict]:
    import glob
    out = []
    for path in glob.glob(os.path.join(logdir, "*.jsonl")):
        with open(path) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out
