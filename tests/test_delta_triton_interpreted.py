"""Delta refits' Triton kernels (``execute.kernels.delta_blocks``) on CPU, through Triton's
interpreter: the diff and encode of a sender and the apply of a receiver, against the
torch ops (``settings.triton_delta`` off) as the independent oracle.

Each case encodes one message twice, from the same source against two copies of the
same reference, once with the kernels and once with the torch ops, and checks: the
same encoding and counts, the same payload bytes (block counts, positions and values of
every part; the alignment padding is not written by either), both references brought
to the source's bits, and each payload applied by the other form (a Triton sender and
a torch-op receiver, and the reverse) rebuilding the source bit for bit. Covers random
bit patterns (NaN payloads, infinities, subnormals, 0.0 against -0.0) in every element
size, parts that end mid-tile and mid-block, changes at the first and last element,
at position 65535 of a block and the first of the next, a fused cast (float32 into a
bfloat16 wire: the bits after the cast are diffed), and the dense threshold: a message
past ``delta_dense_above`` goes dense with its reference fully updated, whether the
sample of large parts finds it or only the diff does (one whole block changed in a
message whose parts are too small to sample).

The cast's NaN payloads are left to the GPU test: the interpreter's float32 -> bfloat16
conversion is numpy's, the device's is its cast instruction, as torch's on that device.
"""

from __future__ import annotations

import textwrap

from interpreted import run_interpreted

_CODE = textwrap.dedent("""
    import torch
    from torchrefit import settings
    from torchrefit.execute import delta as d

    settings.configure(native_delta=False)
    DEV = "DEVICE"  # cpu under the interpreter; tests/test_gpu_delta.py runs it on cuda
    INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    g = torch.Generator().manual_seed(3)
    bad = []

    def bits(t):
        return t.view(INT[t.element_size()])

    def message(srcs, wires):
        offsets, at = [], 0
        for s, w in zip(srcs, wires):
            offsets.append(at)
            at = d._align(at + s.numel() * w.itemsize)
        parts = tuple(d._Part(s, w, o, s.numel()) for s, w, o in zip(srcs, wires, offsets))
        return parts, at

    def sections(parts, counts, payload):
        out, at = [], 0
        for p, k in zip(parts, counts):
            size = d.sparse_nbytes(p.numel, k, p.wire.itemsize)
            if k:
                nb = -(-p.numel // d.BLOCK)
                c0 = d._align(4 * nb)
                v0 = c0 + d._align(2 * k)
                seg = payload[at: at + size]
                out += [seg[: 4 * nb], seg[c0: c0 + 2 * k], seg[v0: v0 + k * p.wire.itemsize]]
            at += size
        return out

    def case(name, host, wires, change, above=0.1, want=None):
        srcs = [h.to(DEV) for h in host]  # changed on the host, copied in
        parts, nbytes = message(srcs, wires)
        dsts = [torch.zeros(s.shape, dtype=w, device=DEV) for s, w in zip(srcs, wires)]
        ref_t = torch.zeros(nbytes, dtype=torch.uint8, device=DEV)
        send = d._Message(1, parts, nbytes, ref_t)
        d._encode(send, dense_above=above)  # the first call: everything changed, dense
        for p, t in zip(parts, dsts):
            t.copy_(p.view)
        ref_o = ref_t.clone()
        change(host)
        for s, h in zip(srcs, host):
            s.copy_(h)
        recv = [d._Message(0, tuple(d._Part(t, w, p.offset, p.numel) for t, w, p in zip(ds, wires, parts)),
                           nbytes, None) for ds in (dsts, [t.clone() for t in dsts])]
        enc_t, counts_t, pay_t = d._encode(send, dense_above=above)
        with settings.overridden(triton_delta=False):
            enc_o, counts_o, pay_o = d._encode(d._Message(1, parts, nbytes, ref_o), dense_above=above)
        wanted = [s.to(w) for s, w in zip(srcs, wires)]
        if (enc_t, counts_t) != (enc_o, counts_o) or (want is not None and enc_t != want):
            bad.append((name, "encoding", enc_t, counts_t, enc_o, counts_o))
            return
        if not torch.equal(ref_t, ref_o):
            bad.append((name, "reference"))
        if enc_t == d.SPARSE:
            a, b = sections(parts, counts_t, pay_t), sections(parts, counts_o, pay_o)
            if len(a) != len(b) or not all(torch.equal(x, y) for x, y in zip(a, b)):
                bad.append((name, "payload bytes"))
            d._apply(recv[0], counts_t, pay_t.clone())  # the Triton sender's, torch ops apply
            with settings.overridden(triton_delta=False):
                d._apply(recv[0], counts_t, pay_t.clone())
            d._apply(recv[1], counts_o, pay_o)  # the torch-op sender's, the Triton apply
        else:
            d._unpack(recv[0], pay_t)
            d._unpack(recv[1], pay_o)
        for r in recv:
            got = [bits(p.view) for p in r.parts]
            if not all(torch.equal(x, bits(y)) for x, y in zip(got, wanted)):
                bad.append((name, "destination"))
        if d._encode(send, dense_above=above)[1] != [0] * len(parts):
            bad.append((name, "not everything taken"))
        print(name, enc_t, counts_t)

    def rand_bits(t, density, must=()):
        b = bits(t).reshape(-1)
        m = torch.rand(b.numel(), generator=g) < density
        m[list(must)] = True
        r = torch.randint(-(1 << 15), 1 << 15, (int(m.sum()),), generator=g).to(b.dtype)
        b[m] = torch.where(r == b[m], r ^ 1, r)

    def special(t):  # NaN payloads, -0.0, subnormals, infinities, in place of values
        b = bits(t).reshape(-1)
        b[:8] = torch.tensor([0x7FC1, 0x7F81, 0x8000, 0x0001, 0x7F80, 0xFF80, 0x0000, 0x7FC0],
                             dtype=torch.int32).to(torch.int16)

    n1, n2 = 2 * 65536 + 77, 65536 + 4096  # mid-tile and mid-block ends
    bf = torch.randn(n1, generator=g).to(torch.bfloat16)
    special(bf)
    srcs = [bf, torch.randint(0, 255, (n2,), generator=g).to(torch.uint8), torch.randn(50, generator=g),
            torch.randn(70001, generator=g).double()]

    def mix(ss):
        bits(ss[0]).reshape(-1)[:8] = torch.tensor([0x7FC2, 0x7F81, 0x0000, 0x0002, 0xFF80, 0x7F80, 0x8000,
                                                    0x7FC0], dtype=torch.int32).to(torch.int16)
        rand_bits(ss[0], 0.01, must=(65535, 65536, n1 - 1))
        rand_bits(ss[1], 0.02, must=(0, n2 - 1))
        rand_bits(ss[2], 0.0, must=(49,))
        rand_bits(ss[3], 0.001, must=(70000,))
    case("every size", srcs, [s.dtype for s in srcs], mix, want=d.SPARSE)

    last = torch.randn(3 * 65536, generator=g).to(torch.bfloat16)
    case("the last element only", [last], [torch.bfloat16],
         lambda ss: bits(ss[0]).reshape(-1).__setitem__(-1, 0x7FC3), want=d.SPARSE)
    case("position 65535 only", [last], [torch.bfloat16],
         lambda ss: bits(ss[0]).reshape(-1).__setitem__(65535, 0x0001), want=d.SPARSE)

    few = [torch.randn(65536, generator=g).to(torch.bfloat16), torch.randn(65537, generator=g).to(torch.bfloat16),
           torch.randint(0, 255, (1000,), generator=g).to(torch.uint8), torch.randn(5000, generator=g),
           torch.randint(0, 255, (3,), generator=g).to(torch.uint8), torch.randn(5000, generator=g),
           torch.randn(100, generator=g).double(), torch.randint(0, 2, (7,), generator=g).bool()]
    def scatter(ss):  # parts of one block or less go through one launch per kind
        rand_bits(ss[0], 0.01, must=(65535,))
        rand_bits(ss[1], 0.01, must=(65536,))
        rand_bits(ss[2], 0.05, must=(999,))
        bits(ss[4]).reshape(-1)[2] ^= 1
        ss[5][4999] += 1.0
        ss[5][:50] *= 1.01
        rand_bits(ss[6], 0.1, must=(99,))
        ss[7][6] = ~ss[7][6]
    case("small parts together", few, [torch.bfloat16, torch.bfloat16, torch.uint8, torch.float32, torch.uint8,
                                       torch.bfloat16, torch.float64, torch.bool], scatter, want=d.SPARSE)

    master = torch.randn(65536 + 300, generator=g)
    master[:4] = torch.tensor([float("inf"), -0.0, 1e-40, -float("inf")])
    if DEV == "cuda":  # NaN payloads through the cast: the kernel's cast instruction, as torch's there
        master.view(torch.int32)[4:8] = torch.tensor([0x7F800001, -4194303, 0x7FFFFFFF, -8388317], dtype=torch.int32)
    def nudge(ss):
        m = torch.rand(ss[0].numel(), generator=g) < 0.05
        ss[0][m] *= 1.0 + 1e-3 * torch.rand(int(m.sum()), generator=g)
        ss[0][-1] = 0.0
        ss[0][0] = -0.0
    case("fused cast", [master], [torch.bfloat16], nudge, want=d.SPARSE)

    small = [torch.randn(60000, generator=g).to(torch.bfloat16) for _ in range(3)]
    def one_block(ss):
        bits(ss[1]).reshape(-1).bitwise_xor_(1)
    case("dense past the threshold", small, [torch.bfloat16] * 3, one_block, want=d.DENSE)
    case("sparse below it", small, [torch.bfloat16] * 3, one_block, above=0.4, want=d.SPARSE)
    case("dense by the sample", [last], [torch.bfloat16], lambda ss: rand_bits(ss[0], 0.3), want=d.DENSE)
    def sampled_runs(ss):  # every sampled element, 8% of the part: the sample alone says dense
        b = bits(ss[0]).reshape(-1)
        for r in range(32):
            b[r * (b.numel() // 32): r * (b.numel() // 32) + 512] ^= 1
    case("dense by the sample only", [last], [torch.bfloat16], sampled_runs, want=d.DENSE)
    print("EXACT" if not bad else f"DIFFERS {bad}")
""")


def test_triton_delta_kernels_match_the_torch_ops() -> None:
    out = run_interpreted(_CODE.replace("DEVICE", "cpu"), timeout=300)
    assert out.strip().endswith("EXACT"), out


_WORLD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_delta import _dtypes_world, check_dtypes
    from torchrefit.testing import run_world

    # every dtype, a cast, block-FP8 targets, densities 0 to 100%, NaN payloads and -0.0,
    # between two processes over gloo; the kernels take every CPU message here
    check_dtypes(run_world(_dtypes_world, 2, "device", "cpu", "gloo", False, timeout=240))
    print("EXACT")
""")


def test_refits_through_the_triton_kernels_match_a_full_refit() -> None:
    """``test_delta``'s every-dtype scenario with the kernels taking every message
    (under the interpreter they take CPU tensors), against a full refit into a second
    destination, bit for bit after every call."""
    import os
    out = run_interpreted(_WORLD.format(tests=os.path.dirname(os.path.abspath(__file__))), timeout=300)
    assert out.strip().endswith("EXACT"), out


def test_another_kernel_shape_is_checked_and_undone() -> None:
    """``delta_blocks.shaped`` (``benchmarks/delta.py --shape``) refuses a tile that does not
    cut the block into tiles of a power of two, and puts the shipped shape back after."""
    import pytest

    from torchrefit.execute.kernels import delta_blocks as kb
    shipped = kb.TILE, kb.PER, kb.DIFF_WARPS, kb.CHUNK
    with kb.shaped(1024, 4, 128):
        assert (kb.TILE, kb.PER, kb.DIFF_WARPS, kb.CHUNK) == (1024, 64, 4, 128)
    assert (kb.TILE, kb.PER, kb.DIFF_WARPS, kb.CHUNK) == shipped
    for bad in [(3000, 8, 256), (2 * kb.BLOCK, 8, 256), (2048, 8, 100), (2048, 0, 256)]:
        with pytest.raises(ValueError, match="delta kernels"):
            with kb.shaped(*bad):
                pass
    assert (kb.TILE, kb.PER, kb.DIFF_WARPS, kb.CHUNK) == shipped
