"""The engine's own work while the next version is staged, against the same work idle,
and the engine's stall (the commit) against a whole refit: two processes, a trainer
(rank 0) and an engine (rank 1), one toy model each, every byte over ``--transport``.

The engine's work is a loop of matmuls over its weights (each 2-D weight times a
``--batch``-row activation), one pass a *step*. Measured on the engine:

* ``idle_steps_per_s``: steps per second with no refit running;
* ``staging_steps_per_s``: steps per second while ``stage(wait=False)`` runs (the engine
  steps until the handle is done); ``--stages`` rounds, each an idle window then a
  stage, so that a shared machine's drifting load weighs on both alike;
* ``throughput_kept``: their ratio (the target is >= 0.8);
* ``refit_ms`` (median of plain refits), ``stage_ms`` (median stage, both ranks aligned),
  ``commit_ms`` (median commit on the engine: its stall) and ``refit_over_commit``.

On CPU both processes share the machine's cores with the stage's own work (gloo's
threads, the twins' writes): the ratio then measures core contention as much as
torchrefit. On a GPU (one per process where there are two, else both on one) the
engine's loop runs on its stream and each step ends with a synchronize.

    python benchmarks/stage_commit.py [--hidden 512 --layers 4] [--transport gloo]
        [--staging device|host] [--stages 10] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import torchrefit as tr
from torchrefit.bench.runner import rank_device
from torchrefit.testing import Mesh, ModelSpec, build_toy, run_world


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _engine_step(pairs, device: torch.device) -> None:
    """One pass of the engine's work: every weight read once by a matmul."""
    for x, w in pairs:
        torch.matmul(x, w.t())
    _sync(device)


def _steps_per_s(step, until) -> tuple[float, int]:
    """Steps per second of ``step()`` called until ``until()`` says stop (at least one)."""
    n, t0 = 0, time.perf_counter()
    while True:
        step()
        n += 1
        if until():
            break
    return n / (time.perf_counter() - t0), n


def _rank(rank: int, world: int, args) -> dict:
    device = rank_device(rank)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = ModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, groups=args.heads,
                     ffn=4 * args.hidden, vocab=args.vocab, swiglu=False, dtype=dtype)
    src = build_toy(spec, Mesh(1, ranks=1), rank, seed=1, device=device, random_init=True)
    dst = build_toy(spec, Mesh(1, ranks=1, offset=1), rank, seed=2, device=device, random_init=True)
    r = tr.Refitter(src, dst, transport=args.transport, staging=args.staging, cuda_graph=False)
    r.refit()
    out: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}

    def aligned(fn) -> float:
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    out["refit_ms"] = 1e3 * statistics.median(aligned(r.refit) for _ in range(args.iters))
    stage_s = []
    for _ in range(args.iters):
        stage_s.append(aligned(r.stage))
        if dst is not None:
            r.commit()
    out["stage_ms"] = 1e3 * statistics.median(stage_s)
    if dst is not None:
        commits = []
        for _ in range(args.iters):
            r.stage()
            _sync(device)
            t0 = time.perf_counter()
            r.commit()
            _sync(device)
            commits.append(time.perf_counter() - t0)
        out["commit_ms"] = 1e3 * statistics.median(commits)
        out["refit_over_commit"] = out["refit_ms"] / out["commit_ms"]
        out["dst_bytes"] = sum(t.nbytes for t in dst.state_dict().values())
    else:
        for _ in range(args.iters):
            r.stage()

    # the engine's loop, idle and while a stage runs, interleaved (a shared machine's
    # load drifts): each round an idle window as long as a stage, then a stage
    if dst is not None:
        pairs = [(torch.randn(args.batch, w.shape[1], device=device, dtype=w.dtype), w.detach())
                 for w in dst.parameters() if w.dim() == 2]

        def step() -> None:
            _engine_step(pairs, device)

        step()
    window = max(out["stage_ms"] / 1e3, args.min_window)
    idle = [0.0, 0]
    busy = [0.0, 0]
    for _ in range(args.stages):
        dist.barrier()
        if dst is None:
            dist.barrier()
            r.stage()
            continue
        t0 = time.perf_counter()
        _, n = _steps_per_s(step, lambda end=t0 + window: time.perf_counter() > end)
        idle[0] += time.perf_counter() - t0
        idle[1] += n
        dist.barrier()
        t0 = time.perf_counter()
        handle = r.stage(wait=False)
        _, n = _steps_per_s(step, handle.done)
        handle.wait()
        busy[0] += time.perf_counter() - t0
        busy[1] += n
    if dst is not None:
        r.commit()
        out["idle_steps_per_s"], out["idle_steps"] = idle[1] / idle[0], idle[1]
        out["staging_steps_per_s"], out["staging_steps"] = busy[1] / busy[0], busy[1]
        out["throughput_kept"] = out["staging_steps_per_s"] / out["idle_steps_per_s"]
    r.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16, help="activation rows per matmul")
    ap.add_argument("--transport", default="gloo")
    ap.add_argument("--staging", default="device", choices=["device", "host"])
    ap.add_argument("--iters", type=int, default=5, help="timed refits, stages and commits")
    ap.add_argument("--stages", type=int, default=10, help="stages the engine's loop runs under")
    ap.add_argument("--min-window", type=float, default=0.5,
                    help="seconds of each idle window at least (else as long as a stage)")
    ap.add_argument("--json")
    args = ap.parse_args()
    backend = "gloo" if args.transport == "gloo" or not torch.cuda.is_available() else "cpu:gloo,cuda:nccl"
    engine = run_world(_rank, 2, args, backend=backend, timeout=1800)[1]
    engine["args"] = vars(args)
    print(json.dumps(engine, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(engine, f, indent=1)


if __name__ == "__main__":
    main()
