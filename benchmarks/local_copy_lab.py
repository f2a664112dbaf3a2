"""Local-copy lab (one GPU): where does a collocated refit lose time against the copy floor?

Builds the seed model's source and destination (random bf16, TP1), then measures on the
device (median of ``--iters``, device idle before each): the flat-copy floor, torchrefit's
plain and CUDA-graph programs, graphs whose large copies run on 2 or 4 parallel branches,
and a Triton kernel that copies every region in 1 MiB chunks in one launch. It also times
the host side of each piece while the GPU is busy. Prints one table; ``--json`` keeps it.
"""

from __future__ import annotations

import argparse
import json

import torch

import torchrefit as tr
from torchrefit.bench.config import spec_from_preset
from torchrefit.bench.timing import copy_bandwidth, median_host_ms, median_ms, sleep_cycles_per_ms
from torchrefit.bench.world import one_gpu_world
from torchrefit.testing import Mesh, build_toy


def device_ms(fn, iters: int) -> float:
    return median_ms(fn, iters, torch.device("cuda"))


def host_ms(fn, iters: int, cycles_per_ms: float) -> float:
    return median_host_ms(fn, iters, torch.device("cuda"), cycles_per_ms)[0]  # warm


def branch_graph(big, small_dst, small_src, branches: int) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cap = torch.cuda.current_stream()
        side = [torch.cuda.Stream() for _ in range(branches)]
        for s in side:
            s.wait_stream(cap)
        for i, (d, s_, _) in enumerate(big):
            with torch.cuda.stream(side[i % branches]):
                d.copy_(s_)
        if small_dst:
            torch._foreach_copy_(small_dst, small_src)
        for s in side:
            cap.wait_stream(s)
    return g


def triton_copier(pairs, chunk_bytes: int, hint: bool):
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(table, BLOCK: tl.constexpr, HINT: tl.constexpr):
        pid = tl.program_id(0)
        src = tl.load(table + pid * 3).to(tl.pointer_type(tl.int64))
        dst = tl.load(table + pid * 3 + 1).to(tl.pointer_type(tl.int64))
        n = tl.load(table + pid * 3 + 2)
        if HINT:
            src = tl.multiple_of(src, 16)
            dst = tl.multiple_of(dst, 16)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(dst + offs, tl.load(src + offs))

    block = 1024
    rows, rest = [], []
    step = chunk_bytes // 8 // block * block
    for d, s in pairs:
        nbytes = d.numel() * d.element_size()
        whole = nbytes // (8 * block) * block  # int64 elements in whole blocks
        if d.data_ptr() % 16 or s.data_ptr() % 16 or whole == 0:
            rest.append((d, s))
            continue
        for lo in range(0, whole, step):
            n = min(step, whole - lo)
            rows.append((s.data_ptr() + 8 * lo, d.data_ptr() + 8 * lo, n))
        tail = nbytes - 8 * whole
        if tail:
            rest.append((d.view(-1).view(torch.uint8)[nbytes - tail:], s.view(-1).view(torch.uint8)[nbytes - tail:]))
    table = torch.tensor(rows, dtype=torch.int64, device="cuda").view(-1)
    grid = (len(rows),)

    def run():
        kernel[grid](table, BLOCK=block, HINT=hint, num_warps=8)
        for d, s in rest:
            d.copy_(s)
    return run, len(rows), len(rest)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    one_gpu_world(29533)
    spec = spec_from_preset("gpt-4b", layers=args.layers)
    src = build_toy(spec, Mesh(1, ranks=1), 0, 1, device="cuda", random_init=True)
    dst = build_toy(spec, Mesh(1, ranks=1), 0, 2, device="cuda", random_init=True)
    bw = copy_bandwidth(torch.device("cuda"))
    cycles = sleep_cycles_per_ms(torch.device("cuda"))
    rows = {}
    plain = tr.Refitter(src, dst, cuda_graph=False)
    plain.refit()
    prog = plain._program
    small_dst = [d for g in prog.local.small for d in g.dst]
    small_src = [s for g in prog.local.small for s in g.src]
    nbytes = plain.plan.bytes_local
    floor = 2 * nbytes / bw * 1e3
    flat = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    rows["flat copy (one tensor)"] = (device_ms(lambda: flat[1].copy_(flat[0]), args.iters), None)
    flat.clear()
    rows["eager refit() (cuda_graph=False)"] = (device_ms(plain.refit, args.iters), host_ms(plain.refit, args.iters, cycles))
    rows["  _check_storage"] = (None, host_ms(prog.check_storage, args.iters, cycles))
    rows["  big copy_ loop"] = (device_ms(lambda: [d.copy_(s) for d, s, _ in prog.local.big], args.iters),
                                host_ms(lambda: [d.copy_(s) for d, s, _ in prog.local.big], args.iters, cycles))
    rows["  small foreach"] = (device_ms(lambda: torch._foreach_copy_(small_dst, small_src), args.iters),
                               host_ms(lambda: torch._foreach_copy_(small_dst, small_src), args.iters, cycles))
    graph = tr.Refitter(src, dst, cuda_graph=True)
    graph.refit()
    rows["graph refit()"] = (device_ms(graph.refit, args.iters), host_ms(graph.refit, args.iters, cycles))
    g = graph._program.local.graph
    rows["  graph.replay only"] = (device_ms(g.replay, args.iters), host_ms(g.replay, args.iters, cycles))
    for b in (2, 4):
        gb = branch_graph(prog.local.big, small_dst, small_src, b)
        rows[f"graph, {b} branches"] = (device_ms(gb.replay, args.iters), host_ms(gb.replay, args.iters, cycles))
    pairs = [(d, s) for d, s, _ in prog.local.big] + list(zip(small_dst, small_src))
    for chunk in (1 << 20, 4 << 20):
        for hint in (False, True):
            try:
                run, n, rest = triton_copier(pairs, chunk, hint)
                for d, _s in pairs:
                    d.zero_()
                run()
                torch.cuda.synchronize()
                ok = all(torch.equal(d, s) for d, s in pairs)
                rows[f"triton {chunk >> 20} MiB chunks hint={hint} ({n} chunks, {rest} rest, ok={ok})"] = (
                    device_ms(run, args.iters), host_ms(run, args.iters, cycles))
            except Exception as e:  # keep the lab going
                rows[f"triton {chunk >> 20} MiB hint={hint} FAILED {type(e).__name__}: {str(e)[:120]}"] = (None, None)
    print(f"\nlocal bytes {nbytes / 1e9:.2f} GB, {len(prog.local.big)} large + {len(small_dst)} small copies, "
          f"copy bandwidth {bw / 1e9:.0f} GB/s, floor {floor:.3f} ms")
    print(f"{'what':<72}{'device ms':>10}{'x floor':>9}{'host ms':>9}")
    for k, (dev, host) in rows.items():
        print(f"{k:<72}{'-' if dev is None else f'{dev:.3f}':>10}{'-' if dev is None else f'{dev / floor:.3f}':>9}"
              f"{'-' if host is None else f'{host:.3f}':>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"floor_ms": floor, "bandwidth_gbs": bw / 1e9, "bytes": nbytes,
                       "rows": {k: {"device_ms": d, "host_ms": h} for k, (d, h) in rows.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
