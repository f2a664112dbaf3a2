"""What ``watch="every"`` costs per refit, and what cheaper forms of the same check cost:
one process, a preset's toy model (TP1 -> TP1), the check's parts timed alone (host
microseconds, min over repeats; nothing else runs).

* ``bindings``: ``Binding.changed`` on both sides (is each described tensor still the one
  its module holds: ``dict.get`` and ``is`` per tensor);
* ``pointers_map``: ``Program.storage_moved`` as on main (``data_ptr`` per watched tensor
  in a ``map``, a list compared);
* ``pointers_c``: the same answer from ``torch._C._tensors_data_ptrs_at_indices_equal``
  (one C++ loop; in CUDA builds only), when present.

    python benchmarks/watch_check_lab.py --preset qwen3-30b-a3b --layers 8 [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import timeit

import torch
import torch.distributed as dist

import torchrefit as tr
from torchrefit.bench.config import spec_from_preset
from torchrefit.testing import Mesh, build_toy


def best_us(fn, number: int = 50, repeat: int = 9) -> float:
    return round(min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29633")
    dist.init_process_group("gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    spec = spec_from_preset(args.preset, layers=args.layers, hidden=64, ffn=64, expert_ffn=32, vocab=512,
                            heads=4, groups=2)
    src, dst = (build_toy(spec, Mesh(1, ranks=1), 0, seed, device=device, random_init=True) for seed in (1, 2))
    r = tr.Refitter(src, dst)
    r.refit()
    program = r._program
    watched = list(program.compiled.watched)
    pointers = list(program.compiled.pointers)
    out = {"preset": args.preset, "layers": args.layers, "device": str(device), "watched": len(watched),
           "bound": sum(len(b) for b in r._bindings.values()),
           "bindings_us": best_us(r._rebind), "pointers_map_us": best_us(program.storage_moved)}
    c_check = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if c_check is not None:
        every = list(range(len(watched)))
        assert c_check(watched, pointers, every)
        out["pointers_c_us"] = best_us(lambda: c_check(watched, pointers, every))
    out["manual_refit_host_us"] = best_us(lambda: program.run(False), number=20)
    print(" ".join(f"{k}={v}" for k, v in out.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
