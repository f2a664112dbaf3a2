"""``verify()``'s fused checksum (``verify.segments``, ``execute.kernels.region_checksums``, ``verify.fused``).

Pure, in process: the runs of a strided view and the segments cut from them cover every
word of the view exactly once, at its address, with its row (oracle: the addresses
enumerated element by element). Under Triton's interpreter on CPU tensors (a subprocess
with ``TRITON_INTERPRET=1``): the kernel's sums equal :func:`region_sum`'s bit for bit
on random regions (0-dim, 1-byte, 2-, 4- and 8-byte dtypes, slices at random offsets,
transposed storage, casts, reshapes, rows longer than a segment, narrow and wide tiles,
aligned and not); and on 2 gloo ranks (fp32 TP2 trainer into a TP1 x DP2 engine and a
bf16 TP2 engine by cast) the witness's fused sums equal its term-by-term reference sums
on every rank, verify passes, and a flipped destination bit on the second replica or a
source changed after the refit makes verify raise on both ranks. On a GPU (``gpu``):
the same random regions on CUDA tensors, bit for bit.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import pytest
import torch
from interpreted import run_interpreted

from torchrefit.verify.segments import Region, aligned, runs, segment_rows


def _words_of(shape, strides, address) -> dict[int, tuple[int, int]]:
    """Oracle: every word address of a view -> (row, column), element by element."""
    out = {}
    rows = 1
    for n in shape[:-1]:
        rows *= n
    for row in range(rows):
        idx, rem = [], row
        for n in reversed(shape[:-1]):
            idx.append(rem % n)
            rem //= n
        base = address + sum(i * s for i, s in zip(reversed(idx), strides))
        for col in range(shape[-1]):
            out[base + col] = (row, col)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_segments_cover_every_word_once(seed: int) -> None:
    rng = random.Random(seed)
    nd = rng.randint(1, 4)
    shape = tuple(rng.randint(1, 5) for _ in range(nd - 1)) + (rng.randint(1, 40),)
    t = torch.empty([s + rng.randint(0, 3) for s in shape])  # a box of a larger tensor
    if nd > 2 and rng.random() < 0.5:
        t = t.transpose(0, 1).contiguous().transpose(0, 1)
    view = t[tuple(slice(0, s) for s in shape)]
    region = Region(1000, shape, tuple(view.stride()[:-1]), (0,) * nd, 1, 0, 2)
    got: dict[int, tuple[int, int]] = {}
    for address, stride, rows, rw, cw, c0, c1, slot in segment_rows(region, 7, 3, target=rng.choice([5, 16, 64])):
        assert (cw, slot) == (3, 0) and rows >= 1 and 0 <= c0 < c1 <= shape[-1]
        for r in range(rows):
            for c in range(c0, c1):
                assert address + r * stride + c not in got, "a word summed twice"
                got[address + r * stride + c] = (rw - 7 + r, c)
    assert got == _words_of(shape, view.stride()[:-1], 1000)


def test_runs_merge_dense_dims_and_drop_unit_dims() -> None:
    assert runs((4, 5), (50, 10)) == [(0, 0, 20, 10)]  # dense: one run
    assert runs((1, 5), (999, 10)) == [(0, 0, 5, 10)]  # a unit dim moves nothing
    assert runs((2, 3), (100, 10)) == [(0, 0, 3, 10), (3, 100, 3, 10)]  # a box: a run per outer row
    assert runs((), ()) == [(0, 0, 1, 0)]
    assert runs((3, 0), (5, 1)) == []


def test_alignment_rule() -> None:
    assert aligned((16, 8, 4, 0, 0, 0, 64, 0), 2)
    assert not aligned((16, 9, 4, 0, 0, 0, 64, 0), 2)  # row stride
    assert aligned((16, 9, 1, 0, 0, 0, 64, 0), 2)  # one row: its stride is never used
    assert not aligned((16, 8, 4, 0, 0, 0, 60, 0), 2)  # the end word
    assert not aligned((8, 16, 4, 0, 0, 0, 64, 0), 1)  # bytes: 16 to a vector


_RANDOM_REGIONS = textwrap.dedent("""
    import random, torch
    from torchrefit.layout import Box
    from torchrefit.verify import region_sum, fused
    from torchrefit.verify.fused import FusedSums, Item
    fused.TARGET_WORDS = __TARGET__
    rng = random.Random(__SEED__)
    dtypes = [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8, torch.int64, torch.float16,
              torch.bool]
    shapes = [(), (7,), (3, 9), (2, 3, 5), (2500,), (3, 700), (2, 3, 300), (5, 130), (1, 2000), (64, 16)]
    tensors, items, want = {}, [], [0] * 5
    for k in range(40):
        shape, dt = rng.choice(shapes), rng.choice(dtypes)
        t = torch.rand(shape, device=__DEVICE__) > 0.5 if dt == torch.bool else (
            torch.randn(shape, device=__DEVICE__) * 50).to(dt)
        if len(shape) >= 2 and rng.random() < 0.3:  # transposed storage: a strided last dim
            t = t.transpose(0, 1).contiguous().transpose(0, 1)
        tensors[f"t{k}"] = t
        sl = tuple(slice(rng.randint(0, min(s - 1, 40)), s) for s in shape)
        v = t[sl] if sl else t
        size = tuple(v.shape)
        if len(size) == 2 and size[0] > 1 and rng.random() < 0.2:  # a reshape to a unit dim in front
            size = (1,) + size
        target = dt if dt == torch.bool or rng.random() < 0.7 else rng.choice([torch.bfloat16, torch.float32])
        off = tuple(rng.randint(0, 20) for _ in size)
        w, slot = rng.choice([1, 2, 3]), rng.randrange(5)
        items.append(Item("dst", f"t{k}", sl, size, off, target, w, slot))
        want[slot] = (want[slot] + w * int(region_sum(v.reshape(size).to(target), Box(off, size)))) % (1 << 32)
    fs = FusedSums(items, 5)
    got = fs.sums({"dst": tensors}, torch.device(__DEVICE__)).tolist()
    kinds = sorted({(g.word, g.tile, g.vector) for g in fs._static})
    again = fs.sums({"dst": tensors}, torch.device(__DEVICE__)).tolist()  # tables kept
    print(kinds, len(fs._batches))
    print("EXACT" if got == want == again else f"DIFFERS {got} {want} {again}")
""")


@pytest.mark.parametrize("seed,target", [(0, 1 << 17), (1, 64), (2, 1000)])
def test_kernel_equals_region_sum_under_interpreter(seed: int, target: int) -> None:
    code = _RANDOM_REGIONS.replace("__SEED__", str(seed)).replace("__TARGET__", str(target)).replace("__DEVICE__", '"cpu"')
    out = run_interpreted(code)
    assert out.strip().endswith("EXACT"), out
    if seed == 0:  # every kind of launch took part
        assert "(1, 'wide'" in out and "(2, 'narrow'" in out and "(2, 'wide', True)" in out, out


@pytest.mark.gpu
def test_kernel_equals_region_sum_on_gpu() -> None:
    pytest.importorskip("triton")
    for seed, target in [(0, 1 << 17), (1, 64), (2, 1000)]:
        code = _RANDOM_REGIONS.replace("__SEED__", str(seed)).replace("__TARGET__", str(target))
        code = code.replace("__DEVICE__", '"cuda"')
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip().endswith("EXACT"), out.stdout


# ------------------------------------------------------------------ on 2 ranks
def _two_ranks(rank: int, world: int) -> dict:
    from dataclasses import replace

    import torch.distributed as dist

    import torchrefit as tr
    from torchrefit.testing import Mesh, ModelSpec, build_toy
    from torchrefit.verify import fused

    # narrow tiles only: the interpreter runs a tile of 64 rows far faster than a row at a
    # time (the wide tiles are the random-region tests' job)
    fused.NARROW = 1 << 20
    spec = ModelSpec(layers=1, hidden=64, heads=4, groups=2, ffn=128, vocab=96)
    src = build_toy(spec, Mesh(2, ranks=2), rank, 1, tp_group=dist.new_group([0, 1]))
    out: dict = {}
    for name, dst, cast in [("tp1", build_toy(spec, Mesh(1, ranks=2), rank, 2), False),
                            ("cast", build_toy(replace(spec, dtype=torch.bfloat16), Mesh(2, ranks=2), rank, 2), True)]:
        r = tr.Refitter(src, dst, cast=cast)
        r.refit()
        r.verify()
        w = r._witness
        s, d, cpu = r._src.tensors, r._dst.tensors, torch.device("cpu")
        out[name] = (w._fusable({"src": s, "dst": d}),
                     torch.equal(w.sums(s, d, cpu), w.reference_sums(s, d, cpu)))
    # a flipped bit on the second replica of the TP1 x DP2 engine
    dst = build_toy(spec, Mesh(1, ranks=2), rank, 2)
    r = tr.Refitter(src, dst)
    r.refit()
    if rank == 1:
        w = dict(dst.named_parameters())["decoder.layers.0.mlp.linear_fc1.weight"]
        w.data.view(torch.int32).view(-1)[77] ^= 1 << 3
    out["flipped"] = _raised(r)
    # the source changed after the refit (the destination is stale)
    dst = build_toy(spec, Mesh(1, ranks=2), rank, 2)
    r = tr.Refitter(src, dst)
    r.refit()
    if rank == 0:
        with torch.no_grad():
            dict(src.named_parameters())["decoder.layers.0.self_attention.linear_proj.weight"][3, 5] += 1
    out["stale"] = _raised(r)
    return out


def _raised(r) -> str | None:
    import torchrefit as tr

    try:
        r.verify()
    except tr.VerificationError as e:
        return str(e)
    return None


def test_witness_fused_equals_reference_on_two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton", reason="Triton not installed: the kernel runs only on GPUs with it")
    from torchrefit.testing import run_world

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks run the kernel interpreted on CPU
    out = run_world(_two_ranks, 2, timeout=600)
    for rank, o in enumerate(out):
        assert o["tp1"] == (True, True) and o["cast"] == (True, True), (rank, o)
        assert o["flipped"] and "linear_fc1.weight" in o["flipped"] and "destination rank 1" in o["flipped"], o
        assert o["stale"] and "linear_proj.weight" in o["stale"], o
