"""The refit matrix on one GPU: every preset refit TP1 -> TP1 by
torchrefit (CUDA graph, the default) and by megatron-core's ``swap_model_weights``
side by side, on the same megatron-core ``GPTModel``s (toy models where megatron-core
is not installed), against the copy floor measured in the same run.

Shapes: ``gpt-4b`` (a 4.4 B GPT), ``llama-8b``, ``dense-0.5b`` and the MoE stacks
``qwen3-30b-a3b`` and ``deepseek-v3-moe`` with their layers scaled down so that two
models (source and destination) fit one H200 next to each other.

Run (GPU machine, megatron-core importable)::

    python benchmarks/shape_matrix.py --json benchmarks/results/h200/matrix/shape_matrix.json
    python benchmarks/shape_matrix.py --also-toy --json F  # and torchrefit on toy models of each shape
    python benchmarks/shape_matrix.py --batched --json F  # every plain aligned copy batched (settings batched_copy="all")
    python benchmarks/shape_matrix.py --no-megatron --only dense-0.5b --json F  # toy models, one preset
    python benchmarks/shape_matrix.py --watch-manual-too --json F  # toy rows also with Refitter(watch="manual")
    python benchmarks/shape_matrix.py --layers deepseek-v3-moe=1 --json F  # another layer count (an H100's memory)
    python benchmarks/shape_matrix.py --report benchmarks/results/h200/matrix/shape_matrix.json

The last form prints the BENCHMARKS.md table of a JSON file. ``--smoke`` runs tiny versions of the shapes on CPU (the plumbing only).
"""

from __future__ import annotations

import argparse
import json
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
TARGET = 1.03  # x the copy floor: the matrix's bar for a refit of local copies


def _config(name: str, layers: int | None, args, toy: bool = False, watch: str = "every"):
    from torchrefit import settings
    from torchrefit.bench import BenchConfig
    from torchrefit.bench.config import spec_from_preset
    from torchrefit.bench.megatron_models import megatron_available

    if args.smoke:  # tiny shapes on CPU: the plumbing only
        spec = spec_from_preset(name, layers=1, hidden=64, heads=4, groups=2, ffn=128, vocab=256,
                                experts=4 if "moe" in name or "a3b" in name else None,
                                expert_ffn=32, dtype=torch.float32)
    else:
        spec = spec_from_preset(name, layers=layers)
    compare = ("megatron-core" if (torch.cuda.is_available() and megatron_available() and not args.no_megatron
                                   and not toy) else None)
    label = name + (f" ({layers} layers)" if layers else "") + (" watch=manual" if watch == "manual" else "")
    return BenchConfig(spec=spec, transport="nccl" if torch.cuda.is_available() else "gloo",
                       warmup=args.warmup, iters=args.iters, variants=("graph",), compare=compare,
                       label=label, watch=watch, settings=settings.current())


def run(args) -> None:
    from torchrefit import settings
    from torchrefit.bench.megatron_models import megatron_available
    from torchrefit.execute.batched import kernel_available

    if args.batched:  # the bench's rank processes take these settings from each BenchConfig
        settings.configure(batched_copy="all")
    cuda = torch.cuda.is_available()
    out = {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
           "torch": torch.__version__, "target_x_floor": TARGET,
           "batched_copy": cuda and kernel_available(torch.device("cuda")), "shapes": []}
    megatron = cuda and megatron_available() and not args.no_megatron
    layers_of = _layer_counts(args.layers or [])
    for name, layers in MATRIX:
        if args.only and name not in args.only:
            continue
        layers = layers_of.get(name, layers)
        # --watch-manual-too: toy models both ways (with megatron-core, its rows come first)
        toys = (False, True) if (args.also_toy or args.watch_manual_too) and megatron else (False,)
        runs = [(toy, "every") for toy in toys]
        if args.watch_manual_too:  # the same toy models' host time without the per-refit checks
            runs.append((True, "manual"))
        for toy, watch in runs:
            cfg = _config(name, layers, args, toy, watch)
            out["shapes"].append(_run_one(name, cfg, toy or args.no_megatron))
            print(_line(out["shapes"][-1]), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(out, indent=1, default=str))


def _layer_counts(given: list[str]) -> dict[str, int]:
    """``--layers PRESET=N`` arguments as {preset: N}; a malformed one or an unknown preset
    stops the run before any model is built."""
    out = {}
    names = {name for name, _ in MATRIX}
    for arg in given:
        name, _, n = arg.partition("=")
        if name not in names or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--layers {arg!r}: expected PRESET=N with N >= 1 and PRESET one of {sorted(names)}")
        out[name] = int(n)
    return out


def _run_one(name: str, cfg, toy: bool) -> dict:
    from torchrefit.bench import run_bench

    t0 = time.perf_counter()
    entry = {"preset": name, "layers": cfg.spec.layers,
             "models": "toy" if toy or cfg.compare is None else "megatron-core", "watch": cfg.watch}
    try:
        entry["rows"] = run_bench(cfg)
    except Exception:  # one shape failing (memory) must not lose the others
        entry["error"] = traceback.format_exc()
    entry["seconds"] = time.perf_counter() - t0
    return entry


def _line(entry: dict) -> str:
    if "error" in entry:
        return f"{entry['preset']}: FAILED\n{entry['error']}"
    t, m = _rows(entry)
    meg = f", megatron-core {m['median_ms']:.2f} ms = {m['ratio_to_floor']:.2f}x" if m else ""
    return (f"{t['label']} [{entry.get('models', '?')}]: {t['params'] / 1e9:.2f} B, torchrefit "
            f"{t['median_ms']:.3f} ms = {t['ratio_to_floor'] or 0:.3f}x floor {t['floor_ms'] or 0:.3f} ms "
            f"(device {_x(t.get('device_ratio_to_floor'))}x, {_x(t.get('ratio_to_flat_copy'))}x a flat copy of "
            f"{_x(t.get('flat_copy_ms'))} ms), host {t['host_ms'] or 0:.3f} ms warm, first "
            f"{t['first_refit_s']:.3f} s, {t.get('batched_local_copies', '?')} copies batched, large copies "
            f"{t.get('large_local_copies_as_kernels', '?')} of {t.get('large_local_copies', '?')} as kernels{meg} "
            f"({entry['seconds']:.0f} s)")


def _x(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _rows(entry: dict):
    rows = entry["rows"]
    t = next(r for r in rows if r["impl"] == "torchrefit")
    m = next((r for r in rows if r["impl"] == "megatron-core"), None)
    return t, m


COLUMNS = ("shape", "models", "params", "torchrefit ms", "x floor", "device x floor", "x flat copy",
           "floor ms", "flat copy ms", "host ms (warm)", "host ms (cold)", "first refit s", "megatron-core ms", "x floor",
           "torchrefit / megatron")


_WATCH_NOTE = (' *watch=manual*: torchrefit built with `Refitter(watch="manual")`, no per-refit check '
               "for replaced tensors or moved storage (the caller calls `rebind()`); the other rows "
               "check before every refit (the default).")


def _watch(entry: dict) -> str:
    """", watch=manual" for an entry run with ``--watch-manual-too`` (older JSONs: none)."""
    return ", watch=manual" if entry.get("watch") == "manual" else ""


def table(data: dict, source: str) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    for e in data["shapes"]:
        shape = f"{e['preset']} ({e['layers']} layers)"
        if "error" in e:
            lines.append(f"| {shape} | {e.get('models', '')}{_watch(e)} | failed: see the JSON |"
                         + " |" * (len(COLUMNS) - 3))
            continue
        t, m = _rows(e)
        models = e.get("models", "megatron-core" if m else "toy") + _watch(e)
        cells = [shape, models, f"{t['params'] / 1e9:.2f} B",
                 _x(t["median_ms"], ".2f"), f"**{_x(t['ratio_to_floor'])}**", _x(t.get("device_ratio_to_floor")),
                 _x(t.get("ratio_to_flat_copy")), _x(t["floor_ms"], ".2f"), _x(t.get("flat_copy_ms")),
                 _x(t["host_ms"]), _x(t.get("host_cold_ms")), _x(t["first_refit_s"]), _x(m and m["median_ms"], ".2f"),
                 _x(m and m["ratio_to_floor"], ".2f"), _x(t.get("ratio_to_megatron"))]
        lines.append("| " + " | ".join(cells) + " |")
    return (f"{data['device']}, torch {data['torch']}; TP1 -> TP1 collocated, bf16; torchrefit with its "
            f"defaults (CUDA graph) and megatron-core's `swap_model_weights` on the same megatron-core "
            f"GPTModels (local spec) in the same process, and torchrefit on toy models of the same shape "
            f"(*models* column); figures from `{source}`. Target: <= {TARGET}x the floor. *x floor*: wall "
            f"time per refit, device idle before each, over the copy floor (bytes read + written over a "
            f"4 GiB copy's bandwidth). *device x floor*: device time alone (each refit queued behind GPU "
            f"sleep, between two events), so without the host time that precedes the first copy. "
            f"*host ms*: host time per refit while the GPU is busy; *warm* right after another call, "
            f"*cold* the first call after the host waited for the device, as each timed refit is. "
            f"*x flat copy*: wall time over one copy of the same bytes between two flat buffers, timed "
            f"the same way (launch and synchronisation included; '-' where two more buffers do not fit)."
            f"{_WATCH_NOTE if any(_watch(e) for e in data['shapes']) else ''}\n\n"
            + "\n".join(lines))


def report(path: str) -> None:
    print(table(json.loads(Path(path).read_text()), path))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--report", help="print the BENCHMARKS.md table of this JSON")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (plumbing check)")
    ap.add_argument("--only", action="append", help="run only this preset (repeatable)")
    ap.add_argument("--no-megatron", action="store_true", help="torchrefit only")
    ap.add_argument("--layers", action="append", metavar="PRESET=N",
                    help="this many layers for PRESET instead of the matrix's (repeatable)")
    ap.add_argument("--also-toy", action="store_true",
                    help="after each megatron-core shape, torchrefit on toy models of the same shape")
    ap.add_argument("--watch-manual-too", action="store_true",
                    help="after each shape, torchrefit on toy models of it with Refitter(watch='manual') "
                         "(no per-refit tensor checks) as well as the default (implies --also-toy): "
                         "host time both ways in one run")
    ap.add_argument("--batched", action="store_true",
                    help="batch every plain aligned copy (settings batched_copy='all'; default: auto)")
    args = ap.parse_args()
    if args.report:
        report(args.report)
    else:
        run(args)


if __name__ == "__main__":
    main()
