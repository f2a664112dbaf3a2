"""``torchrefit plan``: simulate a refit at any world size on one CPU and explain it.

No processes, no GPUs, no tensors: the rosters every rank would gather are built
from a model shape and two layouts, then planned as the ranks would plan them.
Prints what moves (totals, per rank, per link, balance, local fraction), the
metadata each rank gathers, what planning costs one rank, and the refit's predicted
time on the hardware the ``--gpus-per-node``, ``--nvlink-gbs``, ``--net-gbs`` and
``--copy-gbs`` flags describe (see :mod:`torchrefit.simulate.predict`); ``--json``
and ``--heatmap`` write the same to files. Example::

    torchrefit plan --model llama-70b --src tp8pp4 --dst tp4 --world 1024
    torchrefit plan --model deepseek-v3 --src pp16ep64 --dst tp8ep8 --world 16384
    torchrefit plan --model deepseek-v3 --src pp16ep16 --dst tp32 --world 256 --net-gbs 50
    torchrefit plan --layers 32 --hidden 4096 --src tp2@0:16 --dst tp1@16:32 --world 32
"""

from __future__ import annotations

import json
import sys

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    from torchrefit.simulate.shapes import PRESETS

    p = sub.add_parser("plan", help="simulate and explain a refit plan at any world size, on CPU",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-4b",
                   help=f"shape preset: {', '.join(PRESETS)} (default gpt-4b); "
                        "the flags below override its fields")
    for flag, what in SHAPE_FLAGS.items():
        p.add_argument(f"--{flag}", type=int, default=None, metavar="N", help=what)
    p.add_argument("--dtype", default=None, help="parameter dtype, e.g. bfloat16, float32")
    p.add_argument("--src", default="tp8pp4",
                   help="source layout, e.g. tp8pp4, pp16ep64, tp2@0:512 (ranks 0-511); "
                        "default tp8pp4")
    p.add_argument("--dst", default="tp4", help="destination layout, e.g. tp4, tp8ep8; default tp4")
    p.add_argument("--world", type=int, default=1024, help="world size (default 1024)")
    p.add_argument("--samples", type=int, default=8, help="ranks whose planning is timed (default 8)")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="ranks per node for the predicted time: pairs on one node use NVLink, "
                        "others the network (default 8)")
    p.add_argument("--nvlink-gbs", type=float, default=450.0,
                   help="NVLink GB/s per GPU each way (default 450: NVLink 4, H100/H200)")
    p.add_argument("--net-gbs", type=float, default=50.0,
                   help="network GB/s per GPU each way (default 50: one 400 Gb/s NIC per GPU)")
    p.add_argument("--copy-gbs", type=float, default=4000.0,
                   help="local copy GB/s, bytes read + written (default 4000: an H200 measures 4237)")
    p.add_argument("--rank", type=int, action="append", default=[],
                   help="also print this rank's plan (repeatable)")
    p.add_argument("--explain", action="store_true",
                   help="per tensor, what the --rank ranks (default rank 0) copy, receive and "
                        "send: which region, from which rank to which, in what dtype, how "
                        "many bytes")
    p.add_argument("--tensor", action="append", default=[], metavar="NAME",
                   help="with --explain: only this global tensor (repeatable)")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    p.add_argument("--heatmap", metavar="FILE.png",
                   help="draw the rank x rank traffic matrix (needs matplotlib)")
    p.set_defaults(run=run)


#: the shape flags ``plan`` and ``bench`` share, and what each one sets
SHAPE_FLAGS = {
    "layers": "transformer layers",
    "hidden": "hidden size",
    "heads": "attention heads",
    "kv-heads": "key/value heads (query groups); default: as many as --heads",
    "ffn": "MLP width (per half of a gated MLP)",
    "vocab": "vocabulary rows of the embedding and output layer",
    "experts": "MoE experts per layer (0: dense)",
    "expert-ffn": "MLP width of one expert",
}


def _shape(args):
    from torchrefit.simulate import preset

    shape = preset(args.model)
    kw = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
          "kv_heads": args.kv_heads, "ffn": args.ffn, "vocab": args.vocab,
          "experts": args.experts, "expert_ffn": args.expert_ffn, "dtype": args.dtype}
    if args.heads is not None and args.kv_heads is None and shape.kv_heads == shape.heads:
        kw["kv_heads"] = args.heads  # a multi-head preset stays multi-head
    if args.experts and not (args.expert_ffn or shape.expert_ffn):
        kw["expert_ffn"] = args.ffn or shape.ffn
    return shape.with_overrides(**kw)


def run(args) -> int:
    from torchrefit.simulate import parse_mesh
    from torchrefit.simulate.predict import Hardware
    from torchrefit.simulate.report import simulate

    try:
        shape = _shape(args)
        src, dst = parse_mesh(args.src, args.world), parse_mesh(args.dst, args.world)
        hw = Hardware(args.gpus_per_node, args.nvlink_gbs, args.net_gbs, args.copy_gbs)
        sim = simulate(shape, src, dst, args.world, model=args.model, samples=args.samples,
                       ranks=args.rank, hardware=hw)
    except ValueError as e:
        print(f"torchrefit plan: {e}", file=sys.stderr)
        return 2
    report = sim.report
    print(f"torchrefit plan: {args.world} ranks, simulated on this CPU in "
          f"{report.simulate_seconds:.1f} s ({report.simulate_cpu_seconds:.1f} s CPU)")
    for line in report.lines():
        print("  " + line)
    for r in [] if args.explain else args.rank:
        print()
        print(sim.plan(r).summary())
    if args.explain:
        for r in args.rank or [0]:
            print()
            print(sim.plan(r).explain(args.tensor or None))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
        print(f"  wrote {args.json}")
    if args.heatmap:
        from torchrefit.simulate.heatmap import draw_heatmap
        try:
            draw_heatmap(sim.traffic, args.heatmap, f"{args.model}: {report.src} -> {report.dst}")
        except ImportError as e:
            print(f"torchrefit plan: {e}", file=sys.stderr)
            return 2
        print(f"  wrote {args.heatmap}")
    return 0

