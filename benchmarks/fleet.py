"""Fleets: update time and trainer egress with 1, 2 and 3 replicas, and seeding a
newcomer from a peer against a first refit from the trainer, in one run.

A 2-rank TP2 trainer job feeds k TP2 replica jobs (each its own job of 2 processes, staged)
through ``tr.Fleet`` / ``join``, for k = 1, 2, 3 (a fresh fleet each). Per k: the median
wall time of ``Fleet.update`` over ``--updates`` timed updates (after 3 warm-up ones), the
trainer's egress per update (bytes its ranks sent) over one replica's bytes, and the ratio
of the update time to k = 1's; beside it, the copy floor: the time to copy one replica's
bytes k times on the device they all share (one GPU's HBM, where k replicas write k times
the bytes: the best ratio physics allows there), and the CPU floor (every fleet process's
CPU seconds over the cores). After the timed updates, every replica rank checks that its
weights are the trainer's at the last version, bit for bit (a fresh build of the same
random values with the trainer's steps applied); a mismatch fails the run. With k = 2, after the timed updates a newcomer joins and is
seeded by a peer: its seed time (group, plan and transfer, cold) against the cold first
update of k = 1 (the trainer feeding one replica for the first time: group, plan and
transfer) and the warm single-replica update::

    python benchmarks/fleet.py [--device cpu --transport gloo] [--size small] [--chunks 4] [--fanout 1] [--json out.json]
    python benchmarks/fleet.py --device cuda --transport ipc --size large   # one GPU
    python benchmarks/fleet.py --size tiny     # bytes negligible: the coordination alone

Prints a markdown table and (with ``--json``) the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import torchrefit.fleet as fleet
from torchrefit.testing import Mesh, ModelSpec, build_toy
from torchrefit.testing.fleet_jobs import Job
from torchrefit.testing.jobs import free_ports

SIZES = {"tiny": ModelSpec(layers=1, hidden=64, heads=4, groups=2, ffn=128, vocab=256),  # coordination alone
         "small": ModelSpec(layers=2, hidden=256, heads=8, groups=4, ffn=1024, vocab=4096),
         "large": ModelSpec(layers=8, hidden=2048, heads=16, groups=4, ffn=8192, vocab=32768,
                            dtype=torch.bfloat16)}
SECRET = "fleet-benchmark"
TIMEOUT = 120.0


def _model(size: str, mesh: Mesh, rank: int, device: str):
    if device == "cuda":
        torch.cuda.set_device(0)
    return build_toy(SIZES[size], mesh, rank, seed=0, device=device, random_init=True)


def _exact(model, size: str, mesh: Mesh, rank: int, device: str, version: int) -> bool:
    """Whether ``model`` holds the trainer's weights at ``version``, bit for bit: the
    trainer's rank of the same mesh starts from the same random values and adds 1 to every
    parameter before each update, so its tensors at ``version`` are a fresh build of the same
    seed with ``version`` such steps (elementwise, the same on either side)."""
    want = _model(size, mesh, rank, device)
    with torch.no_grad():
        for _ in range(version):
            for p in want.parameters():
                p.add_(1)
    got, want = model.state_dict(), want.state_dict()
    return set(got) == set(want) and all(
        torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def replica(rank: int, world: int, port: int, size: str, device: str, transport: str, updates: int) -> dict:
    """One replica rank; returns the CPU seconds its process spent over the timed updates
    (from installing version 3 to installing version 3 + ``updates``), and, once the fleet
    closed, the version it holds and whether its weights are the trainer's at that version."""
    mesh = Mesh(tp=world, ranks=world)
    model = _model(size, mesh, rank, device)
    cpu: dict[int, float] = {}

    def on_version(v: int) -> None:
        if v in (3, 3 + updates):
            cpu[v] = time.process_time()

    rep = fleet.join(model, rank, world, "127.0.0.1", port, name="bench", secret=SECRET,
                     timeout=TIMEOUT, on_version=on_version, refitter_args={"transport": transport})
    while not rep._stop.wait(0.1):
        pass
    with rep.lock:
        version = rep.version
        exact = _exact(model, size, mesh, rank, device, version) and not rep.mixed
    return {"cpu": cpu[3 + updates] - cpu[3] if len(cpu) == 2 else None, "version": version, "exact": exact}


def trainer(rank: int, world: int, port: int, size: str, device: str, transport: str, k: int,
            updates: int, newcomer: str | None, chunks: int, fanout: int = 1) -> dict:
    model = _model(size, Mesh(tp=world, ranks=world), rank, device)
    f = fleet.Fleet(model, rank, world, "127.0.0.1", port, secret=SECRET, timeout=TIMEOUT,
                    drop_after=30.0, chunks=chunks, fanout=fanout, refitter_args={"transport": transport})
    if f.coordinator is not None:  # every replica's ranks started: the first update feeds them
        while sum(m.state != "arming" for m in f.replicas()) < k:
            time.sleep(0.05)
    reports, cpu = [], {}

    def step() -> None:  # an optimizer step in place: every parameter + 1 (the replicas' check)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
        if device == "cuda":
            torch.cuda.synchronize()

    for v in range(1, updates + 4):
        if v in (4, updates + 4):
            cpu[v] = time.process_time()
        step()
        reports.append(f.update(v))
    cpu[updates + 4] = time.process_time()
    seed = None
    if newcomer is not None and f.coordinator is not None:
        open(newcomer, "w").close()  # the launcher starts the newcomer now
        while not f.coordinator.seeds:
            time.sleep(0.01)
        seed = f.coordinator.seeds[0]
    if newcomer is not None:
        step()
        reports.append(f.update(updates + 4))  # every rank runs the same number of updates
    f.close()
    return {"reports": [(r.seconds, r.trainer_bytes_sent, [x.bytes for x in r.replicas], r.rounds)
                        for r in reports], "seed": seed, "cpu": cpu[updates + 4] - cpu[4]}


def run_fleet(args, k: int, newcomer: bool) -> dict:
    port = free_ports(1)[0]
    flag = os.path.join(tempfile.mkdtemp(), "newcomer") if newcomer else None
    jobs = [Job(replica, 2, port, args.size, args.device, args.transport, args.updates) for _ in range(k)]
    t = Job(trainer, 2, port, args.size, args.device, args.transport, k, args.updates, flag, args.chunks,
            args.fanout)
    late = None
    while not t.finished():
        if flag is not None and late is None and os.path.exists(flag):
            late = Job(replica, 2, port, args.size, args.device, args.transport, args.updates)
        time.sleep(0.02)
    got = t.results(10)
    fed = [g for j in jobs for g in j.results(30)]
    newcomer_ranks = late.results(30) if late else []
    if any(g is None or not g[0] for g in got + fed + newcomer_ranks):
        sys.exit(f"a trainer or replica rank failed: {got + fed + newcomer_ranks}")
    out = got[0][1]
    last = len(out["reports"])  # versions 1..last, one per update
    wrong = [(g[1]["version"], g[1]["exact"]) for g in fed + newcomer_ranks
             if g[1]["version"] != last or not g[1]["exact"]]
    if wrong:
        sys.exit(f"k={k}: replica ranks do not hold the trainer's bytes of version {last}: {wrong}")
    out["checked"] = len(fed + newcomer_ranks)
    # every fleet process's CPU over the timed updates, spread over this machine's cores:
    # on loopback each hop's bytes are copies, so this is the time no schedule can beat
    out["cpu"] = sum(g[1]["cpu"] for g in got + fed) / min(os.cpu_count() or 1, len(os.sched_getaffinity(0)))
    return out


def copy_floor(nbytes: int, k: int, device: str, reps: int = 20) -> float:
    """Median seconds to copy ``k`` buffers of ``nbytes`` each on ``device``, one after
    another: what k replicas receiving one replica's bytes each must write into memory they
    share (one GPU's HBM; on CPU, this process's one core)."""
    n = max(1, nbytes // 2)
    src = [torch.empty(n, dtype=torch.bfloat16, device=device).normal_() for _ in range(k)]
    dst = [torch.empty_like(s) for s in src]
    times = []
    for _ in range(reps + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    return statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--transport", default="gloo")
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--chunks", type=int, default=4, help="parts each update moves in (1: store-and-forward)")
    ap.add_argument("--fanout", type=int, default=1, help="replicas each replica relays to (1: a chain)")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows, out = [], {}
    for k in (1, 2, 3):
        res = run_fleet(args, k, newcomer=(k == 2))
        timed = res["reports"][3:3 + args.updates]
        one = max(max(b) for _, _, b, _ in timed)
        out[k] = {"median_s": statistics.median(s for s, *_ in timed),
                  "egress_x": statistics.median(e for _, e, _, _ in timed) / one,
                  "replica_bytes": one, "first_s": res["reports"][0][0], "seed": res["seed"],
                  "cpu_floor_s": res["cpu"] / args.updates,
                  "mean_s": statistics.mean(s for s, *_ in timed), "checked": res["checked"]}
    if args.device == "cuda":
        torch.cuda.set_device(0)  # after every fleet: the copies below contend with nothing
    for k in (1, 2, 3):
        out[k]["copy_floor_s"] = copy_floor(out[1]["replica_bytes"], k, args.device)
    base, floor1 = out[1]["median_s"], out[1]["copy_floor_s"]
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores; {args.chunks} chunk(s) per update, fanout {args.fanout}; "
          f"{out[1]['replica_bytes'] / 1e6:.1f} MB per "
          f"replica per update on {args.device} over {args.transport}")
    print(f"| replicas | update ms (median of {args.updates}) | x 1 replica | copy floor ms | floor x 1 replica "
          "| CPU floor ms | mean / CPU floor | trainer egress / one replica's bytes |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for k in (1, 2, 3):
        o = out[k]
        print(f"| {k} | {1e3 * o['median_s']:.1f} | {o['median_s'] / base:.2f} | {1e3 * o['copy_floor_s']:.2f} "
              f"| {o['copy_floor_s'] / floor1:.2f} | {1e3 * o['cpu_floor_s']:.1f} "
              f"| {o['mean_s'] / o['cpu_floor_s']:.2f} | {o['egress_x']:.3f} |")
        rows.append(o)
    print(f"\ndelivered bytes: every replica rank ({', '.join(str(out[k]['checked']) for k in (1, 2, 3))} "
          "for 1 / 2 / 3 replicas, the newcomer included) held the trainer's last version, bit for bit")
    seed = out[2]["seed"]
    print(f"\nseeding a newcomer from a peer (cold: group, plan, transfer): {seed[3]:.3f} s; "
          f"first update from the trainer into one replica (cold): {out[1]['first_s']:.3f} s; "
          f"warm single-replica update: {base:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "fleets": out}, f, indent=1)


if __name__ == "__main__":
    main()
