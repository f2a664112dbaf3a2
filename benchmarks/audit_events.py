"""Which audited events a Refitter raises, and what an ``id()`` costs in this process.

Every ``id()`` raises the audit event ``builtins.id``; each Python audit hook in the
process runs on it (filelock 4 installs one on Python >= 3.12, and megatron-core imports
filelock). This builds a preset's toy pair (hidden 64, one process, TP1 -> TP1), builds
one Refitter and refits twice after a first Refitter, counting events by name with a
hook of its own (added after the first Refitter, so a hook cannot be removed: run it
alone), and times ``id()`` before the hook.

    python benchmarks/audit_events.py --preset qwen3-30b-a3b --layers 8 [--megatron] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import sys
import timeit

import torchrefit as tr
from torchrefit.bench.world import report_and_leave, tiny_toy_pair


def id_ns(n: int = 4000) -> int:
    objs = [object() for _ in range(n)]
    return round(min(timeit.repeat(lambda: [id(o) for o in objs], number=20, repeat=5)) / 20 / n * 1e9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--megatron", action="store_true", help="megatron-core GPTModels (megatron-core installed)")
    ap.add_argument("--json")
    args = ap.parse_args()
    src, dst = tiny_toy_pair(args.preset, args.layers, 29634, megatron=args.megatron)
    tr.Refitter(src, dst).refit()
    out = {"preset": args.preset, "layers": args.layers, "megatron": args.megatron,
           "python": sys.version.split()[0], "id_ns": id_ns()}
    counts: collections.Counter = collections.Counter()
    counting = [True]

    def hook(event: str, _args) -> None:
        if counting[0]:
            counts[event] += 1

    sys.addaudithook(hook)
    r = tr.Refitter(src, dst)
    r.refit()
    r.refit()
    counting[0] = False
    r.close()
    out["events"] = dict(counts.most_common())
    report_and_leave(out, args.json)


if __name__ == "__main__":
    main()
