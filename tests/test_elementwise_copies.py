"""Large plain copies as elementwise kernels (``execute.kernels.elementwise_copies``), on CPU.

* A program of many mid-sized copies (256 or more large ones as planned, half their
  bytes in copies below 24 MB) runs all its plain large copies as kernels, by default;
  others run none (``mostly_mid_sized``, checked at its bounds, and its choice for each
  preset of the shape matrix: kernels for qwen3-30b-a3b only, as timed on a GPU).
* A refit of a model of 1-4 MB tensors (fp32, bf16 of odd shapes, a bool buffer) with
  ``settings.sm_copy_below`` at 4 MB runs exactly the copies below 4 MB as kernels
  and the 4 MB one as a copy; by default, with four large copies, none; a model of 300
  1 MB tensors runs all of them as kernels by default; every destination equals its
  source bit for bit (the oracle: the source's bits cloned before the refit, random bit
  patterns, NaN payloads included), on a second refit after the source changed too.
* 0: no kernel copy. A value that is no byte count is refused when it is set.
* ``word_views`` picks the widest word the size and both addresses allow, and refuses
  casts and strided views.
* Strided plain copies run on the widest views that fit (``widened``: complex128, then
  integers), moving every bit pattern (all 65536 16-bit patterns, against the source's
  bytes); a collocated TP2 -> TP1 refit, whose row-parallel halves land in strided
  views, holds exactly the toy's global values (the oracle) over two refits, and its
  large strided copies are complex128 views.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import torchrefit as tr
from torchrefit import settings
from torchrefit.execute.batched import batch_from
from torchrefit.execute.kernels import elementwise_copies
from torchrefit.testing import run_world

MB = 1 << 20


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(512, 1024))  # 2 MB fp32: a kernel
        self.b = nn.Parameter(torch.empty(1024, 1024))  # 4 MB: not below 4 MB, a copy
        self.c = nn.Parameter(torch.empty(701, 751, dtype=torch.bfloat16))  # ~1.05 MB, odd: 2-byte words
        self.register_buffer("mask", torch.zeros(3 * MB // 2, dtype=torch.bool))


def _scramble(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            b = t.view(torch.uint8) if t.dtype != torch.bool else t.view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
            if t.dtype == torch.bool:
                b.bitwise_and_(1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


class _ManyModel(nn.Module):
    """300 large copies of 1 MB (and one of 2 MB): many mid-sized copies."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ParameterList(nn.Parameter(torch.empty(MB // 4)) for _ in range(300))
        self.mid = nn.Parameter(torch.empty(MB // 2))


def _kernel_world(rank: int, world: int, below: int | None, model: type = _Model) -> dict:
    settings.configure(sm_copy_below=below)
    src, dst = model(), model()
    out: dict = {"wrong": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = tr.Refitter(src, dst)
        for seed in (1, 2):
            _scramble(src, seed)
            _scramble(dst, seed + 10)
            want = {k: _bits(v) for k, v in src.state_dict().items()}
            r.refit()
            got = {k: _bits(v) for k, v in dst.state_dict().items()}
            out["wrong"] += [f"{k} refit {seed}" for k in want if not torch.equal(want[k], got[k])]
    local = r._program.local
    out["kernels"] = sorted(n for (_, _, n), w in zip(local.big, local.words) if w is not None)
    out["copies"] = sorted(n for (_, _, n), w in zip(local.big, local.words) if w is None)
    out["warnings"] = [str(w.message) for w in caught if "copies" in str(w.message)]
    return out


def test_mostly_mid_sized_needs_many_copies_mostly_below_24_mb() -> None:
    many, mid = elementwise_copies.KERNEL_MIN_COPIES, elementwise_copies.MID_COPY_BYTES
    small = [MB] * (many - 1)
    assert elementwise_copies.mostly_mid_sized([*small, mid - 1])
    assert not elementwise_copies.mostly_mid_sized(small)  # one copy too few
    assert not elementwise_copies.mostly_mid_sized([MB, MB])
    assert elementwise_copies.mostly_mid_sized([*small, 255 * MB])  # 255 MB below, 255 MB above
    assert not elementwise_copies.mostly_mid_sized([*small, 256 * MB])
    assert not elementwise_copies.mostly_mid_sized([mid] * many)  # 24 MB is not mid-sized
    assert not elementwise_copies.mostly_mid_sized([])


@pytest.mark.parametrize("preset, layers, kernels, batched", [
    ("qwen3-30b-a3b", 8, True, True), ("deepseek-v3-moe", 2, False, False), ("dense-0.5b", None, False, True),
    ("llama-8b", None, False, False), ("gpt-4b", None, False, False)])
def test_the_rule_chooses_as_measured(preset: str, layers: int | None, kernels: bool,
                                 batched: bool) -> None:
    """The shape matrix's presets, with the rule's input as the executor builds it for a
    TP1 -> TP1 refit (every planned copy of 1 MB or more: each of the toy model's tensors,
    from its table of global tensors). Timed on a GPU, qwen3's copies ran faster as
    kernels and the others' as memcpy nodes; batched in one launch, qwen3's and the
    0.5 B dense model's ran faster than as memcpy nodes. The rule must keep choosing so."""
    from torchrefit.bench.config import spec_from_preset
    from torchrefit.execute.local import SMALL_COPY_BYTES
    from torchrefit.testing.toy import global_table

    spec = spec_from_preset(preset, layers=layers)

    def nbytes(t) -> int:
        return math.prod(t.shape) * (getattr(torch, t.dtype) if t.dtype else spec.dtype).itemsize

    sizes = [n for t in global_table(spec).values() if (n := nbytes(t)) >= SMALL_COPY_BYTES]
    assert elementwise_copies.mostly_mid_sized(sizes) is kernels
    assert (batch_from(sizes, SMALL_COPY_BYTES, "auto") is not None) is batched


def _kernel_worlds(rank: int, world: int) -> dict:
    cases = {"4 MB": (4 * MB, _Model), "default": (None, _Model), "0": (0, _Model),
             "default, many": (None, _ManyModel)}
    return {name: _kernel_world(rank, world, *case) for name, case in cases.items()}


@pytest.fixture(scope="module")
def kernel_worlds() -> dict:
    (got,) = run_world(_kernel_worlds, 1, timeout=300)  # one spawned process for all cases
    return got


@pytest.mark.parametrize("case", ["4 MB", "default", "0", "default, many"])
def test_plain_copies_run_as_exact_kernels_where_chosen(kernel_worlds: dict, case: str) -> None:
    got = kernel_worlds[case]
    assert got["wrong"] == []
    assert got["warnings"] == [], got["warnings"]
    if case == "4 MB":
        assert got["kernels"] == ["a", "c", "mask"] and got["copies"] == ["b"], got
    elif case == "default, many":  # 301 mid-sized copies: all kernels
        assert got["kernels"] and got["copies"] == [], got
    else:  # four large copies: too few for kernels by default
        assert got["kernels"] == [] and got["copies"] == ["a", "b", "c", "mask"], got


def test_word_views_take_the_widest_word_and_refuse_casts_and_strides() -> None:
    x = torch.zeros(1024, dtype=torch.float32)
    d, s = elementwise_copies.word_views(x, x.clone())
    assert d.dtype == torch.int64 and d.numel() == 512
    odd = torch.zeros(3, dtype=torch.bfloat16)
    d, s = elementwise_copies.word_views(odd, odd.clone())
    assert d.dtype == torch.int16
    base = torch.zeros(17, dtype=torch.bfloat16)
    d, s = elementwise_copies.word_views(base[1:9], base.clone()[1:9])  # 2-byte aligned only
    assert d.dtype == torch.int16 and d.numel() == 8
    assert elementwise_copies.word_views(x, x.to(torch.bfloat16).float().half()) is None  # a cast
    m = torch.zeros(8, 8)
    assert elementwise_copies.word_views(m.t(), m.clone()) is None  # strided


def test_widened_takes_the_widest_word_that_fits() -> None:
    full = torch.zeros(8, 16, dtype=torch.bfloat16)
    got = elementwise_copies.widened(full[:, :8], torch.zeros(8, 8, dtype=torch.bfloat16))
    assert got[0].dtype == torch.complex128 and got[0].shape == (8, 1) and got[0].stride() == (2, 1)
    assert got[0].data_ptr() == full.data_ptr()
    rows8 = torch.zeros(8, 16, dtype=torch.bfloat16)[:, 4:8]  # 8-byte rows: int64
    assert elementwise_copies.widened(rows8, torch.zeros(8, 4, dtype=torch.bfloat16))[0].dtype == torch.int64
    rows12 = torch.zeros(4, 12, dtype=torch.bfloat16)[:, :6]  # 12-byte rows: int32, not int64
    assert elementwise_copies.widened(rows12, torch.zeros(4, 6, dtype=torch.bfloat16))[0].dtype == torch.int32
    assert elementwise_copies.widened(torch.zeros(4, 6, dtype=torch.bfloat16)[:, :3],
                                 torch.zeros(4, 3, dtype=torch.bfloat16)) is None  # 6-byte rows
    assert elementwise_copies.widened(torch.zeros(8, 8), torch.zeros(8, 8)) is None  # dense: a memcpy already
    assert elementwise_copies.widened(torch.zeros(8, 8).t(), torch.zeros(8, 8)) is None  # last dim strided
    assert elementwise_copies.widened(torch.zeros(8, 16)[:, :8], torch.zeros(8, 8, dtype=torch.float64)) is None
    got = elementwise_copies.widened(torch.zeros(8, 16, dtype=torch.int64)[:, :8], torch.zeros(8, 8, dtype=torch.int64))
    assert got[0].dtype == torch.complex128 and got[0].shape == (8, 4)
    assert elementwise_copies.widened(torch.zeros(8, 16, dtype=torch.complex128)[:, :8],
                                 torch.zeros(8, 8, dtype=torch.complex128)) is None  # no wider element


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_widened_copies_move_every_bit_pattern(dtype: torch.dtype) -> None:
    """Every 16-bit pattern (so every bf16 value and NaN payload, every FP8 byte) as the
    source, copied into the right half of a wider tensor of random bytes: the widened
    copy leaves every byte as a byte copy would."""
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    src = patterns.view(torch.uint8).view(512, 256)  # 512 rows of 256 bytes
    full = torch.randint(0, 256, (512, 512), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    want = full.clone()
    want[:, 256:] = src
    size = dtype.itemsize
    w = elementwise_copies.widened(full.view(dtype)[:, 256 // size:], src.view(dtype))
    assert w is not None and w[0].dtype == torch.complex128
    w[0].copy_(w[1])
    assert torch.equal(full, want)


WIDE_SPEC = tr.testing.ModelSpec(layers=2, hidden=512, heads=8, groups=4, ffn=2048, vocab=256)


def _strided_world(rank: int, world: int) -> dict:
    src_mesh, dst_mesh = tr.testing.Mesh(2, ranks=2), tr.testing.Mesh(1, ranks=2)
    src = tr.testing.build_toy(WIDE_SPEC, src_mesh, rank, 1)
    dst = tr.testing.build_toy(WIDE_SPEC, dst_mesh, rank, 2)
    r = tr.Refitter(src, dst)
    want = tr.testing.expected_local(WIDE_SPEC, dst_mesh, rank, 1)
    wrong = []
    for step in (0.0, 1.0):
        with torch.no_grad():
            for p in src.parameters():
                p.add_(step)
        r.refit()
        bump = {k: v + step for k, v in want.items()}
        want = bump
        wrong += [f"{k} refit {step}" for k, v in dst.state_dict().items() if not torch.equal(v, want[k])]
    big = r._program.local.big
    return {"wrong": wrong, "wide": sorted(n for d, _, n in big if d.dtype == torch.complex128),
            "strided": sorted(n for d, s_, n in big if not (d.is_contiguous() and s_.is_contiguous()))}


def test_strided_copies_through_wider_words_stay_exact() -> None:
    results = run_world(_strided_world, 2, timeout=300)
    for rank, got in enumerate(results):
        assert got["wrong"] == [], (rank, got["wrong"][:3])
        assert got["strided"], f"rank {rank}: no strided large copy to test"
        assert got["wide"] == got["strided"], got
