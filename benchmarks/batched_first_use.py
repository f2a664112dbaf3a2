"""What the batched-copy kernel adds to a process's first refit (issue 16's 0.2 s bound):
finding NVRTC, compiling the kernel for this GPU and loading it (``execute.copy_kernel``),
or reading the image an earlier process left in the disk cache (``execute.kernel_cache``),
then a second batch in the same process (nothing compiled again) and one launch.

    export TORCHREFIT_KERNEL_CACHE=$(mktemp -d)
    python benchmarks/batched_first_use.py --json cold.json   # compiles, files the image
    python benchmarks/batched_first_use.py --json warm.json   # reads it back
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.zeros(1, device="cuda")  # CUDA context outside the timings
    from torchrefit.execute.batched import compile_batch

    src = torch.randn(1 << 20, device="cuda").to(torch.bfloat16)
    dst = torch.zeros_like(src)
    t0 = time.perf_counter()
    batch = compile_batch([(dst, src, "x")], torch.device("cuda"))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    compile_batch([(dst, src, "x")], torch.device("cuda"))
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    batch.launch()
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    out = {"first_compile_batch_s": t1 - t0, "kernel_compile_s": batch.kernel.compile_s, "from_disk_cache": batch.kernel.cached,
           "second_compile_batch_s": t2 - t1, "launch_s": t3 - t2, "exact": bool(torch.equal(dst, src))}
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
