"""Contiguous-run merging of local copies (``execute.runs``), on CPU.

Covers the pure rule (copies merge only where destinations *and* sources are back
to back, in one allocation each side; every copy lands in exactly one run, the
last one too; input order does not matter), ``merge_local`` on real tensors
(merged byte copies move exactly the bytes of the copies they replace; casts,
strided views and permuted pairs are left alone), and a refit on one gloo process
between models whose parameters are views of one flat buffer each (as Megatron's
DDP keeps them): one copy moves everything, the result matches the oracle, and
``verify()`` still names the one tensor inside a merged run that differs.
"""

from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest
import torch

import torchrefit as tr
from torchrefit.execute.runs import Span, merge_local, merge_runs
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local, run_world

A = (0, 1 << 20)  # one allocation on each side
B = (1 << 20, 2 << 20)


def _span(dst: int, src: int, n: int, dst_alloc=A, src_alloc=A) -> Span:
    return Span(dst, src, n, dst_alloc, src_alloc)


def test_back_to_back_on_both_sides_is_one_run() -> None:
    spans = [_span(0, 1000, 100), _span(100, 1100, 50), _span(150, 1150, 10)]
    assert merge_runs(spans) == [[0, 1, 2]]
    shuffled = [spans[2], spans[0], spans[1]]
    assert merge_runs(shuffled) == [[1, 2, 0]]  # destination order, whatever the input order


def test_adjacent_on_one_side_only_is_not_merged() -> None:
    gap_src = [_span(0, 1000, 100), _span(100, 1200, 100)]  # sources 100 bytes apart
    assert merge_runs(gap_src) == [[0], [1]]
    gap_dst = [_span(0, 1000, 100), _span(164, 1100, 100)]
    assert merge_runs(gap_dst) == [[0], [1]]
    # destinations back to back but sources in the other order: a byte copy would swap them
    swapped = [_span(0, 1100, 100), _span(100, 1000, 100)]
    assert merge_runs(swapped) == [[0], [1]]


def test_runs_never_cross_allocations() -> None:
    # addresses touch, but on one side the second copy lies in the next allocation
    spans = [_span(B[0] - 100, 500, 100, dst_alloc=A), _span(B[0], 600, 100, dst_alloc=B)]
    assert merge_runs(spans) == [[0], [1]]
    spans = [_span(0, B[0] - 100, 100, src_alloc=A), _span(100, B[0], 100, src_alloc=B)]
    assert merge_runs(spans) == [[0], [1]]


def test_every_copy_in_exactly_one_run_last_included() -> None:
    rng = random.Random(7)
    for _ in range(200):
        spans, dst, src = [], 0, 5000
        for _ in range(rng.randint(1, 12)):
            n = rng.randint(1, 40)
            spans.append(_span(dst, src, n))
            dst += n + rng.choice((0, 0, 0, 8))  # mostly back to back, sometimes a gap
            src += n + rng.choice((0, 0, 0, 8))
        runs = merge_runs(spans)
        assert sorted(i for r in runs for i in r) == list(range(len(spans)))
        for run in runs:
            for a, b in zip(run, run[1:]):
                assert spans[a].dst + spans[a].nbytes == spans[b].dst
                assert spans[a].src + spans[a].nbytes == spans[b].src
        starts = [spans[r[0]] for r in runs]  # adjacent runs are apart on some side
        for a_run, b in zip(runs, starts[1:]):
            a = spans[a_run[-1]]
            assert a.dst + a.nbytes != b.dst or a.src + a.nbytes != b.src


def test_span_outside_its_allocation_is_rejected() -> None:
    with pytest.raises(ValueError, match="outside its allocation"):
        _span(A[1] - 10, 0, 20)


def _pieces(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    out, at = [], 0
    for n in sizes:
        out.append(flat[at: at + n])
        at += n
    return out


def _apply(copies) -> None:
    for d, s, _ in copies:
        d.copy_(s)


def test_merge_local_moves_exactly_the_same_bytes() -> None:
    sizes = [7, 64, 3, 128, 5]
    src_flat = torch.randn(sum(sizes))
    dst_flat = torch.full((sum(sizes),), float("nan"))
    src, dst = _pieces(src_flat, sizes), _pieces(dst_flat, sizes)
    names = [f"t{i}" for i in range(len(sizes))]
    merged = merge_local(list(zip(dst, src, names)))
    assert len(merged) == 1 and merged[0][2] == "t0 .. t4 (5 tensors in one copy)"
    _apply(merged)
    assert torch.equal(dst_flat, src_flat)  # oracle: the whole source buffer, bit for bit


def test_merge_local_leaves_casts_strides_and_permutations() -> None:
    sizes = [16, 16, 16, 16]
    src_flat, dst_flat = torch.randn(64), torch.zeros(64)
    src, dst = _pieces(src_flat, sizes), _pieces(dst_flat, sizes)
    half = torch.zeros(16, dtype=torch.float16)
    strided = torch.zeros(32)[::2]
    # casts between dtypes of one size, adjacent on both sides: bytes alike, values not
    bf16_flat, fp16_flat = torch.randn(32).bfloat16(), torch.zeros(32, dtype=torch.float16)
    bf16, fp16 = _pieces(bf16_flat, [16, 16]), _pieces(fp16_flat, [16, 16])
    copies = [(dst[0], src[1], "a"), (dst[1], src[0], "b"),  # swapped: not adjacent in order
              (dst[2], src[2], "c"), (dst[3], src[3], "d"),  # these two merge
              (half, src[0], "cast"), (strided, src[1], "strided"),
              (fp16[0], bf16[0], "cast0"), (fp16[1], bf16[1], "cast1")]
    merged = merge_local(copies)
    assert [m[2] for m in merged] == ["a", "b", "c .. d (2 tensors in one copy)", "cast", "strided",
                                      "cast0", "cast1"]
    _apply(merged)
    assert torch.equal(dst[0], src[1]) and torch.equal(dst[1], src[0])
    assert torch.equal(dst_flat[32:], src_flat[32:])
    assert torch.equal(half, src[0].half()) and torch.equal(strided, src[1])
    assert torch.equal(fp16_flat, bf16_flat.to(torch.float16))


def _flatten(model: torch.nn.Module) -> None:
    """Parameters as views of one flat buffer, in name order (Megatron DDP's param buffer)."""
    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype)
    at = 0
    with torch.no_grad():
        for p in params:
            view = flat[at: at + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view
            at += p.numel()


def _flat_refit(rank: int, world: int) -> dict:
    spec = ModelSpec(layers=2, experts=4, swiglu=True)
    mesh = Mesh(1, ranks=1)
    src, dst = (build_toy(spec, mesh, rank, seed) for seed in (1, 2))
    for m in (src, dst):
        _flatten(m)
    r = tr.Refitter(src, dst)
    r.refit()
    p = r._program
    expected = expected_local(spec, mesh, rank, 1)
    out = {"copies": len(p.local.big) + sum(len(g.dst) for g in p.local.small), "planned": len(r.plan.local),
           "exact": all(torch.equal(v, expected[k]) for k, v in dst.state_dict().items())}
    r.verify()
    name = "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"
    with torch.no_grad():
        dict(dst.named_parameters())[name].view(-1)[3] += 1.0  # inside the merged run
    try:
        r.verify()
        out["caught"] = None
    except tr.VerificationError as e:
        out["caught"] = str(e)
    return out


def test_flat_buffer_models_refit_in_one_copy() -> None:
    (got,) = run_world(_flat_refit, 1, timeout=180)
    assert got["planned"] > 20 and got["copies"] == 1
    assert got["exact"]
    assert got["caught"] is not None and "local_experts.2.linear_fc1.weight" in got["caught"]


def test_allocations_asked_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_spans`` asks for each allocation once (a driver call on CUDA), and still
    keeps runs inside allocations: two source buffers back to back in one flat
    destination merge per buffer, never across them."""
    from torchrefit.execute import runs

    asked = []
    real = runs.allocation_of
    monkeypatch.setattr(runs, "allocation_of", lambda t: asked.append(t) or real(t))
    sizes = [16] * 6
    src_a, src_b, dst_flat = torch.randn(48), torch.randn(48), torch.zeros(96)
    src = _pieces(src_a, sizes[:3]) + _pieces(src_b, sizes[3:])
    dst = _pieces(dst_flat, sizes)
    merged = merge_local([(d, s, f"t{i}") for i, (d, s) in enumerate(zip(dst, src))])
    assert [m[2] for m in merged] == ["t0 .. t2 (3 tensors in one copy)", "t3 .. t5 (3 tensors in one copy)"]
    _apply(merged)
    assert torch.equal(dst_flat, torch.cat([src_a, src_b]))
    assert len(asked) == 3  # dst_flat, src_a, src_b: one each


def storages_back_to_back(buf: np.ndarray, sizes: list[int]) -> list[torch.Tensor]:
    """Tensors with storages of their own, back to back in ``buf``'s memory (as the
    caching allocator carves them out of one segment)."""
    out, at = [], 0
    for n in sizes:
        out.append(torch.from_numpy(buf[at: at + n]))
        at += n
    return out


def _driver_of(monkeypatch, runs, pieces: list[tuple[int, int]], reserved: list[tuple[int, int]]) -> None:
    """A fake driver over CPU memory: ``pieces`` are the mapped ranges (the 2/20 MB
    pieces of an expandable segment), ``reserved`` the ranges they were reserved in
    (empty: the driver knows none, as for pieces that are cudaMalloc allocations)."""
    def within(ranges: list[tuple[int, int]]):
        return lambda ptr: next(((lo, hi) for lo, hi in ranges if lo <= ptr < hi), None)

    def host_bytes(t: torch.Tensor, nbytes: int, alloc: tuple[int, int]) -> torch.Tensor:
        # byte_view's check, then host memory where it would wrap device addresses
        ptr = t.data_ptr()
        if not (alloc[0] <= ptr and ptr + nbytes <= alloc[1]):
            raise AssertionError(f"byte view {ptr:#x}+{nbytes} outside its allocation")
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)

    monkeypatch.setattr(runs, "_device_range", lambda t: runs._driver_range(t.data_ptr()))
    monkeypatch.setattr(runs, "_mapped_range", within(pieces))
    monkeypatch.setattr(runs, "_reserved_range", within(reserved))
    monkeypatch.setattr(runs, "byte_view", host_bytes)


@pytest.mark.parametrize("reserved", [True, False])
def test_tensors_across_mapped_pieces(monkeypatch: pytest.MonkeyPatch, reserved: bool) -> None:
    """Expandable segments: a tensor may span two mapped pieces of one reserved range.
    Its allocation is the reserved range, so back-to-back tensors merge across pieces;
    where the driver gives only the piece (no reserved range), a tensor that spans two
    takes its own storage as its allocation (never a span outside it) and merges with
    nothing. Every byte arrives either way (the oracle: the source buffer itself)."""
    from torchrefit.execute import runs

    sizes = [100, 300, 50, 250, 300]  # pieces of 256 floats: t1, t3 and t4 span two
    src_buf = np.random.default_rng(3).standard_normal(sum(sizes)).astype(np.float32)
    dst_buf = np.full(sum(sizes), np.nan, dtype=np.float32)
    whole = [(b.ctypes.data, b.ctypes.data + b.nbytes) for b in (src_buf, dst_buf)]
    pieces = [(lo, min(lo + 256 * 4, end)) for start, end in whole for lo in range(start, end, 256 * 4)]
    _driver_of(monkeypatch, runs, pieces, whole if reserved else [])
    src, dst = storages_back_to_back(src_buf, sizes), storages_back_to_back(dst_buf, sizes)
    merged = merge_local([(d, s, f"t{i}") for i, (d, s) in enumerate(zip(dst, src))])
    if reserved:
        assert [m[2] for m in merged] == ["t0 .. t4 (5 tensors in one copy)"]
    else:  # t0 alone in the first piece with t1 spanning into the second: nothing merges
        assert [m[2] for m in merged] == [f"t{i}" for i in range(5)]
    for d, s, _ in merged:
        d.copy_(s)
    assert np.array_equal(dst_buf, src_buf)
