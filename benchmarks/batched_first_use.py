"""What the batched-copy kernel adds to a process's first refit (issue 16's 0.2 s bound):
importing Triton, and compiling and loading the kernel, with Triton's on-disk cache
empty (the first process on a machine) or filled (every later one).

Run on a GPU machine, twice with the same fresh cache directory::

    export TRITON_CACHE_DIR=$(mktemp -d)
    python benchmarks/batched_first_use.py --json cold.json   # empty cache: compiles
    python benchmarks/batched_first_use.py --json warm.json   # the cache filled by the first
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.zeros(1, device="cuda")  # CUDA context outside the timings
    t0 = time.perf_counter()
    import triton  # noqa: F401

    t1 = time.perf_counter()
    from torchrefit.execute.batched import compile_batch

    src = torch.randn(1 << 20, device="cuda").to(torch.bfloat16)
    dst = torch.zeros_like(src)
    t2 = time.perf_counter()
    batch = compile_batch([(dst, src, "x")], torch.device("cuda"))
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    batch.launch()
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    out = {"cache_dir_files": sum(len(f) for _, _, f in os.walk(os.environ.get("TRITON_CACHE_DIR", "/nonexistent"))),
           "import_triton_s": t1 - t0, "compile_batch_s": t3 - t2, "next_launch_s": t4 - t3,
           "exact": bool(torch.equal(dst, src))}
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
