"""``torchrefit bench``: time refits against the physical floor (and megatron-core).

In the manner of Megatron-LM's ``examples/rl/benchmark_refit.py``, without a
Megatron dependency: shape flags or a preset, source and destination layouts,
collocated or not, transport, warm-up and timed iterations. Prints, per
configuration and variant: bytes moved, mean / median / stddev / min-max, the
floor measured in the same run and the ratio to it, host time per refit while
the GPU is busy (warm: calls back to back; cold: the first call after the host
waited for the device), peak extra device memory and first-refit time.
``--watch manual`` times ``Refitter(watch="manual")`` (no per-refit check for replaced
tensors or moved storage); rows say which in their ``watch`` column and key.
``--stage`` adds a row per configuration timing, on one Refitter, plain refits, then
``stage()`` and the ``commit()`` after each: ``refit_ms``, ``stage_ms``, ``commit_ms``
(the engine's stall) and, on a GPU with device staging, ``commit_to_floor`` (the
commit over the copy floor of the bytes it copies).
"""

from __future__ import annotations

import json
import shlex
import sys

import torch

from .._util.format import format_bytes
from ..refitter import WATCH_MODES
from .plan import SHAPE_FLAGS

__all__ = ["add_parser", "run"]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="time refits against the copy floor (and megatron-core)")
    p.add_argument("--model", help=f"shape preset (as torchrefit plan): {', '.join(_toy_presets())}; "
                                   "default gpt-4b (megatron-core's refit benchmark model) on a GPU, a small shape on "
                                   "CPU; --layers scales a preset to fit one GPU")
    p.add_argument("--layers", metavar="N[,N...]",
                   help="transformer layers; a comma list runs several sizes")
    for flag, what in SHAPE_FLAGS.items():
        if flag != "layers":
            p.add_argument(f"--{flag}", type=int, metavar="N", help=what)
    p.add_argument("--swiglu", action=argparse_bool(), default=None, help="gated MLP (stride-2 fc1)")
    p.add_argument("--tie", action="store_true", help="tie the output layer to the embedding")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    p.add_argument("--src", default="tp1", help="source layout, e.g. tp2pp2 (default tp1)")
    p.add_argument("--dst", default="tp1", help="destination layout, e.g. tp4 (default tp1)")
    p.add_argument("--mode", default="collocated", choices=["collocated", "non-collocated"])
    p.add_argument("--transport", default="auto",
                   help="auto (the most preferred that fits), ipc, nccl, nvshmem, nixl or gloo")
    p.add_argument("--nproc", type=int, default=1, help="processes (one per GPU where there are enough)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--variant", action="append", choices=["plain", "graph", "share"],
                   help="executor variant, repeatable: plain replay, CUDA-graph replay of local "
                        "copies (GPU only), shared storage (default: plain and graph on a GPU, "
                        "plain on CPU)")
    p.add_argument("--watch", default="every", choices=WATCH_MODES,
                   help="Refitter(watch=...): every (default) checks for replaced tensors and moved "
                        "storage before each refit; manual skips that O(tensors) host work (the "
                        "bench's models never change between refits)")
    p.add_argument("--stage", action="store_true",
                   help="also time stage() and commit() against a plain refit in the same run "
                        "(refit_ms, stage_ms, commit_ms, commit_to_floor on a GPU)")
    p.add_argument("--staging", default="device", choices=["device", "host"],
                   help="with --stage: Refitter(staging=...), twins on the device (default) or in "
                        "pinned host memory")
    p.add_argument("--delta", action="store_true",
                   help="time delta refits (Refitter(delta=...)) against full refits instead: 2 processes, "
                        "non-collocated, over gloo on CPU (nccl with 2 GPUs), at 0.1/1/5/20/50%% of elements "
                        "changed, plus on a GPU the diff, encode and apply against the copy floor "
                        "(benchmarks/delta.py has every part, the real RL densities too)")
    p.add_argument("--compare", choices=["megatron-core"], help="also time megatron-core's "
                                                                 "swap_model_weights on the same models")
    p.add_argument("--map", dest="name_map", choices=["hf"],
                   help="hf: refit into a whole Hugging Face-named engine through megatron_to_hf")
    p.add_argument("--fp8", action="store_true",
                   help="with --map hf: projections and experts are float8_e4m3fn with 128x128 "
                        "block scales, quantized by the refit")
    p.add_argument("--label", default="")
    p.add_argument("--json", help="write every figure to this JSON file")
    p.add_argument("--plot", help="draw time against model size with the floor line (matplotlib)")
    p.set_defaults(run=run)


def _toy_presets() -> list[str]:
    """Presets a benchmark can build (toy and megatron-core local-spec models: no MLA,
    no mixed dense and MoE layers, no shared experts)."""
    from torchrefit.simulate.shapes import PRESETS

    return [n for n, s in PRESETS.items() if not (s.mla or s.dense_layers or s.shared_expert_ffn)]


def argparse_bool():
    import argparse
    return argparse.BooleanOptionalAction


def _spec(args, layers: int | None):
    from torchrefit.bench.config import spec_from_preset
    from torchrefit.testing import ModelSpec

    flags = {"hidden": args.hidden, "heads": args.heads, "groups": args.kv_heads, "ffn": args.ffn,
             "vocab": args.vocab, "experts": args.experts, "expert_ffn": args.expert_ffn,
             "swiglu": args.swiglu, "layers": layers, "dtype": _DTYPES[args.dtype]}
    if args.tie:
        flags["tie"] = True
    if args.heads and not args.kv_heads:
        flags["groups"] = args.heads
    name = args.model or ("gpt-4b" if torch.cuda.is_available() else None)
    if name:
        return spec_from_preset(name, **flags)
    small = dict(layers=4, hidden=512, heads=8, groups=8, ffn=2048, vocab=8192, swiglu=False,
                 bias=True, tie=False)
    small.update({k: v for k, v in flags.items() if v is not None})
    return ModelSpec(**small)


def _variants(asked: list[str] | None) -> tuple[str, ...]:
    """The executor variants to time: plain and CUDA-graph replay by default; CUDA graphs
    only exist on a GPU, so on CPU the default is plain and asking for graph is an error."""
    if not torch.cuda.is_available():
        if asked and "graph" in asked:
            raise SystemExit("torchrefit bench: --variant graph needs a CUDA GPU (local copies "
                             "are captured in a CUDA graph); none is present")
        return tuple(asked or ["plain"])
    return tuple(asked or ["plain", "graph"])


def run(args) -> int:
    from torchrefit.bench import BenchConfig, run_bench

    if args.delta:
        return _run_delta(args)
    sizes = [int(x) for x in args.layers.split(",")] if args.layers else [None]
    variants = _variants(args.variant)
    rows = []
    for layers in sizes:
        cfg = BenchConfig(spec=_spec(args, layers), src=args.src, dst=args.dst, mode=args.mode,
                          transport=args.transport, nproc=args.nproc, warmup=args.warmup,
                          iters=args.iters, variants=variants, compare=args.compare, label=args.label,
                          name_map=args.name_map, fp8=args.fp8, watch=args.watch, stage=args.stage,
                          staging=args.staging)
        got = run_bench(cfg)
        _print(cfg, got)
        rows.extend(got)
    if args.json:
        with open(args.json, "w") as f:
            argv = sys.argv[1:]
            argv = argv[1:] if argv[:1] == ["bench"] else argv
            json.dump({"command": "torchrefit bench " + shlex.join(argv), "configs": rows}, f,
                      indent=1, default=str)
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _run_delta(args) -> int:
    from torchrefit.bench import delta

    two_gpus = torch.cuda.device_count() >= 2
    rows = delta.wire(iters=args.iters if args.iters != 30 else 5, transport="nccl" if two_gpus else "gloo")
    if torch.cuda.is_available():
        rows += delta.gpu(iters=10)
    print(f"{'part':12} {'changed':>8} {'wire':>10} {'full':>10} {'wire/full':>9} {'delta ms':>9} {'full ms':>9}")
    for r in rows:
        part = r["part"] + (f"/{r['kernels']}" if "kernels" in r else "")  # gpu/triton, gpu/torch
        print(f"{part:12} {r['delta_density']:8.1%} {format_bytes(r['wire_bytes']):>10} "
              f"{format_bytes(r['full_bytes']):>10} {r['wire_bytes'] / r['full_bytes']:9.3f} "
              f"{r['delta_ms']:9.2f} {r['full_ms']:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "torchrefit bench --delta", "rows": rows}, f, indent=1, default=str)
    return 0


def _num(spec: str, suffix: str = ""):
    return lambda x: "-" if x is None else f"{x:{spec}}{suffix}"


# (header, width, the row's value, how to write it); a column every row leaves empty is
# not printed (CPU runs have no host-time split, runs without --compare no megatron ratio)
_COLUMNS = (
    ("impl", -14, lambda r: r["impl"], str),
    ("variant", -20, lambda r: r["variant"], str),
    ("transport", -10, lambda r: r["transport"], str),
    ("watch", -7, lambda r: r.get("watch"), str),
    ("local", 11, lambda r: r.get("bytes_local"), format_bytes),
    ("remote", 11, lambda r: r.get("bytes_remote"), format_bytes),
    ("median ms", 10, lambda r: r["median_ms"], _num(".2f")),
    ("mean ms", 9, lambda r: r["mean_ms"], _num(".2f")),
    ("sd ms", 7, lambda r: r["stddev_ms"], _num(".2f")),
    ("min-max ms", 14, lambda r: (r["min_ms"], r["max_ms"]), lambda v: f"{v[0]:.2f}-{v[1]:.2f}"),
    ("floor ms", 9, lambda r: r.get("floor_ms"), _num(".2f")),
    ("vs floor", 9, lambda r: r.get("ratio_to_floor"), _num(".3f", "x")),
    ("vs mcore", 9, lambda r: r.get("ratio_to_megatron"), _num(".3f", "x")),
    ("refit ms", 9, lambda r: r.get("refit_ms"), _num(".2f")),
    ("stage ms", 9, lambda r: r.get("stage_ms"), _num(".2f")),
    ("commit ms", 10, lambda r: r.get("commit_ms"), _num(".3f")),
    ("refit/commit", 13, lambda r: r.get("refit_over_commit"), _num(".1f", "x")),
    ("commit/floor", 13, lambda r: r.get("commit_to_floor"), _num(".3f", "x")),
    ("host ms", 8, lambda r: r.get("host_ms"), _num(".3f")),
    ("cold ms", 8, lambda r: r.get("host_cold_ms"), _num(".3f")),
    ("first s", 8, lambda r: r["first_refit_s"], _num(".3f")),
    ("peak", 10, lambda r: r.get("peak_extra_bytes"), format_bytes),
)


def _print(cfg, rows: list[dict]) -> None:
    r0 = rows[0]
    bandwidth = r0["copy_bandwidth_gbs"]
    print(f"\n{r0['label']}: {r0['params']:,} parameters ({format_bytes(r0['model_bytes'])}), "
          f"{cfg.nproc} process(es), {r0['device']}, copy bandwidth "
          f"{'-' if bandwidth is None else f'{bandwidth:.0f} GB/s'}, warmup {cfg.warmup}, "
          f"iters {cfg.iters}")
    shown = [c for c in _COLUMNS if any(c[2](r) is not None for r in rows)]
    versus = ", vs mcore: over megatron-core's median" if any(
        c[0] == "vs mcore" for c in shown) else ""
    print("  floor: the bytes moved at the copy bandwidth measured in this run; vs floor: the "
          f"median over the floor{versus}")
    print("".join(f"{h:<{-w}}" if w < 0 else f"{h:>{w}}" for h, w, _, _ in shown))
    for r in rows:
        cells = [(fmt(get(r)) if get(r) is not None else "-", w) for _, w, get, fmt in shown]
        print("".join(f"{v:<{-w}}" if w < 0 else f"{v:>{w}}" for v, w in cells))


def _watch_suffix(row: dict) -> str:
    """" watch=manual" for rows refitted without the per-refit checks, else nothing."""
    return " watch=manual" if row.get("watch") == "manual" else ""


def _plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'torchrefit[bench]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list] = {}
    for r in rows:
        series.setdefault(f"{r['impl']} {r['variant']}{_watch_suffix(r)}", []).append((r["params"] / 1e9, r["median_ms"]))
    for name, pts in series.items():
        pts.sort()
        ax.plot(*zip(*pts), marker="o", label=name)
    floor = sorted({(r["params"] / 1e9, r["floor_ms"]) for r in rows if r.get("floor_ms")})
    if floor:
        ax.plot(*zip(*floor), "k--", label="copy floor")
    ax.set_xlabel("model parameters (billions)")
    ax.set_ylabel("median refit time (ms)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
