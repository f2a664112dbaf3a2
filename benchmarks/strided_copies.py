"""Strided destination copies on one GPU: the lead for ipc's collocated TP2 -> TP1 refit
at 1.8x the floor (issue 10, BENCHMARKS.md "Transports run 6").

In TP2 -> TP1 a rank's half of a row-parallel weight (the seed's ``linear_fc2``
[4096, 8192] of [4096, 16384], ``linear_proj`` [4096, 2048] of [4096, 4096]) lands
in a strided view of the destination (``full[:, :half]``), about 38% of a rank's
bytes; TP1 -> TP1 copies are all contiguous. Times, with the device idle before each
call (``bench.timing.median_ms``), every layer's two halves copied into strided views
(1) as they are (bf16 elements), (2) through int64 views of the same bytes (8-byte
elements, exact), (3) the same bytes as contiguous copies, (4) as 2-D memcpys
(``execute.pitched_copies``), each against the copy floor (bytes read + written at
this run's 4 GiB copy bandwidth).

    python benchmarks/strided_copies.py [--layers 20] [--iters 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from torchrefit.bench.timing import copy_bandwidth, median_ms
from torchrefit.execute import pitched_copies


def _pairs(layers: int, hidden: int, ffn: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(layers):
        for cols in (ffn, hidden):  # linear_fc2 and linear_proj: split along their columns
            full = torch.empty(hidden, cols, dtype=torch.bfloat16, device="cuda")
            half = torch.randn(hidden, cols // 2, device="cuda").to(torch.bfloat16)
            out.append((full[:, : cols // 2], half))
    return out


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
    pairs = _pairs(args.layers, args.hidden, args.ffn)
    wide = [(d.view(torch.int64), s.view(torch.int64)) for d, s in pairs]
    flat = [(torch.empty_like(s), s) for _, s in pairs]
    pitches = [pitched_copies.pitch_of(d, s) for d, s in pairs]
    nbytes = sum(s.nbytes for _, s in pairs)
    floor = 2 * nbytes / bandwidth * 1e3
    rows = {}
    for name, group in (("strided bf16", pairs), ("strided int64 views", wide), ("contiguous", flat)):
        ms = median_ms(lambda g=group: [d.copy_(s) for d, s in g], args.iters, device)
        rows[name] = {"ms": ms, "x_floor": ms / floor}
    exact = {"torch": all(torch.equal(d, s) for d, s in pairs)}
    for d, _ in pairs:
        d.zero_()
    ms = median_ms(lambda: [pitched_copies.run(p, "w") for p in pitches], args.iters, device)
    rows["strided 2-D memcpy"] = {"ms": ms, "x_floor": ms / floor}
    exact["2-D memcpy"] = all(torch.equal(d, s) for d, s in pairs)
    print(f"{len(pairs)} copies, {nbytes / 1e9:.2f} GB, floor {floor:.3f} ms at {bandwidth / 1e9:.0f} GB/s; "
          f"exact: {exact}")
    for name, r in rows.items():
        print(f"  {name:<22} {r['ms']:8.3f} ms  {r['x_floor']:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "floor_ms": floor, "rows": rows, "exact": exact,
                       "device": torch.cuda.get_device_name(0)}, f)


if __name__ == "__main__":
    main()
