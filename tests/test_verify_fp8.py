"""FP8 destinations in ``verify()``'s witness (``torchrefit.verify.fp8_units``), on 2 gloo ranks.

A bf16 trainer (explicit layouts: ``v`` split by rows at 128, on block boundaries; ``w``
split at 100, through the 64-row blocks 64..127; ``h`` replicated) into an engine that
holds FP8 ``v`` / ``w`` with block scales (``fp8_block=(64, 64)``, edge blocks partial)
and ``h`` with a per-tensor scale, whole on both ranks. The refit's result equals the
oracle (every block quantized by a Python loop); the witness covers every block of ``v``
and ``h`` and all of ``w`` but its 3 blocks cut between source ranks (``unchecked``);
verify passes. Then, each on its own: a flipped FP8 byte of ``v`` on the replica that
quantized nothing, a flipped block scale, a flipped per-tensor scale, a flipped byte of
a checked block of ``w`` and a source changed after the refit make the witness raise on
both ranks naming the tensor; a flipped byte in an unchecked block of ``w`` is caught by
the plan comparison, whose error says the witness does not cover it.
"""

from __future__ import annotations

import torch

import torchrefit as tr
from torchrefit.testing import run_world

FP8 = torch.float8_e4m3fn
BLOCK = (64, 64)
SPLIT = {"v": [128, 72], "w": [100, 100]}


def _oracle_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=FP8)
    s = torch.empty(-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    for i in range(0, rows, BLOCK[0]):
        for j in range(0, cols, BLOCK[1]):
            b = x[i:i + BLOCK[0], j:j + BLOCK[1]].float()
            s[i // BLOCK[0], j // BLOCK[1]] = scale = b.abs().max().clamp(min=1e-4) / 448.0
            q[i:i + BLOCK[0], j:j + BLOCK[1]] = (b / scale).to(FP8)
    return q, s


def _globals() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"v": torch.randn(200, 160, generator=g).to(torch.bfloat16),
            "w": (torch.randn(200, 160, generator=g) * 3).to(torch.bfloat16),
            "h": torch.randn(48, 40, generator=g).to(torch.bfloat16)}


def _outcome(r: tr.Refitter) -> str:
    try:
        r.verify()
    except tr.VerificationError as e:
        return str(e)
    return "ok"


def _flip(t: torch.Tensor, index: tuple[int, ...], bit: int = 2) -> None:
    t.view(torch.uint8)[index] ^= 1 << bit


def _world(rank: int, world: int) -> dict:
    full = _globals()
    src, specs = {"h": full["h"].clone()}, {}
    for n, sizes in SPLIT.items():
        lo = sum(sizes[:rank])
        src[n] = full[n][lo:lo + sizes[rank]].clone()
        box = tr.Box((lo, 0), tuple(src[n].shape))
        specs[n] = tr.TensorSpec(n, (200, 160), (tr.Piece(box, (0, 0)),))
    g = torch.Generator().manual_seed(9 + rank)
    dst = {}
    for n in ("v", "w"):
        dst[n] = torch.randn(200, 160, generator=g).to(FP8)
        dst[n + "_scale_inv"] = torch.rand(4, 3, generator=g)
    dst["h"], dst["h_scale"] = torch.randn(48, 40, generator=g).to(FP8), torch.rand(1, generator=g)
    r = tr.Refitter(src, dst, src_layout=tr.layout.Explicit(specs), fp8_block=BLOCK)
    r.refit()
    out: dict = {"wrong": []}
    for n in ("v", "w"):
        q, s = _oracle_blocks(full[n])
        if not (torch.equal(dst[n].view(torch.uint8), q.view(torch.uint8)) and torch.equal(dst[n + "_scale_inv"], s)):
            out["wrong"].append(n)
    hs = full["h"].float().abs().max().clamp(min=1e-4) / 448.0
    if not (torch.equal(dst["h"].view(torch.uint8), (full["h"].float() / hs).to(FP8).view(torch.uint8))
            and torch.equal(dst["h_scale"], hs.reshape(1))):
        out["wrong"].append("h")
    out["passes"] = _outcome(r)
    out["unchecked"] = dict(r._witness.unchecked)
    cases = [("v byte, rank 1", "v", (150, 10), 1), ("v scale, rank 0", "v_scale_inv", (2, 1), 0),
             ("h scale, rank 1", "h_scale", (0,), 1), ("w checked block, rank 0", "w", (10, 5), 0),
             ("w unchecked block, rank 1", "w", (70, 5), 1)]
    for label, name, index, on in cases:
        t = dst[name]
        if rank == on:
            _flip(t, index if t.dtype == FP8 else _byte(t, index))
        out[label] = _outcome(r)
        if rank == on:
            _flip(t, index if t.dtype == FP8 else _byte(t, index))
    out["restored"] = _outcome(r)
    if rank == 1:  # the trainer moves on; the engine was not refitted
        src["v"][3, 4] += 1
    out["stale source"] = _outcome(r)
    return out


def _byte(t: torch.Tensor, index: tuple[int, ...]) -> tuple[int, ...]:
    """The index of the low byte of float32 element ``index`` in ``t.view(uint8)``."""
    return index[:-1] + (index[-1] * t.element_size() + 1,)


def test_fp8_witness_on_two_ranks() -> None:
    out = run_world(_world, 2, timeout=600)
    for rank, o in enumerate(out):
        assert o["wrong"] == [], (rank, o["wrong"])
        assert o["passes"] == "ok", o["passes"]
        assert o["unchecked"] == {"w": 3}, o["unchecked"]  # rows 64..127 x 3 column blocks
        assert o["restored"] == "ok", o["restored"]
        for label, name in [("v byte, rank 1", "v["), ("v scale, rank 0", "v_scale_inv"),
                            ("h scale, rank 1", "h_scale"), ("w checked block, rank 0", "w["),
                            ("stale source", "v[")]:
            got = o[label]
            assert "checksums in global coordinates" in got and name in got, (rank, label, got)
        got = o["w unchecked block, rank 1"]
        assert "compared through the plan" in got and "not covered by the checksum witness" in got, got
        assert "rank 1" in got, got
