"""Construction and first refit of a qwen3-30b-a3b-shaped toy pair (8 layers: 4182
tensors, 3151 modules per model) on CPU, tiny dims, one gloo process: the host work
of building a Refitter for a model of thousands of tensors, without a GPU. Prints the
best of ``--reps`` CPU seconds. Compare two trees interleaved (same load)::

    git archive OLD src | tar -x -C /tmp/old
    for i in 1 2 3; do PYTHONPATH=/tmp/old/src python benchmarks/construction_cpu.py --label OLD
                       PYTHONPATH=src python benchmarks/construction_cpu.py --label new; done
"""

from __future__ import annotations

import argparse
import os
import time

import torch.distributed as dist

import torchrefit as tr
from torchrefit.bench.config import spec_from_preset
from torchrefit.testing import Mesh, build_toy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    spec = spec_from_preset("qwen3-30b-a3b", layers=8, hidden=64, heads=4, groups=2, ffn=64, vocab=128,
                            expert_ffn=16)
    src, dst = (build_toy(spec, Mesh(1, ranks=1), 0, s, device="cpu", random_init=True) for s in (1, 2))
    tr.Refitter(src, dst).refit()  # imports and first-use costs out of the figures
    built, first = [], []
    for _ in range(args.reps):
        t0 = time.process_time()
        r = tr.Refitter(src, dst)
        built.append(time.process_time() - t0)
        r.refit()
        first.append(time.process_time() - t0)
    print(f"{args.label}: construction {min(built):.3f} CPU s, construction + first refit {min(first):.3f} CPU s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
