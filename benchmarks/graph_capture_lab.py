"""What capturing a program's copies in a CUDA graph costs the host at the first refit
(issue 16's 0.2 s bound): queuing the copies on a capturing stream, ``capture_end``
(end of capture and ``cudaGraphInstantiate``, split where torch keeps the graph) and
the first replay (the graph's upload), for programs built by ``execute.local``:

- ``memcpy N``: N plain 256 KiB-1 MiB copies as memcpy nodes on the 8 branches;
- ``batched N``: the same copies in one batched-kernel node;
- ``small N``: N small copies, one ``_foreach_copy_`` group;
- ``moe``: 2000 copies of 3 MiB and 200 small ones, batched (the qwen3 shape's program)
  and as memcpy nodes (``TORCHREFIT_BATCHED_COPY=0``).

    python benchmarks/graph_capture_lab.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from torchrefit.execute.local import LANES, Copy, compile_copies
from torchrefit.execute.streams import SideStreams


def copies(n: int, elems: int, dev: torch.device) -> list[Copy]:
    return [Copy(torch.empty(elems, dtype=torch.bfloat16, device=dev),
                 torch.empty(elems, dtype=torch.bfloat16, device=dev), f"t{i}") for i in range(n)]


def timed(local, side: SideStreams, keep: bool) -> dict:
    """Seconds to queue the copies while capturing, to end the capture (and instantiate,
    unless ``keep``), to instantiate (``keep``), and of the first replay, synced."""
    dev = side.device
    graph = torch.cuda.CUDAGraph(keep_graph=True) if keep else torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device=dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    with torch.no_grad(), torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        with side.session():
            local.copy(side)
        t1 = time.perf_counter()
        graph.capture_end()
    t2 = time.perf_counter()
    if keep:
        graph.instantiate()
    t3 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize(dev)
    t4 = time.perf_counter()
    return {"queue_s": t1 - t0, "end_s": t2 - t1, "instantiate_s": t3 - t2, "first_replay_s": t4 - t3}


def case(name: str, made: list[Copy], side: SideStreams, batched: str, out: dict) -> None:
    os.environ["TORCHREFIT_BATCHED_COPY"] = batched
    local = compile_copies(made, side, cuda_graph=False)
    for keep in (False, True):
        runs = [timed(local, side, keep) for _ in range(3)]
        row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        row.update(big=len(local.big), small_groups=len(local.small),
                   batched=len(local.batch.dst) if local.batch else 0)
        label = f"{name}{' (keep_graph)' if keep else ''}"
        out[label] = row
        print(f"{label:<34} queue {1e3 * row['queue_s']:7.2f} ms  end {1e3 * row['end_s']:7.2f} ms  "
              f"instantiate {1e3 * row['instantiate_s']:7.2f} ms  first replay {1e3 * row['first_replay_s']:7.2f} ms"
              f"  (big {row['big']}, batched {row['batched']}, small groups {row['small_groups']})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    side = SideStreams(dev, LANES)
    out: dict = {}
    for n in (8, 128, 1024):
        made = copies(n, 1 << 19, dev)  # 1 MiB each: large copies
        case(f"memcpy {n}", made, side, "0", out)
        case(f"batched {n}", made, side, "1", out)
    case("small 1000", copies(1000, 1024, dev), side, "0", out)
    moe = copies(2000, 3 << 19, dev) + copies(200, 2048, dev)
    case("moe batched", moe, side, "auto", out)
    case("moe memcpy", moe, side, "0", out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "cases": out}, f,
                      indent=1)


if __name__ == "__main__":
    main()
