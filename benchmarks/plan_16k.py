"""``torchrefit plan`` at 16384 ranks, and predicted refit times beside published ones.

Runs, each in a fresh process (``python -m torchrefit plan ... --json``):

* DeepSeek-V3 ``pp16ep64`` -> ``tp8ep8`` and Llama-70B ``tp8pp4`` -> ``tp4``, collocated,
  16384 ranks: per-rank planning (slowest sampled rank, wall and CPU seconds),
  metadata every rank gathers (deduplicated, and what a full gather would be), the
  whole simulation's time, and the predicted refit time;
* two published refits, for the predictor: NeMo-RL's DeepSeek-V3 PP16 x EP16 ->
  TP32 x DP8 on 256 GPUs (collocated), and Perplexity's Kimi-K2 from 256 training
  GPUs to 128 inference GPUs (separate GPUs).

Writes ``benchmarks/results/cpu/plan/plan_16k.json`` (and each case's raw ``--json`` beside it)
and the section of BENCHMARKS.md between its markers. Usage: ``python
benchmarks/plan_16k.py``; ``--reuse`` reads cases' JSON left by earlier runs of the same
commands (e.g. run side by side).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "cpu" / "plan" / "plan_16k.json"
MARK_BEGIN = "<!-- plan_16k: begin (benchmarks/plan_16k.py writes this section) -->"
MARK_END = "<!-- plan_16k: end -->"

# name: (model, src, dst, world, published figure or None)
CASES = {
    "deepseek-v3 16k": ("deepseek-v3", "pp16ep64", "tp8ep8", 16384, None),
    "llama-70b 16k": ("llama-70b", "tp8pp4", "tp4", 16384, None),
    "nemo-rl deepseek-v3": ("deepseek-v3", "pp16ep16@0:256", "tp32@256:512", 512,
                            "NeMo-RL `nccl_reshard` (non-colocated): 2.4 - 2.8 s"),
    "nemo-rl-collocated deepseek-v3": ("deepseek-v3", "pp16ep16", "tp32", 256,
                                       "(the same layouts on 256 shared GPUs)"),
    "kimi-k2 256 -> 128": ("kimi-k2", "pp16ep16@0:256", "tp8ep16@256:384", 384,
                           "Perplexity: 1.3 s (BF16 -> FP8, RDMA WRITE)"),
}


def case_json(name: str) -> Path:
    """Where one case's ``torchrefit plan --json`` lands (kept: the raw figures)."""
    return RESULTS.parent / f"plan_16k_{name.split()[0]}_{CASES[name][3]}.json"


def case_command(name: str, samples: int) -> list[str]:
    model, src, dst, world, _ = CASES[name]
    return ["torchrefit", "plan", "--model", model, "--src", src, "--dst", dst,
            "--world", str(world), "--samples", str(samples), "--json", str(case_json(name))]


def run_case(name: str, samples: int, timeout: int, reuse: bool) -> dict:
    """Run one case (or, with ``reuse``, read the JSON an earlier run of the same
    command left, e.g. when the cases ran side by side)."""
    model, src, dst, world, published = CASES[name]
    out = case_json(name)
    cmd = case_command(name, samples)
    t0 = time.time()
    stdout = ""
    load = os.getloadavg()[0]
    reused = reuse and out.exists()
    if not reused:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        done = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True,
                              timeout=timeout, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
        stdout = done.stdout
    r = json.loads(out.read_text())
    slow = next(t for t in r["timings"] if t["rank"] == r["slowest_rank"])
    p = r["prediction"]
    return {"command": " ".join(cmd[:-2]), "process_seconds": time.time() - t0 if stdout else None,
            "published": published, "world": world, "src": r["src"], "dst": r["dst"],
            "plan_seconds": r["plan_seconds"], "plan_cpu_seconds": slow["cpu_seconds"],
            "slowest_rank": r["slowest_rank"], "ranks_timed": [t["rank"] for t in r["timings"]],
            "plan_cpu_seconds_max": max(t["cpu_seconds"] for t in r["timings"]),
            "load_before": None if reused else load,
            "load_after": None if reused else os.getloadavg()[0],
            "metadata_bytes_gathered": r["metadata_bytes_gathered"],
            "metadata_bytes_gathered_full": r["metadata_bytes_gathered_full"],
            "metadata_broadcasts": r["metadata_broadcasts"],
            "src_classes": r["src_classes"], "dst_classes": r["dst_classes"],
            "simulate_seconds": r["simulate_seconds"],
            "simulate_cpu_seconds": r["simulate_cpu_seconds"], "peak_rss_bytes": r["peak_rss_bytes"],
            "bytes_remote": r["bytes_remote"], "bytes_local": r["bytes_local"],
            "max_sent": r["max_sent"], "max_received": r["max_received"], "prediction": p,
            "stdout": stdout}


def quick(path: Path, against: str | None = None, repeats: int = 3) -> dict:
    """Without the whole-world traffic (the long part): the metadata every rank gathers at
    16384 ranks and pure planning of three ranks (CPU and wall seconds), per 16k case.

    ``against``: a git commit whose planner plans the same ranks in this process,
    interleaved with this tree's (run k of one, then run k of the other), so both see
    the same load: on a shared machine the two columns compare where absolute figures
    drift with the other jobs. Its plans must equal this tree's, field by field."""
    import gc

    from torchrefit.simulate import parse_mesh, preset, simulated_rosters
    from torchrefit.simulate.predict import Hardware
    from torchrefit.simulate.report import _metadata, time_rank

    base = _baseline(against) if against else None
    out = {"meta": dict(_machine(), load_before=os.getloadavg()[0], against=against,
                        commit=_commit("HEAD"), repeats=repeats)}
    for name in (n for n in CASES if CASES[n][3] == 16384):
        model, src, dst, w, _ = CASES[name]
        c0 = time.process_time()
        s = simulated_rosters(preset(model), parse_mesh(src, w), w)
        d = simulated_rosters(preset(model), parse_mesh(dst, w), w)
        per, g, full, _ = _metadata(s, d, w, Hardware())
        row = {"src_classes": len(s.classes), "dst_classes": len(d.classes),
               "roster_bytes_per_rank_max": per, "gathered_records": g.records,
               "gathered_rosters": g.rosters, "gathered_total": g.total, "broadcasts": g.owners,
               "full_gather": full, "setup_cpu_seconds": time.process_time() - c0, "ranks": {}}
        sb, db = s.rosters(), d.rosters()
        planners = [(time_rank, s, d)]
        if base is not None:
            planners.append((base.report.time_rank,
                             base.simulated_rosters(base.preset(model), base.parse_mesh(src, w), w),
                             base.simulated_rosters(base.preset(model), base.parse_mesh(dst, w), w)))
        for r in (0, w // 2 + 3, w - 1):
            best: list = [None] * len(planners)
            for _ in range(repeats):
                for k, (timed, ss, dd) in enumerate(planners):
                    ss.layout(r), dd.layout(r)
                    gc.collect()
                    gc.freeze()
                    tm, plan = timed(sb, db, r, w, ss.layout(r), dd.layout(r))
                    gc.unfreeze()
                    if best[k] is None or tm.cpu_seconds < best[k][0].cpu_seconds:
                        best[k] = (tm, repr(plan))
            tm = best[0][0]
            row["ranks"][r] = {"cpu_seconds": tm.cpu_seconds, "wall_seconds": tm.seconds,
                               "index_seconds": tm.index_seconds,
                               "validate_seconds": tm.validate_seconds,
                               "plan_seconds": tm.plan_seconds, "sends": tm.sends,
                               "recvs": tm.recvs}
            if base is not None:
                old = best[1][0]
                if best[1][1] != best[0][1]:
                    raise RuntimeError(f"{name} rank {r}: the plan differs from {against}'s")
                row["ranks"][r]["against"] = {"cpu_seconds": old.cpu_seconds,
                                              "wall_seconds": old.seconds, "same_plan": True}
        out[f"{model} {src}->{dst}"] = row
        print(json.dumps(row), flush=True)
    out["meta"]["load_after"] = os.getloadavg()[0]
    path.write_text(json.dumps(out, indent=1))
    return out


def _commit(ref: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref],
                          capture_output=True, text=True, check=True).stdout.strip()


def _baseline(ref: str):
    """The planner of commit ``ref`` (its ``src/torchrefit``, unpacked as package
    ``torchrefit_base`` in a temporary folder: the package imports itself relatively)."""
    import importlib
    import tempfile
    import types

    folder = Path(tempfile.mkdtemp(prefix="plan16k-"))
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src/torchrefit"],
                         capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=tar, check=True)
    (folder / "src" / "torchrefit").rename(folder / "torchrefit_base")
    sys.path.insert(0, str(folder))
    sim = importlib.import_module("torchrefit_base.simulate")
    report = importlib.import_module("torchrefit_base.simulate.report")
    return types.SimpleNamespace(simulated_rosters=sim.simulated_rosters, preset=sim.preset,
                                 parse_mesh=sim.parse_mesh, report=report)


def _quick_lines() -> list[str]:
    """The ``--quick`` run's planning figures, where one was made (planning alone, three
    ranks per case, best of three runs each: what the machine's load leaves of a core)."""
    path = RESULTS.parent / "plan_16k_metadata.json"
    q = json.loads(path.read_text()) if path.exists() else {}
    if "meta" not in q:
        return []
    m = q.pop("meta")
    ref = m.get("against")

    def cell(x: dict) -> str:
        got = f"{x['cpu_seconds']:.2f} ({x['wall_seconds']:.2f})"
        return got + (f" | {x['against']['cpu_seconds']:.2f}" if ref else "")

    rows = [f"| {name} | " + " | ".join(cell(x) for x in row["ranks"].values()) + " |"
            for name, row in q.items()]
    heads = [f"rank {r}" + (f" | rank {r} at {ref}" if ref else "")
             for r in next(iter(q.values()))["ranks"]]
    cols = len(heads) * (2 if ref else 1)
    against = (f"; beside each, CPU s of the planner at {ref}, run interleaved with it in the "
               "same process (same ranks, same load; its plans equal these field by field)"
               if ref else "")
    command = "python benchmarks/plan_16k.py --quick" + (f" --against {ref}" if ref else "")
    return [f"Planning alone (`{command}` at {m.get('commit', '?')}, {m['when']}, load "
            f"{m['load_before']:.1f} before / {m['load_after']:.1f} after; CPU s (wall s), "
            f"best of {m.get('repeats', 3)} per rank{against}):", "",
            f"| refit at 16384 ranks | {' | '.join(heads)} |",
            "| --- |" + " ---: |" * cols, *rows, ""]


def section(results: dict) -> str:
    m = results["meta"]
    big = [(n, r) for n, r in results["cases"].items() if r["world"] == 16384]
    pub = [(n, r) for n, r in results["cases"].items() if r["published"]]
    rows = [f"| {n.split()[0]} `{CASES[n][1]}` -> `{CASES[n][2]}` | {k + 1} | "
            f"{_load(x)} | {r['src_classes']} + "
            f"{r['dst_classes']} | {r['metadata_bytes_gathered'] / 1e6:.2f} MB "
            f"({r['metadata_broadcasts']} broadcasts) | {r['metadata_bytes_gathered_full'] / 1e6:.0f} MB | "
            f"{x['plan_seconds']:.3f} / {x['plan_cpu_seconds_max']:.3f} | "
            f"{x['simulate_seconds']:.0f} / {x['simulate_cpu_seconds']:.0f} | "
            f"{x['peak_rss_bytes'] / 1e9:.1f} GB | {_ms(r)} |"
            for n, r in big for k, x in enumerate(r["runs"])]
    prow = [f"| {n} | `{CASES[n][1]}` -> `{CASES[n][2]}`, {r['world']} ranks | "
            f"{r['bytes_remote'] / 1e9:.0f} GB remote, {r['bytes_local'] / 1e9:.0f} GB local | "
            f"{r['max_sent'] / 1e9:.2f} / {r['max_received'] / 1e9:.2f} GB | {_ms(r)} | "
            f"{r['published']} |" for n, r in pub]
    hw = next(iter(results["cases"].values()))["prediction"]["hardware"]
    return "\n".join([
        MARK_BEGIN,
        "### 16384 ranks, and predicted refit times",
        "",
        f"`torchrefit plan` at {m.get('commit', '?')} on {m['machine']} "
        f"({m['cpus']} cores shared with other jobs, no GPU, "
        f"{m['when']}), Python {m['python']}, torch {m['torch']}. Rosters: distinct source + "
        "destination rosters. Gathered: bytes every rank receives in the deduplicated gather "
        "(a record with two digests from every rank, then each distinct roster once, one "
        "broadcast per owner) against a gather of every rank's roster. Plan: pure planning of "
        "the slowest sampled rank from the gathered rosters (index, validate the whole refit, "
        "plan the rank), the slowest sampled rank's wall seconds / the largest CPU seconds "
        f"of the {results['samples']}+ sampled ranks; wall time counts what other jobs on the "
        "machine took. Simulate: the whole command (build the world's rosters, whole-world "
        "traffic, timed ranks, memory probe), wall / CPU seconds. Load: the 1-minute load "
        "average before / after the run (2 cores: above 2, jobs wait for a core). Each case "
        "ran in a fresh process, once per run. Predicted: see below.",
        "",
        "| refit, 16384 ranks collocated | run | load | rosters | gathered per rank | "
        "full gather would be | plan s wall / CPU | simulate s wall / CPU | peak RSS | "
        "predicted |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        "The whole-world traffic (every pair of ranks that moves bytes: 2.19 million pairs for "
        "DeepSeek-V3) is summed per holder set and destination rank in closed form from the "
        "planner's share lines (`torchrefit.simulate.traffic`; equal pair by pair to every "
        "rank's own plan, `tests/test_plan_scale.py`): about 3 CPU s of the DeepSeek-V3 run. "
        "Per-rank planning is sensitive to the load: on two hyperthreads, CPU seconds inflate "
        "with the other jobs' too. `--quick --against COMMIT` runs another commit's planner "
        "interleaved with this one, so that both columns see the same load.",
        "",
        *_quick_lines(),
        "Reproduce: `python benchmarks/plan_16k.py` (writes `benchmarks/results/cpu/plan/plan_16k.json` and "
        "this section), or one case: "
        + "; ".join(f"`{r['command']}`" for _, r in big) + ".",
        "",
        "#### Predicted refit time against published refits",
        "",
        f"`torchrefit plan` turns the plan's bytes into a time (`torchrefit.simulate.predict`): "
        f"ranks are GPUs of {hw['gpus_per_node']}-GPU nodes; a rank's time is the largest of "
        f"its send and receive terms (bytes within its node over NVLink at {hw['nvlink_gbs']:g} "
        f"GB/s, to other nodes over the network at {hw['net_gbs']:g} GB/s, each way, at once), "
        f"its busiest single link, and its local copies ({hw['copy_gbs']:g} GB/s read + "
        "written); the refit takes its slowest rank's time. Defaults: an 8-GPU H100/H200 node "
        "(NVLink 4, 900 GB/s both ways) with one 400 Gb/s NIC per GPU, i.e. DGX-H100-class "
        "hardware.",
        "",
        "| published refit | simulated as | bytes moved | busiest rank sends / receives | "
        "predicted | published |",
        "| --- | --- | ---: | ---: | ---: | --- |",
        *prow,
        "",
        "Reproduce: " + "; ".join(f"`{r['command']}`" for _, r in pub) + ".",
        "",
        *_notes(results),
        MARK_END,
    ])


def _notes(results: dict) -> list[str]:
    """The notes, with the NeMo-RL case's own figures where it ran."""
    r = results["cases"].get("nemo-rl deepseek-v3")
    if r is None:
        return [n for n in NOTES if "{nemo}" not in n]
    p = r["prediction"]["seconds"]
    nemo = (f"{p * 1e3:.0f} ms: each generation GPU receives up to {r['max_received'] / 1e9:.1f} "
            f"GB in BF16, the busiest training GPU sends {r['max_sent'] / 1e9:.1f} GB")
    gap = f"{2.4 / p:.1f} - {2.8 / p:.1f}x"
    return [n.format(nemo=nemo, nemo_gap=gap) if "{nemo}" in n else n for n in NOTES]


def _load(run: dict) -> str:
    if run["load_before"] is None:
        return "(reused)"
    return f"{run['load_before']:.1f} / {run['load_after']:.1f}"


def _ms(r: dict) -> str:
    p = r["prediction"]
    return f"{p['seconds'] * 1e3:.0f} ms ({p['slowest']['bound']}, rank {p['slowest']['rank']})"


NOTES = [
    "Where the model is optimistic, and why the published refits take longer than predicted:",
    "",
    "* It is a bandwidth floor. It has no per-message latency, no packing and unpacking of "
    "non-contiguous regions, no waiting between rounds of a bounded message-pool budget, no "
    "synchronization (the published systems barrier between mesh groups and signal "
    "completion), and it lets NVLink and the network run at full rate at once with every "
    "rank starting together.",
    "* It assumes a non-blocking network (full bisection, no congestion, one NIC per GPU at "
    "line rate); real all-to-all-like refits lose to ECMP collisions and to rails shared by "
    "the GPUs of a node.",
    "* It counts only moving bytes: the published refits also do work this plan does not "
    "model. NeMo-RL's default (colocated) path gathers and converts Megatron weights to Hugging Face names and "
    "hands them to vLLM (`load_weights`, including TP resharding inside the engine). "
    "Perplexity's reconstructs full tensors from FSDP shards (`full_tensor()`), projects "
    "and quantizes to FP8 on the sender, and writes 1 byte per parameter instead of the 2 "
    "simulated here (BF16 on the wire), so for bytes alone its floor is about half ours.",
    "* The simulated layouts are Megatron-style stand-ins: Perplexity trained Kimi-K2 with "
    "FSDP on 256 GPUs (simulated as `pp16ep16`, each GPU holding about 1/256 of the experts) "
    "and served it on 128 GPUs in a layout not given (simulated as TP8 x EP16).",
    "",
    "NeMo-RL, DeepSeek-V3 PP16 x EP16 -> TP32 x DP8: NeMo-RL reports the 2.4 - 2.8 s "
    "under NeMo-RL's `nccl_reshard` (shard to shard, Megatron -> vLLM), which NeMo-RL "
    "documents as non-colocated only, so the row simulates 256 training GPUs (ranks 0-255) "
    "and 256 generation GPUs (ranks 256-511): every byte crosses the network. The hardware "
    "behind that figure is not in the sources at hand; the row assumes what NeMo-RL's "
    "performance pages run on, DGX-H100 (8 H100 a node, NVLink 4, one 400 Gb/s NIC per GPU), "
    "which is this model's default. The prediction ({nemo}) is {nemo_gap} below the "
    "published time. Besides the floor's omissions above: `nccl_reshard` reshards the bulk "
    "FFN / expert weights shard to shard over one NCCL communicator per pipeline stage, but "
    "broadcasts the remaining weights as packed buffers, and vLLM then loads what it "
    "receives through its weight loaders; NCCL point-to-point over InfiniBand reaches less "
    "than line rate; and a GPU is assumed to send and receive at full rate at once, with "
    "all 16 stages' traffic overlapped. The collocated row puts both layouts on the same 256 "
    "GPUs (what NeMo-RL's default, colocated refit does through CUDA IPC); it has no "
    "published figure of its own.",
    "",
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=6)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--runs", type=int, default=2,
                   help="runs of each 16k case (each in a fresh process; default 2)")
    p.add_argument("--reuse", action="store_true",
                   help="read a case's JSON where a run of the same command left it")
    p.add_argument("--section-only", action="store_true",
                   help="rewrite the BENCHMARKS.md section from benchmarks/results/cpu/plan/plan_16k.json")
    p.add_argument("--quick", action="store_true",
                   help="16k metadata and three ranks' planning only (no whole-world traffic): "
                        "benchmarks/results/cpu/plan/plan_16k_metadata.json")
    p.add_argument("--against", metavar="COMMIT",
                   help="with --quick: also plan with this commit's planner, interleaved, and "
                        "check its plans are the same")
    p.add_argument("--repeats", type=int, default=3, help="with --quick: runs per rank (best)")
    args = p.parse_args()
    if args.quick:
        quick(RESULTS.parent / "plan_16k_metadata.json", args.against, args.repeats)
        _write_markdown(section(json.loads(RESULTS.read_text())))
        return 0
    if args.section_only:
        _write_markdown(section(json.loads(RESULTS.read_text())))
        return 0
    results = {"meta": dict(_machine(), commit=_commit("HEAD")), "cases": {},
               "samples": args.samples}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    for name in args.cases:
        runs = args.runs if CASES[name][3] == 16384 and not args.reuse else 1
        got = [run_case(name, args.samples, args.timeout, args.reuse) for _ in range(runs)]
        results["cases"][name] = dict(got[-1], runs=[
            {k: v for k, v in g.items() if k in RUN_KEYS} for g in got])
        print(name, json.dumps({k: v for k, v in results["cases"][name].items() if k != "stdout"}),
              flush=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    _write_markdown(section(results))
    print(f"wrote {RESULTS} and BENCHMARKS.md")
    return 0


#: what differs between runs of one case (the rest is the same plan, bit for bit)
RUN_KEYS = ("plan_seconds", "plan_cpu_seconds", "plan_cpu_seconds_max", "simulate_seconds",
            "simulate_cpu_seconds", "peak_rss_bytes", "load_before", "load_after",
            "process_seconds")


def _write_markdown(text: str) -> None:
    path = ROOT / "BENCHMARKS.md"
    doc = path.read_text()
    if MARK_BEGIN in doc and MARK_END in doc:
        head, rest = doc.split(MARK_BEGIN, 1)
        doc = head + text + rest.split(MARK_END, 1)[1]
    else:
        doc = doc.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(doc)


def _machine() -> dict:
    import torch
    name = f"{platform.machine()} CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"machine": name, "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                            time.gmtime()),
            "python": platform.python_version(), "torch": torch.__version__}


if __name__ == "__main__":
    sys.exit(main())
