"""Both TP halves of row-parallel weights landing in one full weight on one GPU: does the
order of the batched kernel's tiles matter? (Issue 10: ipc's collocated TP2 -> TP1 with
one copier per GPU at 1.06-1.09x the floor, the seed's 40 row-parallel halves alone at
1.10x, the same bytes contiguous at 1.06x; BENCHMARKS.md "Eleventh session".)

Every layer's ``linear_fc2`` [4096, 16384] and ``linear_proj`` [4096, 4096] is written
from two shards of half its columns. Variants, each one launch of torchrefit's batched
copy kernel (``execute.copy_kernel``) unless named otherwise, timed with the device idle
before each call (``bench.timing.median_ms``) against the copy floor (bytes read +
written at this run's 4 GiB copy bandwidth), each checked bit for bit:

1. shard by shard: every left half's rows, then every right half's (one table);
2. by destination: the same rows sorted by destination address, so each row's two
   halves are neighbouring tiles and the destination is written front to back;
3. two launches on two streams at once, one per shard (what a delegate ran until now:
   its own copies in one graph, its member's in another);
4. two launches one after the other on one stream;
5. the whole weights from contiguous sources, one launch (the same bytes, dense);
6. the whole weights, one ``copy_`` each.

    python benchmarks/halves_order_lab.py [--layers 20] [--iters 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from torchrefit.bench.timing import copy_bandwidth, median_ms
from torchrefit.execute.batched import byte_runs
from torchrefit.execute.copy_kernel import ByteRuns, TileTable, copy_kernel


def _weights(layers: int, hidden: int, ffn: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(full weight, left shard, right shard) per row-parallel weight; random bits."""
    out = []
    for _ in range(layers):
        for cols in (ffn, hidden):
            full = torch.empty(hidden, cols, dtype=torch.bfloat16, device="cuda")
            a, b = (torch.randint(-(1 << 15), 1 << 15, (hidden, cols // 2), dtype=torch.int16,
                                  device="cuda").view(torch.bfloat16) for _ in range(2))
            out.append((full, a, b))
    return out


def _by_destination(runs: ByteRuns) -> ByteRuns:
    order = torch.argsort(runs.dst, stable=True)
    return ByteRuns(*(c[order] for c in runs.columns()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json")
    args = p.parse_args()
    device = torch.device("cuda", 0)
    bandwidth = copy_bandwidth(device)
    kernel = copy_kernel(device)
    weights = _weights(args.layers, args.hidden, args.ffn)
    half = [(f[:, : a.shape[1]], a) for f, a, _ in weights], [(f[:, a.shape[1]:], b) for f, a, b in weights]
    left, right = (ByteRuns.cat([byte_runs(d, s) for d, s in side]) for side in half)
    whole = [(f, torch.cat([a, b], dim=1)) for f, a, b in weights]

    def table(runs: ByteRuns) -> TileTable:
        return kernel.tiles(runs, device)

    both, sorted_both = table(ByteRuns.cat([left, right])), table(_by_destination(ByteRuns.cat([left, right])))
    tl, tr = table(left), table(right)
    dense = table(ByteRuns.cat([byte_runs(d, s) for d, s in whole]))
    streams = [torch.cuda.Stream(device) for _ in range(2)]

    def one(t):
        return lambda: kernel.launch(t, torch.cuda.current_stream(device))

    def two_streams() -> None:
        main_stream = torch.cuda.current_stream(device)
        for s, t in zip(streams, (tl, tr)):
            s.wait_stream(main_stream)
            kernel.launch(t, s)
        for s in streams:
            main_stream.wait_stream(s)

    def one_stream() -> None:
        for t in (tl, tr):
            kernel.launch(t, torch.cuda.current_stream(device))

    variants = {"shard by shard, one launch": one(both), "by destination, one launch": one(sorted_both),
                "two launches, two streams": two_streams, "two launches, one stream": one_stream,
                "whole weights dense, one launch": one(dense),
                "whole weights, copy_ each": lambda: [f.copy_(s) for f, s in whole]}
    nbytes = sum(f.nbytes for f, _, _ in weights)
    floor = 2 * nbytes / bandwidth * 1e3
    rows, exact = {}, {}
    for name, fn in variants.items():
        for f, _, _ in weights:
            f.zero_()
        ms = median_ms(fn, args.iters, device)
        rows[name] = {"ms": ms, "x_floor": ms / floor}
        exact[name] = all(torch.equal(f.view(torch.int16), s.view(torch.int16)) for f, s in whole)
    print(f"{len(weights)} weights, {nbytes / 1e9:.2f} GB, floor {floor:.3f} ms at {bandwidth / 1e9:.0f} GB/s, "
          f"{both.tiles} tiles of {kernel.tile_bytes} B")
    for name, r in rows.items():
        print(f"  {name:<34} {r['ms']:8.3f} ms  {r['x_floor']:.3f}x  exact: {exact[name]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "floor_ms": floor, "rows": rows, "exact": exact,
                       "device": torch.cuda.get_device_name(0), "command": "python benchmarks/halves_order_lab.py"}, f)


if __name__ == "__main__":
    main()
