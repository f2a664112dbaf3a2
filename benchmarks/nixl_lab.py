"""Issue 10: where NIXL's time goes between two processes on one GPU, without torchrefit.

The nixl transport's refit of the seed's model (4.44 GB, TP1 -> TP1, 2 processes on one
H200) measured 2.5-3.9x the copy floor. This lab times NIXL alone: one sender, one
receiver, both on GPU 0, a 4.44 GB registered buffer each, and one WRITE request of the
same bytes cut into 1, 200 or 2000 descriptors (the refit posts ~200). Per iteration,
from a barrier: the sender's ``transfer()`` call, the sender seeing ``DONE`` (busy
polling ``check_xfer_state``), the receiver seeing the notification (busy polling
``get_new_notifs``); medians, against one local copy of the same bytes. UCX settings
come from the environment (``UCX_TLS``, ``UCX_CUDA_IPC_*``, ...): run it once per
setting. The receiver checks the bytes it got.

    PYTHONPATH=src python benchmarks/nixl_lab.py [--iters 20] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BYTES = 4_440_000_000 // (2000 * 16) * (2000 * 16)  # divisible by every cut below
CUTS = (1, 200, 2000)


def _worker(rank: int, port: int, iters: int, out_path: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.cuda.set_device(0)
    from nixl_cu13._api import nixl_agent, nixl_agent_config

    thread = os.environ.get("LAB_PROGRESS_THREAD", "1") != "0"
    agent = nixl_agent(f"lab-{rank}-{os.getpid()}", nixl_agent_config(enable_prog_thread=thread, backends=["UCX"]))
    if rank == 0:
        print("UCX plugin params:", agent.get_plugin_params("UCX"), flush=True)
    buf = torch.empty(BYTES, dtype=torch.uint8, device="cuda")
    if rank == 0:
        buf.copy_(torch.arange(BYTES // 8, dtype=torch.int64, device="cuda").view(torch.uint8))
    else:
        buf.zero_()
    agent.register_memory([(buf.data_ptr(), BYTES, 0, "")], "VRAM")
    torch.cuda.synchronize()
    box = [(agent.get_agent_metadata(), buf.data_ptr())]
    dist.broadcast_object_list(box, src=1)
    result: dict[str, dict] = {}
    if rank == 0:
        peer = agent.add_remote_agent(box[0][0])
        remote = box[0][1]
        other = torch.empty_like(buf)
        floor = _local_copy_ms(other, buf, iters)
        del other
        result["local copy ms"] = floor
    for cut in CUTS:
        n = BYTES // cut
        if rank == 0:
            src = agent.get_xfer_descs([(buf.data_ptr() + i * n, n, 0) for i in range(cut)], "VRAM")
            dst = agent.get_xfer_descs([(remote + i * n, n, 0) for i in range(cut)], "VRAM")
            handle = agent.initialize_xfer("WRITE", src, dst, peer, b"lab")
        post, done, got = [], [], []
        for it in range(iters + 3):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                if agent.transfer(handle, b"lab") == "ERR":
                    raise RuntimeError("transfer failed")
                t1 = time.perf_counter()
                while (state := agent.check_xfer_state(handle)) == "PROC":
                    pass
                if state != "DONE":
                    raise RuntimeError(f"transfer ended {state}")
                t2 = time.perf_counter()
                if it >= 3:
                    post.append((t1 - t0) * 1e3)
                    done.append((t2 - t0) * 1e3)
            else:
                while not any(b"lab" in m for m in agent.get_new_notifs().values()):
                    pass
                if it >= 3:
                    got.append((time.perf_counter() - t0) * 1e3)
        if rank == 0:
            handle.release()
            stats = {"post ms": statistics.median(post), "done ms": statistics.median(done),
                     "done x local copy": statistics.median(done) / floor, "done min ms": min(done)}
            print(f"{cut} descriptors of {n / 1e6:.1f} MB:", {k: round(v, 3) for k, v in stats.items()}, flush=True)
            result[f"{cut} descriptors"] = stats
        else:
            print(f"{cut} descriptors: receiver has the notification after {statistics.median(got):.3f} ms "
                  f"(median)", flush=True)
            ok = torch.equal(buf.view(torch.int64), torch.arange(BYTES // 8, dtype=torch.int64, device="cuda"))
            print(f"{cut} descriptors: bytes {'right' if ok else 'WRONG'}", flush=True)
            buf.zero_()
            torch.cuda.synchronize()
    if rank == 0 and out_path:
        result["env"] = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "LAB_"))}
        with open(out_path, "w") as fh:
            json.dump(result, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def _local_copy_ms(dst: torch.Tensor, src: torch.Tensor, iters: int) -> float:
    out = []
    for _ in range(iters + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out[3:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--json")
    args = ap.parse_args()
    mp.spawn(_worker, args=(args.port, args.iters, args.json), nprocs=2)


if __name__ == "__main__":
    main()
