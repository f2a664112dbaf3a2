"""Issue 16: a batched copy kernel at the copy floor for mid-sized copies.

``benchmarks/mid_copy_lab.py`` found that a qwen3-30b-a3b-shaped refit's 1424 copies of
1-20 MB run 1.146x the floor as memcpy graph nodes however they are placed (packed into
two flat buffers: the same 1.146x; one flat copy of the same bytes: 0.997x), 1.053-1.058x
as SM kernels, and 1.043x as ``execute.batched``'s one-launch Triton kernel with 512 KB
tiles and 16 warps, which is itself 1.041x on DeepSeek-V3's 16-64 MB copies that memcpy
moves at 1.015x. So the batched kernel's own streaming rate is what is left. This lab
times kernel variants on the same copies (device time of a graph replay, behind GPU
sleep), each checked byte for byte:

- ``steps``: what was ``execute.batched``'s Triton kernel until the tenth session (one
  program per tile, STEPS sequential load/store steps of BLOCK int32 words; here
  ``rows_kernel`` with one row and no hint, the same code);
- ``rows UxB``: U rows of B words loaded as one 2-D block before any store (more loads
  in flight per thread), optionally with streaming cache hints (``hint``: loads ``.cg``,
  stores ``.cs``);
- ``persistent``: a fixed grid (multiples of the SM count) looping over the tiles.

    PYTHONPATH=src python benchmarks/tile_kernel_lab.py --json OUT.json
"""

from __future__ import annotations

import gc
import json

import torch
import triton
import triton.language as tl
from diagnose_refit_phases import DEV, device_ms, run_shapes, toy_refit
from mid_copy_lab import exact, graph_of

from torchrefit.execute.copy_kernel import VECTOR, plan_tiles

SHAPES = [("qwen3-30b-a3b", 8), ("dense-0.5b", None), ("deepseek-v3-moe", 2)]


@triton.jit
def _copy_tile(anchor, row, ROWS: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr, HINT: tl.constexpr):
    """One tile of the table: ``row`` points at its (source, destination, words)."""
    src = tl.multiple_of(tl.load(row), 4)
    dst = tl.multiple_of(tl.load(row + 1), 4)
    n = tl.multiple_of(tl.load(row + 2), 4)
    block = tl.arange(0, ROWS)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    for step in tl.static_range(STEPS):
        offs = step * ROWS * BLOCK + block
        mask = offs < n
        if HINT:
            v = tl.load(anchor + src + offs, mask=mask, cache_modifier=".cg")
            tl.store(anchor + dst + offs, v, mask=mask, cache_modifier=".cs")
        else:
            tl.store(anchor + dst + offs, tl.load(anchor + src + offs, mask=mask), mask=mask)


@triton.jit
def rows_kernel(anchor, table, ROWS: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr,
                HINT: tl.constexpr):
    _copy_tile(anchor, table + 3 * tl.program_id(0), ROWS, BLOCK, STEPS, HINT)


@triton.jit
def persistent_kernel(anchor, table, tiles, ROWS: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr,
                      HINT: tl.constexpr):
    for t in range(tl.program_id(0), tiles, tl.num_programs(0)):
        _copy_tile(anchor, table + 3 * t, ROWS, BLOCK, STEPS, HINT)


def word_tiles(copies, anchor: int, tile: int) -> torch.Tensor:
    """``plan_tiles``' table as these kernels read it: int32-word offsets from ``anchor``."""
    t = plan_tiles(copies, tile)
    return torch.stack([(t[:, 0] - anchor) // 4, (t[:, 1] - anchor) // 4, t[:, 2] * (VECTOR // 4)], dim=1)


def variants(sms: int) -> list[tuple[str, int, object]]:
    """(label, tile bytes, launch(anchor, table, tiles))."""
    out = []

    def steps(block, n, warps):
        return (f"steps {block}x{n} w{warps}", block * n * 4,
                lambda a, t, k: rows_kernel[(k,)](a, t, ROWS=1, BLOCK=block, STEPS=n, HINT=False, num_warps=warps))

    def rows(r, block, n, warps, hint):
        return (f"rows {r}x{block}x{n} w{warps}{' hint' if hint else ''}", r * block * n * 4,
                lambda a, t, k: rows_kernel[(k,)](a, t, ROWS=r, BLOCK=block, STEPS=n, HINT=hint, num_warps=warps))

    def persistent(per_sm, r, block, n, warps, hint):
        return (f"persistent {per_sm}/SM {r}x{block}x{n} w{warps}{' hint' if hint else ''}", r * block * n * 4,
                lambda a, t, k: persistent_kernel[(min(k, per_sm * sms),)](
                    a, t, k, ROWS=r, BLOCK=block, STEPS=n, HINT=hint, num_warps=warps))

    out.append(steps(8192, 16, 16))
    out.append(steps(8192, 64, 16))
    out.append(steps(16384, 16, 32))
    out += [rows(1, 8192, 16, 16, True), rows(4, 4096, 8, 16, True), rows(2, 8192, 8, 32, True)]
    out.append(persistent(4, 4, 2048, 4, 8, True))
    out.append(persistent(2, 4, 4096, 4, 16, True))
    out.append(persistent(8, 4, 1024, 8, 4, True))
    return out


def study(name: str, layers: int | None, bw: float, cycles: int, sms: int) -> dict:
    src, dst, r, floor = toy_refit(name, layers, bw, 1)
    p = r._program
    pairs = [(d, s) for d, s, _ in p.local.big if d.dtype == s.dtype and d.is_contiguous() and s.is_contiguous()
             and (d.data_ptr() | s.data_ptr() | d.nbytes) % 16 == 0]
    moved = sum(d.nbytes for d, _ in pairs)
    # the floor of just these copies: the program also holds small ones
    pair_floor = 2 * moved / bw * 1e3
    row: dict = {"shape": name, "copies": len(pairs), "bytes": moved, "pairs floor ms": pair_floor,
                 "refit floor ms": floor, "program ms": device_ms(p.local.graph.replay, cycles)}
    anchor = torch.zeros(8, dtype=torch.int32, device=DEV)
    res = {}
    for label, tile, launch in variants(sms):
        try:
            table = word_tiles([(d.data_ptr(), s.data_ptr(), d.nbytes) for d, s in pairs],
                               anchor.data_ptr(), tile).to(DEV)
            k = table.shape[0]
            g = graph_of(lambda launch=launch, table=table, k=k: launch(anchor, table, k))
            ms = device_ms(g.replay, cycles)
            for d, _ in pairs[:4] + pairs[-4:]:
                d.zero_()
            g.replay()
            torch.cuda.synchronize()
            res[label] = {"ms": ms, "x pairs floor": ms / pair_floor, "tiles": k, "exact": exact(pairs)}
        except Exception as e:  # one failed variant must not lose the others
            res[label] = {"error": repr(e)[:300]}
        print(f"  {name:16s} {label:44s} {json.dumps(res[label])}", flush=True)
    row["variants"] = res
    r.close()
    del src, dst, r, p, pairs
    gc.collect()
    torch.cuda.empty_cache()
    return row


def show(row: dict) -> None:
    print(f"== {row['shape']}: {row['copies']} copies, pairs floor {row['pairs floor ms']:.3f} ms, "
          f"program {row['program ms']:.3f} ms (refit floor {row['refit floor ms']:.3f})", flush=True)


def main() -> None:
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    run_shapes(29584, SHAPES, lambda name, layers, bw, cycles, _: study(name, layers, bw, cycles, sms), show,
               meta={"triton": triton.__version__, "SMs": sms})


if __name__ == "__main__":
    main()
