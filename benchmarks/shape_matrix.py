"""The model-shape matrix on one GPU (issue 16): every preset refit TP1 -> TP1 by
torchrefit (CUDA graph, the default) and by megatron-core's ``swap_model_weights``
side by side, on the same megatron-core ``GPTModel``s (toy models where megatron-core
is not installed), against the copy floor measured in the same run.

Shapes: the seed's ``gpt-4b``, ``llama-8b``, ``dense-0.5b`` and the MoE stacks
``qwen3-30b-a3b`` and ``deepseek-v3-moe`` with their layers scaled down so that two
models (source and destination) fit one H200 next to each other.

Run (GPU machine, megatron-core importable)::

    python benchmarks/shape_matrix.py --json benchmarks/results/h200/h200_shape_matrix.json
    python benchmarks/shape_matrix.py --batched --json F  # with the opt-in batched-copy kernel
    python benchmarks/shape_matrix.py --no-megatron --only dense-0.5b --json F  # toy models, one preset
    python benchmarks/shape_matrix.py --report benchmarks/results/h200/h200_shape_matrix.json

The second form writes the table into BENCHMARKS.md (between the ``shape_matrix``
markers). ``--smoke`` runs tiny versions of the shapes on CPU (the plumbing only).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
import traceback
from pathlib import Path

import torch

#: (preset, layers on one GPU or None for the preset's own)
MATRIX = [
    ("qwen3-30b-a3b", 8),
    ("deepseek-v3-moe", 2),
    ("dense-0.5b", None),
    ("llama-8b", None),
    ("gpt-4b", None),
]
TARGET = 1.03  # x the copy floor (issue 16)
BEGIN, END = "<!-- shape_matrix: begin", "<!-- shape_matrix: end -->"


def _config(name: str, layers: int | None, args):
    from torchrefit.bench import BenchConfig
    from torchrefit.bench.config import spec_from_preset
    from torchrefit.bench.megatron_models import megatron_available

    if args.smoke:  # tiny shapes on CPU: the plumbing only
        spec = spec_from_preset(name, layers=1, hidden=64, heads=4, groups=2, ffn=128, vocab=256,
                                experts=4 if "moe" in name or "a3b" in name else None,
                                expert_ffn=32, dtype=torch.float32)
    else:
        spec = spec_from_preset(name, layers=layers)
    compare = ("megatron-core" if (torch.cuda.is_available() and megatron_available() and not args.no_megatron)
               else None)
    label = name + (f" ({layers} layers)" if layers else "")
    return BenchConfig(spec=spec, transport="nccl" if torch.cuda.is_available() else "gloo",
                       warmup=args.warmup, iters=args.iters, variants=("graph",), compare=compare,
                       label=label)


def run(args) -> None:
    from torchrefit.bench import run_bench
    from torchrefit.execute.batched import kernel_available

    if args.batched:  # read when each program compiles, also in the bench's worker processes
        os.environ["TORCHREFIT_BATCHED_COPY"] = "1"
    cuda = torch.cuda.is_available()
    out = {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
           "torch": torch.__version__, "target_x_floor": TARGET,
           "batched_copy": cuda and kernel_available(torch.device("cuda")), "shapes": []}
    for name, layers in MATRIX:
        if args.only and name not in args.only:
            continue
        cfg = _config(name, layers, args)
        t0 = time.perf_counter()
        try:
            rows = run_bench(cfg)
            entry = {"preset": name, "layers": cfg.spec.layers, "rows": rows}
        except Exception:  # one shape failing (memory) must not lose the others
            entry = {"preset": name, "layers": cfg.spec.layers, "error": traceback.format_exc()}
        entry["seconds"] = time.perf_counter() - t0
        out["shapes"].append(entry)
        print(_line(entry), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1, default=str))


def _line(entry: dict) -> str:
    if "error" in entry:
        return f"{entry['preset']}: FAILED\n{entry['error']}"
    t, m = _rows(entry)
    meg = f", megatron-core {m['median_ms']:.2f} ms = {m['ratio_to_floor']:.2f}x" if m else ""
    return (f"{t['label']}: {t['params'] / 1e9:.2f} B, torchrefit {t['median_ms']:.3f} ms = "
            f"{t['ratio_to_floor'] or 0:.3f}x floor {t['floor_ms'] or 0:.3f} ms, host {t['host_ms'] or 0:.3f} ms "
            f"warm, first {t['first_refit_s']:.3f} s{meg} ({entry['seconds']:.0f} s)")


def _rows(entry: dict):
    rows = entry["rows"]
    t = next(r for r in rows if r["impl"] == "torchrefit")
    m = next((r for r in rows if r["impl"] == "megatron-core"), None)
    return t, m


def table(data: dict, source: str) -> str:
    head = ("| shape | params | torchrefit ms | x floor | floor ms | host ms (warm) | first refit s "
            "| megatron-core ms | x floor | torchrefit / megatron |\n" + "|---" * 10 + "|")
    lines = [head]
    for e in data["shapes"]:
        if "error" in e:
            lines.append(f"| {e['preset']} ({e['layers']} layers) | failed: see the JSON |" + " |" * 8)
            continue
        t, m = _rows(e)
        def f(x, spec=".2f"):
            return "-" if x is None else format(x, spec)
        lines.append(
            f"| {e['preset']} ({e['layers']} layers) | {t['params'] / 1e9:.2f} B | {f(t['median_ms'])} "
            f"| **{f(t['ratio_to_floor'], '.3f')}** | {f(t['floor_ms'])} | {f(t['host_ms'], '.3f')} "
            f"| {f(t['first_refit_s'], '.3f')} | {f(m and m['median_ms'])} "
            f"| {f(m and m['ratio_to_floor'])} | {f(t.get('ratio_to_megatron'), '.3f')} |")
    models = "megatron-core GPTModels (local spec)" if any(
        "megatron_median_ms" in r for e in data["shapes"] if "rows" in e for r in e["rows"]) else "toy models"
    return (f"{BEGIN} (benchmarks/shape_matrix.py writes this section) -->\n"
            f"### Model shapes on one GPU (issue 16)\n\n"
            f"{data['device']}, torch {data['torch']}; TP1 -> TP1 collocated, bf16, {models}, "
            f"torchrefit with its defaults (CUDA graph), both on the same models in the same "
            f"process; figures from `{source}`. Target: <= {TARGET}x the floor.\n\n"
            + "\n".join(lines) + f"\n\n{END}")


def report(path: str, bench_md: Path) -> None:
    data = json.loads(Path(path).read_text())
    text = bench_md.read_text()
    section = table(data, path)
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    bench_md.write_text(text)
    print(section)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--report", help="write the table of this JSON into BENCHMARKS.md")
    ap.add_argument("--benchmarks-md", default=str(Path(__file__).resolve().parents[1] / "BENCHMARKS.md"))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (plumbing check)")
    ap.add_argument("--only", action="append", help="run only this preset (repeatable)")
    ap.add_argument("--no-megatron", action="store_true", help="torchrefit only")
    ap.add_argument("--batched", action="store_true",
                    help="with the opt-in batched-copy kernel (TORCHREFIT_BATCHED_COPY=1)")
    args = ap.parse_args()
    if args.report:
        report(args.report, Path(args.benchmarks_md))
    else:
        run(args)


if __name__ == "__main__":
    main()
