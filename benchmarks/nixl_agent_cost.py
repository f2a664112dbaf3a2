"""What a NIXL agent costs to create and to register GPU memory with, in one process
(no peer): the agent's UCX backend before and after this process made its CUDA context,
a second agent in the same process, and registering ``--tensors`` GPU tensors of
``--mib`` MiB one by one and as one list.

    python benchmarks/nixl_agent_cost.py [--tensors 400 --mib 20]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=400)
    ap.add_argument("--mib", type=int, default=20)
    args = ap.parse_args()
    t = time.perf_counter()
    from nixl_cu13._api import nixl_agent, nixl_agent_config
    print(f"import {time.perf_counter() - t:.3f} s")

    def agent(name: str):
        t = time.perf_counter()
        a = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        print(f"agent {name}: {time.perf_counter() - t:.3f} s")
        return a

    agent("before-cuda")
    import torch
    t = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    print(f"cuda context {time.perf_counter() - t:.3f} s")
    a = agent("after-cuda")
    agent("third")
    xs = [torch.empty(args.mib << 20, dtype=torch.uint8, device="cuda") for _ in range(args.tensors)]
    t = time.perf_counter()
    for x in xs[: len(xs) // 2]:
        a.register_memory([(x.data_ptr(), x.nbytes, x.device.index, "")], "VRAM")
    one = time.perf_counter() - t
    t = time.perf_counter()
    a.register_memory([(x.data_ptr(), x.nbytes, x.device.index, "") for x in xs[len(xs) // 2:]], "VRAM")
    print(f"register {len(xs) // 2} x {args.mib} MiB one by one {one:.3f} s, "
          f"{len(xs) - len(xs) // 2} in one call {time.perf_counter() - t:.3f} s")


if __name__ == "__main__":
    main()
