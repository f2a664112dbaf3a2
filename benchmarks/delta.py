"""Delta refits (``Refitter(delta=...)``): real RL densities, wire bytes and time against a
full refit in the same run, and on a GPU the diff, encode and apply cost against the copy
floor. One JSON row per line (``delta_density``, ``wire_bytes``, ``full_bytes``,
``delta_ms``, ``full_ms`` where they apply); see ``torchrefit.bench.delta``.

    python benchmarks/delta.py --part densities [--layers 2 --vocab 32768 | --full-size]
    python benchmarks/delta.py --part wire [--tensors 8 --rows 4096 --cols 2048 --iters 5]
                               [--kernels native|torch] [--threads 0]
    python benchmarks/delta.py --part gpu [--kernels triton,torch] [--cast]   # CUDA: one GPU
    python benchmarks/delta.py --part gpu --shape 4096,8,1024 --shape 2048,8,256   # Triton kernel shapes
    python benchmarks/delta.py --part gloo-cuda            # CUDA: 2 processes, GPU tensors, gloo
    python benchmarks/delta.py --part nccl                 # CUDA: 2 GPUs, 2 processes
    python benchmarks/delta.py --part ipc                  # CUDA: 2 processes on one GPU, CUDA IPC
    python benchmarks/delta.py --part all --json OUT       # every part this machine runs
"""

from __future__ import annotations

import argparse
import json

import torch

from torchrefit.bench import delta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", default="all", choices=["densities", "wire", "gpu", "gloo-cuda", "nccl", "ipc", "all"])
    p.add_argument("--layers", type=int, default=2, help="densities: Qwen2 layers (Qwen2-0.5B has 24)")
    p.add_argument("--vocab", type=int, default=32768, help="densities: vocabulary (Qwen2-0.5B: 151936)")
    p.add_argument("--full-size", action="store_true", help="densities: the whole Qwen2-0.5B shape")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tensors", type=int, default=8, help="wire/nccl/ipc: bf16 tensors of --rows x --cols")
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--reference", default="device", choices=["device", "host"])
    p.add_argument("--kernels", default=None,
                   help="wire: native (default: built now if missing) or torch (ops); gpu: any of triton,torch "
                        "(default both, in one run against one copy floor)")
    p.add_argument("--cast", action="store_true", help="gpu: float32 master weights into a bfloat16 wire")
    p.add_argument("--threads", type=int, default=0,
                   help="delta_threads: threads one native diff or apply uses (0, the default: torch's intra-op threads)")
    p.add_argument("--shape", action="append", default=[],
                   help="gpu: the Triton kernels with this TILE,DIFF_WARPS,CHUNK (execute.kernels.delta_blocks), "
                        "one run each; repeatable")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    rows = []
    parts = [args.part] if args.part != "all" else (
        ["densities", "wire"] + (["gpu", "gloo-cuda", "ipc"] if cuda else []) + (["nccl"] if torch.cuda.device_count() >= 2 else []))
    for part in parts:
        if part == "densities":
            got = delta.densities(args.layers, args.vocab, steps=args.steps, full=args.full_size,
                                  device="cuda" if cuda else "cpu")
        elif part == "wire":
            got = delta.wire(args.tensors, args.rows, args.cols, iters=args.iters, delta=args.reference,
                             threads=args.threads, native=(args.kernels or "native") == "native")
        elif part == "gloo-cuda":
            got = delta.wire(args.tensors, args.rows, args.cols, iters=args.iters, delta=args.reference,
                             cuda=True)
        elif part in ("nccl", "ipc"):
            got = delta.wire(args.tensors, args.rows, args.cols, iters=args.iters, delta=args.reference,
                             transport=part)
        elif args.shape:
            got = [dict(row, shape=shape) for shape in args.shape for row in _shaped(shape, args)]
        else:
            got = delta.gpu(iters=args.iters, kernels=tuple((args.kernels or "triton,torch").split(",")),
                            cast=args.cast)
        for row in got:
            print(json.dumps(row), flush=True)
        rows += got
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def _shaped(shape: str, args) -> list[dict]:
    """``delta.gpu`` with the Triton kernels in another shape (``TILE,DIFF_WARPS,CHUNK``)."""
    from torchrefit.execute.kernels import delta_blocks
    with delta_blocks.shaped(*(int(x) for x in shape.split(","))):
        return delta.gpu(iters=args.iters, kernels=("triton",), cast=args.cast)


if __name__ == "__main__":
    main()
