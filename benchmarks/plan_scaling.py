"""Planning cost at 64, 256 and 1024 ranks: torchrefit's planner against megatron-core's
``build_plan_from_rosters``, on the same simulated rosters.

The model is the Llama-70B shape (80 layers, hidden 8192), trained TP8 x PP4 and
served TP4, collocated: a case for which Megatron-core's planning time is published.
Both planners get the metadata every rank would gather; each (planner, world)
runs in a fresh process, which reports the slowest sampled rank's planning time,
its peak resident memory (torch and the simulated rosters included) and the
metadata one rank contributes.

* torchrefit: index the roster bytes, validate the whole refit, plan the rank
  (``torchrefit.simulate.report.time_rank``), on several sampled ranks.
* megatron-core: ``index_metadata_rosters`` + ``build_plan_from_rosters`` on rank 0
  (and the last rank where it takes less than a minute): each rank replays the
  whole global schedule, so every rank costs the same. Its metadata is built
  from the same layouts as ``ParameterMetadata`` lists, with Megatron's process
  group rank lists and its rank-list deduplication.

Usage::

    python benchmarks/plan_scaling.py                     # writes the JSON and BENCHMARKS.md
    python benchmarks/plan_scaling.py --megatron-path DIR # megatron-core unpacked in DIR

megatron-core 0.19.2 ships a cp312 wheel only; on another Python, unpack it
(``pip download megatron-core==0.19.2 --no-deps --python-version 3.12
--only-binary=:all:`` then ``python -m zipfile -e WHEEL DIR``) and pass DIR.
Where ``import megatron.core`` fails for want of optional packages (triton),
only its ``resharding.planner`` and ``resharding.utils`` modules are loaded:
they need torch alone.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "cpu" / "plan" / "plan_scaling.json"
MARK_BEGIN = "<!-- plan_scaling: begin (benchmarks/plan_scaling.py writes this section) -->"
MARK_END = "<!-- plan_scaling: end -->"


# ----------------------------------------------------------------------------- children
def child_ours(model: str, src: str, dst: str, world: int) -> dict:
    from torchrefit.simulate import parse_mesh, preset
    from torchrefit.simulate.report import simulate

    sim = simulate(preset(model), parse_mesh(src, world), parse_mesh(dst, world), world,
                   model=model, samples=6)
    r = sim.report
    plan0 = sim.plan(0)
    return {"plan_seconds": r.plan_seconds, "slowest_rank": r.slowest_rank,
            "ranks_timed": [t.rank for t in r.timings], "peak_rss_bytes": r.peak_rss_bytes,
            "plan_alloc_peak_bytes": r.plan_alloc_peak_bytes,
            "metadata_bytes_per_rank": r.metadata_bytes_per_rank,
            "max_send_over_mean": r.max_send_over_mean, "bytes_total": r.bytes_total,
            "rank0_bytes_in": plan0.bytes_received + plan0.bytes_local,
            "rank0_transfers": len(plan0.sends) + len(plan0.recvs) + len(plan0.local)}


def child_megatron(model: str, src: str, dst: str, world: int, megatron_path: str | None) -> dict:
    planner, utils = _load_megatron(megatron_path)
    from torchrefit.simulate import parse_mesh, preset, simulated_rosters

    shape = preset(model)
    s = simulated_rosters(shape, parse_mesh(src, world), world)
    d = simulated_rosters(shape, parse_mesh(dst, world), world)
    pairs = _megatron_rosters(utils, shape, s, d, world)
    meta = max(len(pickle.dumps(p, protocol=5)) for p in pairs)
    timed, out = [], {}
    for rank in (0, world - 1):
        t0 = time.perf_counter()
        by_rank, by_name = planner.index_metadata_rosters(pairs)
        plan = planner.build_plan_from_rosters(by_rank, by_name, rank)
        seconds = time.perf_counter() - t0
        timed.append((seconds, rank))
        if rank == 0:
            out["rank0_bytes_in"] = _recv_bytes(plan, by_rank[0])
            out["rank0_transfers"] = len(plan.send_ops) + len(plan.recv_ops)
        if seconds > 60:
            break  # every rank replays the same global schedule: one is enough
    seconds, rank = max(timed)
    out.update({"plan_seconds": seconds, "slowest_rank": rank,
                "ranks_timed": [r for _, r in timed], "peak_rss_bytes": _peak_rss(),
                "metadata_bytes_per_rank": meta})
    return out


def _load_megatron(path: str | None):
    """megatron-core's resharding planner modules (see the module docstring)."""
    if path:
        sys.path.insert(0, path)
    try:
        from megatron.core.resharding import planner, utils
        return planner, utils
    except ImportError:
        pass
    import importlib.util
    for name in [k for k in sys.modules if k == "megatron" or k.startswith("megatron.")]:
        del sys.modules[name]
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("megatron-core not found: pip install megatron-core==0.19.2 --no-deps, "
                          "or pass --megatron-path")
    base = Path(list(spec.submodule_search_locations)[0])
    for name, sub in (("megatron", ""), ("megatron.core", "core"),
                      ("megatron.core.resharding", "core/resharding")):
        module = types.ModuleType(name)
        module.__path__ = [str(base / sub)]  # a bare package: skip its heavy __init__
        sys.modules[name] = module
    from megatron.core.resharding import planner, utils
    return planner, utils


def _megatron_rosters(utils, shape, s, d, world: int) -> list:
    """Each rank's (source, destination) ``ParameterMetadata`` lists, as its all-gather has them."""
    import torch

    from torchrefit.simulate.shapes import global_tensors

    table = {t.name: t for t in global_tensors(shape)}
    dtype = getattr(torch, shape.dtype)
    cache: dict = {}

    def metas(role, rank):
        cid = role.class_of[rank]
        if cid is None:
            return []
        groups = _groups(role.mesh, rank, cache)
        layout = role.layout(rank)
        return [_meta(utils, key, t, table[t.name], shape, dtype, rank, groups)
                for key, t in layout]

    out = []
    for rank in range(world):
        out.append((metas(s, rank), metas(d, rank)))
    return out


def _groups(mesh, rank: int, cache: dict) -> dict:
    """Megatron's process group rank lists of ``rank`` (TP fastest, then DP, then PP;
    experts: expert-TP, EP, expert-DP), deduplicated as Megatron does."""
    r = rank - mesh.offset
    per_stage = mesh.ranks // mesh.pp
    stage, e = r // per_stage, r % per_stage
    tp_i, first = r % mesh.tp, mesh.offset + stage * per_stage
    etp_i, ep_i, edp_i = e % mesh.etp, (e // mesh.etp) % mesh.ep, e // (mesh.etp * mesh.ep)
    lists = {
        "tp": [mesh.offset + r - tp_i + i for i in range(mesh.tp)],
        "dp": [first + tp_i + k * mesh.tp for k in range(mesh.dp)],
        "pp": [mesh.offset + s * per_stage + e for s in range(mesh.pp)],
        "ep": [first + edp_i * mesh.etp * mesh.ep + j * mesh.etp + etp_i for j in range(mesh.ep)],
        "etp": [first + edp_i * mesh.etp * mesh.ep + ep_i * mesh.etp + i for i in range(mesh.etp)],
    }
    return {k: cache.setdefault(tuple(v), v) for k, v in lists.items()}


def _meta(utils, key: str, t, g, shape, dtype, rank: int, groups: dict):
    expert = g.expert is not None
    return utils.ParameterMetadata(
        name=key, shape=tuple(t.local_shape), dtype=dtype if not g.dtype else _dt(g.dtype),
        element_size=2 if not g.dtype else 4, is_tp=g.group in ("tp", "etp"),
        partition_dim=g.dim, partition_stride=g.stride, is_ep=expert,
        num_experts=shape.experts or None, owner_rank=rank,
        tensor_parallel_group_ranks=groups["etp" if expert else "tp"],
        expert_parallel_group_ranks=groups["ep"] if expert else None,
        data_parallel_group_ranks=groups["dp"], pipeline_parallel_group_ranks=groups["pp"],
        resolved_name=t.name, global_expert_index=g.expert,
    )


def _dt(name: str):
    import torch
    return getattr(torch, name)


def _recv_bytes(plan, dst_meta: dict) -> int:
    """Bytes rank 0 receives or copies locally under megatron's plan."""
    by_local = {m.name: m for m in dst_meta.values()}
    total = 0
    for op in plan.recv_ops:
        m = by_local[op.param_name]
        n = 1
        for sl, size in zip(op.my_slice, m.shape):
            start, stop, _ = sl.indices(size)
            n *= stop - start
        total += n * m.element_size
    return total


def _peak_rss() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------- parent
def run_child(kind: str, args, world: int) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--world", str(world), "--model", args.model,
           "--src", args.src, "--dst", args.dst]
    if args.megatron_path:
        cmd += ["--megatron-path", args.megatron_path]
    t0 = time.time()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    got = json.loads(done.stdout.strip().splitlines()[-1])
    got["process_seconds"] = time.time() - t0
    return got


def write_markdown(results: dict) -> None:
    path = ROOT / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = _section(results)
    if MARK_BEGIN in text and MARK_END in text:
        head, rest = text.split(MARK_BEGIN, 1)
        text = head + section + rest.split(MARK_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def _section(results: dict) -> str:
    m = results["meta"]
    rows = []
    for world, r in results["worlds"].items():
        ours, meg = r["torchrefit"], r.get("megatron", {})
        rows.append(
            f"| {world} | {_s(ours)} | {_mb(ours, 'peak_rss_bytes')} | "
            f"{ours.get('metadata_bytes_per_rank', '-')} | {_s(meg)} | "
            f"{_mb(meg, 'peak_rss_bytes')} | {meg.get('metadata_bytes_per_rank', '-')} | "
            f"{_ratio(meg, ours)} | {_same(ours, meg)} |")
    return "\n".join([
        MARK_BEGIN,
        "### Planning cost against megatron-core's planner",
        "",
        f"Pure planning from gathered rosters for one rank, {m['model']} shape, "
        f"`{m['src']}` -> `{m['dst']}` collocated, measured on {m['machine']} "
        f"({m['cpus']} cores, no GPU, {m['when']}), Python {m['python']}, torch {m['torch']}, "
        f"megatron-core {m['megatron']}. torchrefit: slowest of the sampled ranks (index the rosters, "
        "validate the whole refit, plan the rank); megatron-core: `index_metadata_rosters` + "
        "`build_plan_from_rosters` (every rank replays the whole schedule, so one rank stands "
        "for all). Peak RSS is the measuring process (torch and the simulated rosters "
        "included). Metadata: bytes one rank contributes to the gather (torchrefit: its "
        "roster bytes; megatron-core: its pickled `ParameterMetadata` lists).",
        "",
        "| ranks | torchrefit s | torchrefit peak RSS | torchrefit metadata B/rank | "
        "megatron-core s | megatron-core peak RSS | megatron-core metadata B/rank | speed-up | "
        "rank 0 receives the same bytes |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |",
        *rows,
        "",
        "Reproduce: `python benchmarks/plan_scaling.py --megatron-path DIR` (see the script's "
        "docstring); figures in `benchmarks/results/cpu/plan/plan_scaling.json`. The DeepSeek-V3 "
        "figures below come from `torchrefit plan` (torchrefit only).",
        "",
        *results.get("extra", []),
        MARK_END,
    ])


def _s(r: dict) -> str:
    if "error" in r:
        return r["error"]
    return f"{r['plan_seconds']:.3f}" if "plan_seconds" in r else "-"


def _mb(r: dict, key: str) -> str:
    return f"{r[key] / 1e6:.0f} MB" if key in r else "-"


def _ratio(meg: dict, ours: dict) -> str:
    if "plan_seconds" not in meg or "plan_seconds" not in ours:
        return "-"
    return f"{meg['plan_seconds'] / ours['plan_seconds']:.0f}x"


def _same(ours: dict, meg: dict) -> str:
    if "rank0_bytes_in" not in meg:
        return "-"
    return "yes" if meg["rank0_bytes_in"] == ours["rank0_bytes_in"] else "NO"


def _presets(args) -> list[str]:
    """The two issue-3 presets through ``torchrefit plan``, as text lines for the section."""
    lines = ["| preset | layouts | plan s (slowest rank) | peak RSS | metadata B/rank | "
             "max send / mean | max send / floor |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for model, src, dst in (("llama-70b", "tp8pp4", "tp4"), ("deepseek-v3", "pp16ep64", "tp8ep8")):
        out = ROOT / "benchmarks" / "results" / f"plan_{model}.json"
        cmd = [sys.executable, "-m", "torchrefit", "plan", "--model", model, "--src", src,
               "--dst", dst, "--world", "1024", "--json", str(out)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=args.timeout)
        r = json.loads(out.read_text())
        lines.append(f"| {model} | `{src}` -> `{dst}`, 1024 ranks | {r['plan_seconds']:.3f} | "
                     f"{r['peak_rss_bytes'] / 1e6:.0f} MB | {r['metadata_bytes_per_rank']} | "
                     f"{r['max_send_over_mean']:.3f} | {r['max_send_over_floor']:.3f} |")
    lines += ["", "Reproduce: `torchrefit plan --model llama-70b --src tp8pp4 --dst tp4 --world "
              "1024 --json F` and `torchrefit plan --model deepseek-v3 --src pp16ep64 --dst tp8ep8 "
              "--world 1024 --json F`. `max send / floor`: against the least the busiest sender "
              "could send under any choice of replicas (DeepSeek-V3: each expert lives on one "
              "source rank and stages hold 3 or 4 layers, so the mean is not reachable).", ""]
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--model", default="llama-70b")
    p.add_argument("--src", default="tp8pp4")
    p.add_argument("--dst", default="tp4")
    p.add_argument("--megatron-path", default=None)
    p.add_argument("--no-megatron", action="store_true")
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--child", choices=["ours", "megatron"])
    p.add_argument("--world", type=int)
    args = p.parse_args()
    if args.child:
        fn = (child_ours(args.model, args.src, args.dst, args.world) if args.child == "ours"
              else child_megatron(args.model, args.src, args.dst, args.world, args.megatron_path))
        print(json.dumps(fn))
        return 0
    results = {"meta": _machine(args), "worlds": {}}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    for world in args.worlds:
        row = {"torchrefit": run_child("ours", args, world)}
        if not args.no_megatron:
            row["megatron"] = run_child("megatron", args, world)
        results["worlds"][str(world)] = row
        print(world, json.dumps(row), flush=True)
    results["extra"] = _presets(args)
    RESULTS.write_text(json.dumps(results, indent=1))
    write_markdown(results)
    print(f"wrote {RESULTS} and BENCHMARKS.md")
    return 0


def _machine(args) -> dict:
    import torch
    version = "not installed"
    if not args.no_megatron:
        try:
            from importlib.metadata import version as v
            version = v("megatron-core")
        except Exception:
            version = _wheel_version(args.megatron_path)
    return {"model": args.model, "src": args.src, "dst": args.dst,
            "machine": _cpu_name(),
            "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "megatron": version, "python": platform.python_version()}


def _wheel_version(path: str | None) -> str:
    if path:
        for info in Path(path).glob("megatron_core-*.dist-info"):
            return info.name.removesuffix(".dist-info").split("-")[1] + " (unpacked wheel)"
    return "unknown"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} CPU"


if __name__ == "__main__":
    sys.exit(main())
