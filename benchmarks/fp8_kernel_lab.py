"""FP8 quantize lab (one GPU): how fast can a refit quantize the seed's model to block FP8?

Builds every projection of the seed model (gpt-4b: 20 layers of q/k/v/o 4096x4096,
up 16384x4096, down 4096x16384) in bf16 and their float8_e4m3fn destinations with
128x128 scale grids, then measures (median of ``--iters``, device synchronized around
each): the HBM copy floor of the bytes read (bf16) and written (FP8 + scales); the
torch reference ``quantize_blocks`` tensor by tensor; and the Triton block table
(``transforms.fp8_kernel``) in one launch, also with q/k/v read as 128-row strips of a
fused QKV source (how megatron_to_hf feeds them). Checks the Triton values and scales
bit for bit against the torch reference on every tensor. Prints JSON; ``--json`` keeps it.
"""

from __future__ import annotations

import argparse
import json

import torch

from torchrefit.bench.timing import copy_bandwidth, median_ms
from torchrefit.transforms.fp8 import quantize_blocks
from torchrefit.transforms.fp8_kernel import BlockTable, launch

BLOCK = (128, 128)


def _v2_kernel():
    """Candidate for ``transforms.fp8_kernel``: the same table and arithmetic, for
    tables whose blocks are whole and whose addresses and row strides are multiples of
    16 bytes (the hints let Triton vectorize), in chunks of rows (fewer registers a
    program, more programs in flight)."""
    import triton
    import triton.language as tl

    @triton.jit
    def v2(table, BR: tl.constexpr, BC: tl.constexpr, CHUNK: tl.constexpr, SRC: tl.constexpr):
        row = table + tl.program_id(0).to(tl.int64) * 7
        src = tl.multiple_of(tl.load(row), 16).to(tl.pointer_type(SRC))
        src_stride = tl.multiple_of(tl.load(row + 1).to(tl.int32), 16)
        dst = tl.multiple_of(tl.load(row + 2), 16).to(tl.pointer_type(tl.float8e4nv))
        dst_stride = tl.multiple_of(tl.load(row + 3).to(tl.int32), 16)
        scale = tl.load(row + 4).to(tl.pointer_type(tl.float32))
        c = tl.arange(0, BC)[None, :]
        r = tl.arange(0, CHUNK)[:, None]
        amax = tl.zeros((), dtype=tl.float32)
        for r0 in tl.static_range(0, BR, CHUNK):
            x = tl.load(src + (r0 + r) * src_stride + c).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        s = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
        for r0 in tl.static_range(0, BR, CHUNK):
            x = tl.load(src + (r0 + r) * src_stride + c).to(tl.float32)
            tl.store(dst + (r0 + r) * dst_stride + c, tl.math.div_rn(x, s).to(tl.float8e4nv))
        tl.store(scale, s)

    return v2


def launch_v2(kernel, table, chunk: int, warps: int) -> None:
    import triton.language as tl
    kernel[(table.blocks,)](table.table, BR=128, BC=128, CHUNK=chunk, SRC=tl.bfloat16,
                            num_warps=warps)


def device_ms(fn, iters: int) -> float:
    return median_ms(fn, iters, torch.device("cuda"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json")
    args = p.parse_args()
    dev = torch.device("cuda")
    h, f = 4096, 16384
    shapes = {"q": (h, h), "k": (h, h), "v": (h, h), "o": (h, h), "up": (f, h), "down": (h, f)}
    srcs, dsts, scales = [], [], []
    fused = []  # per layer: a Megatron-style fused QKV [32 groups x (q, k, v) 128 rows, h]
    for _ in range(args.layers):
        qkv = torch.randn(3 * h, h, device=dev, dtype=torch.bfloat16)
        fused.append(qkv)
        for name, shape in shapes.items():
            srcs.append(torch.randn(shape, device=dev, dtype=torch.bfloat16) * (0.01 if name == "o" else 1))
            dsts.append(torch.empty(shape, device=dev, dtype=torch.float8_e4m3fn))
            scales.append(torch.empty(shape[0] // 128, shape[1] // 128, device=dev))
    moved = sum(s.nbytes + d.nbytes + c.nbytes for s, d, c in zip(srcs, dsts, scales))
    bw = copy_bandwidth(dev)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "layers": args.layers, "bytes": moved, "copy_bandwidth_gbs": bw / 1e9,
           "floor_ms": moved / bw * 1e3}

    def torch_ref() -> None:
        for s, d, c in zip(srcs, dsts, scales):
            q, sc = quantize_blocks(s, BLOCK)
            d.copy_(q)
            c.copy_(sc)

    out["torch_ref_ms"] = device_ms(torch_ref, max(2, args.iters // 4))
    torch_ref()
    want = [(d.clone(), c.clone()) for d, c in zip(dsts, scales)]
    for d in dsts:
        d.zero_()
    tables = BlockTable.build(list(zip(srcs, dsts, scales)), BLOCK)
    out["blocks"] = sum(t.blocks for t in tables)
    out["triton_ms"] = device_ms(lambda: [launch(t) for t in tables], args.iters)
    same = [torch.equal(d.view(torch.uint8), w.view(torch.uint8)) and torch.equal(c, wc)
            for d, c, (w, wc) in zip(dsts, scales, want)]
    out["triton_bit_identical"] = all(same)
    out["triton_mismatching_tensors"] = same.count(False)
    if not all(same):
        d, c, (w, wc) = next((x for x, ok in zip(zip(dsts, scales, want), same) if not ok))
        out["first_mismatch"] = {
            "values_differ": int((d.view(torch.uint8) != w.view(torch.uint8)).sum()),
            "scales_differ": int((c != wc).sum())}
    # q/k/v as 32 strips of 128 rows each out of the fused QKV (one item per strip)
    strips = []
    for layer, qkv in enumerate(fused):
        for part in range(3):
            i = layer * len(shapes) + part
            for g in range(32):
                rows = slice(g * 384 + part * 128, g * 384 + (part + 1) * 128)
                strips.append((qkv[rows], dsts[i][g * 128:(g + 1) * 128], scales[i][g:g + 1]))
    strip_tables = BlockTable.build(strips, BLOCK)
    qkv_bytes = sum(s.nbytes + d.nbytes + c.nbytes for s, d, c in strips)
    out["strips_ms"] = device_ms(lambda: [launch(t) for t in strip_tables], args.iters)
    out["strips_floor_ms"] = qkv_bytes / bw * 1e3
    ok = True
    for s, d, c in strips:
        q, sc = quantize_blocks(s, BLOCK)
        ok &= torch.equal(q.view(torch.uint8), d.view(torch.uint8)) and torch.equal(sc, c)
    out["strips_bit_identical"] = bool(ok)
    # the candidate: every block here is whole and 16-byte aligned
    kernel = _v2_kernel()
    for chunk, warps in ((32, 4), (16, 4), (64, 8), (128, 8)):
        for d in dsts:
            d.zero_()
        key = f"v2_chunk{chunk}_warps{warps}"
        try:
            out[key + "_ms"] = device_ms(lambda c=chunk, w=warps: [launch_v2(kernel, t, c, w) for t in tables],
                                         args.iters)
            out[key + "_bit_identical"] = all(
                torch.equal(d.view(torch.uint8), w.view(torch.uint8)) and torch.equal(c, wc)
                for d, c, (w, wc) in zip(dsts, scales, want))
        except Exception as e:  # a candidate that does not compile is a finding, not a crash
            out[key + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    out["triton_vs_floor"] = out["triton_ms"] / out["floor_ms"]
    out["torch_ref_vs_floor"] = out["torch_ref_ms"] / out["floor_ms"]
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
