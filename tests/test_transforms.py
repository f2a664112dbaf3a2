"""Transforms on what a refit moves: narrowing casts on the sender, FP8 destinations.

Oracles are written here: a per-block Python loop quantizes the whole global
tensor (``s = amax(|block|).clamp(min=1e-4) / 448``, ``q = (w / s)`` in float32,
``to(float8_e4m3fn)``), independently of ``transforms.fp8``'s vectorized code;
casts are ``tensor.to(bfloat16)`` of the oracle's global values.

In one process: the block quantizer against the loop on shapes with partial edge
blocks and stacked leading dims.

In one spawned world of 4 ranks per transport usable on CPU here (gloo; nixl where
``nixl-cu13`` is installed: a push transport, whose senders quantize nothing, so every
FP8 tensor is quantized on receipt, and which casts through buffers of the wire dtype):
* cast: a Megatron-style TP2 fp32 trainer into a bf16 engine with ``cast=True``:
  values equal the fp32 -> bf16 oracle, and the bytes each rank reports received
  are 2 per element (bf16 on the wire), half of the same refit's fp32 engine;
* FP8: a Megatron TP2 trainer into a whole Hugging Face-named engine whose linear
  weights are ``float8_e4m3fn`` with ``_scale_inv`` grids (blocks that leave partial
  edge blocks) and ``lm_head`` with a per-tensor ``_scale``: bit-identical to the
  oracle on the global tensors; an FSDP2 Hugging Face Qwen2-MoE trainer into a
  vLLM-style TP2 engine (fused ``qkv_proj`` / ``gate_up_proj``, stacked
  ``w13_weight`` / ``w2_weight``) that is FP8 throughout, by passing one map:
  bit-identical, padding rows untouched, the report counting quantized tensors;
* bad input, the same ``PlanError`` on every rank, nothing written: a scale grid
  that does not match ``fp8_block``.

Planned in one process from hand-made rosters: shards that cut a block, scale
pieces that do not follow the weight's blocks, a grid of the wrong shape raise
``PlanError``; block-aligned shards plan with the source's dtype on the wire.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from test_maps_engines import _fsdp2, _vllm_engine, vllm_reference
from test_maps_hf import _module, reference, toy_globals

import torchrefit as tr
from torchrefit import settings
from torchrefit.layout._types import Box, ModelLayout, Piece, TensorLayout
from torchrefit.layout.vllm_tp import vllm_tp_layout
from torchrefit.plan.world_plan import plan_world
from torchrefit.testing import (
    Mesh,
    ModelSpec,
    build_toy,
    expected_local,
    run_world,
    usable_transports,
)
from torchrefit.transforms import quantize_blocks
from torchrefit.transport.base import transport_class

WORLD = 4
SRC_SEED, DST_SEED = 1, 2
FP8 = torch.float8_e4m3fn


def oracle_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize block by block with Python loops (leading dims one at a time)."""
    if w.dim() > 2:
        qs = [oracle_blocks(x, block) for x in w]
        return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])
    rows, cols = w.shape
    br, bc = block
    q = torch.empty(rows, cols, dtype=FP8)
    s = torch.empty(-(-rows // br), -(-cols // bc))
    for i in range(0, rows, br):
        for j in range(0, cols, bc):
            x = w[i:i + br, j:j + bc].float()
            scale = x.abs().max().clamp(min=1e-4) / 448.0
            q[i:i + br, j:j + bc] = (x / scale).to(FP8)
            s[i // br, j // bc] = scale
    return q, s


def oracle_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = w.float()
    scale = x.abs().max().clamp(min=1e-4) / 448.0
    return (x / scale).to(FP8), scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


# ------------------------------------------------------------ in one process
@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((24, 48), (5, 7)),
                                         ((3, 12, 20), (4, 8)), ((8, 8), (8, 8))])
def test_block_quantizer_equals_the_loop(shape, block) -> None:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w[..., :block[0], :block[1]] = 0  # an all-zero block gets the clamped scale, not 0
    q, s = quantize_blocks(w, block)
    want_q, want_s = oracle_blocks(w, block)
    assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(s, want_s)


def _layout(name: str, shape, dtype: str, boxes) -> ModelLayout:
    pieces = tuple(Piece(b, (0,) * len(shape)) for b in boxes)
    size = boxes[0].size
    return ModelLayout(((name, TensorLayout(name, shape, dtype, size, pieces)),))


def _plan_fp8(w_rows: list[tuple[int, int]], s_rows: list[tuple[int, int]], grid=(3, 2), **kw):
    """Two destination ranks: rank r holds rows ``w_rows[r]`` of an FP8 [24, 16] weight
    and rows ``s_rows[r]`` of its scale grid; the source holds the bf16 weight whole."""
    src = _layout("w", (24, 16), "bfloat16", [Box.whole((24, 16))])
    dst = []
    for (a, b), (c, d) in zip(w_rows, s_rows):
        layout = _layout("w", (24, 16), "float8_e4m3fn", [Box((a, 0), (b - a, 16))])
        scale = _layout("w_scale_inv", grid, "float32", [Box((c, 0), (d - c, grid[1]))])
        dst.append(ModelLayout(layout.tensors + scale.tensors))
    return plan_world([src, None], dst, fp8_block=(8, 8), **kw)


@pytest.mark.parametrize("w_rows,s_rows,grid,match", [
    ([(0, 12), (12, 24)], [(0, 2), (1, 3)], (3, 2), "a rank holds \\[0:12, 0:16\\], which cuts a 8x8 block"),
    ([(0, 8), (8, 24)], [(0, 3), (1, 3)], (3, 2), "w_scale_inv's pieces must be the block cells of the "
     "weight's pieces on each rank \\(dst ranks \\[0\\]"),
    ([(0, 24), (0, 24)], [(0, 3), (0, 3)], (3, 3), "w_scale_inv \\[3, 3\\] is not the block grid \\[3, 2\\]"),
])
def test_fp8_layouts_that_cut_blocks_or_misplace_scales(w_rows, s_rows, grid, match) -> None:
    with pytest.raises(tr.PlanError, match=match):
        _plan_fp8(w_rows, s_rows, grid)


def test_fp8_block_aligned_shards_are_quantized_by_the_sender() -> None:
    """Whole blocks of one source piece: the sender quantizes into FP8 buffers and sends FP8
    values (1 byte an element) and float32 scales; a local piece is quantized straight
    from the source; nothing is quantized on receipt."""
    plans = _plan_fp8([(0, 8), (8, 24)], [(0, 1), (1, 3)])
    (values, scales), = [(a, b) for a, b in [plans[0].sends]]
    assert (values.wire_dtype, values.local_dtype, values.nbytes) == ("float8_e4m3fn",) * 2 + (16 * 16,)
    assert (scales.name, scales.region, scales.wire_dtype) == ("w_scale_inv", Box((1, 0), (2, 2)), "float32")
    assert [(t.name, t.local_dtype) for t in plans[1].recvs] == [("w", "float8_e4m3fn"),
                                                                 ("w_scale_inv", "float32")]
    (local,), (staged,) = plans[0].quantize[:1], plans[0].quantize[1:]
    assert not local.received and not local.staged and local.region == Box((0, 0), (8, 16))
    assert staged.staged and staged.dst_key == values.key and staged.scale_key == scales.key
    assert plans[0].fp8_bytes == (8 * 16, 0) and plans[1].fp8_bytes == (16 * 16, 0)
    assert plans[1].bytes_received == 16 * 16 + 2 * 2 * 4  # a quarter of fp32's, plus scales


def test_fp8_source_shards_that_cut_blocks_are_quantized_on_receipt() -> None:
    """Source TP shards of 4 rows cut the 8-row blocks: the destination receives bf16
    into a shadow and quantizes the whole piece after the exchange."""
    src = [_layout("w", (24, 16), "bfloat16", [Box((r, 0), (4, 16))]) for r in range(0, 24, 4)]
    dst = ModelLayout(_layout("w", (24, 16), "float8_e4m3fn", [Box.whole((24, 16))]).tensors
                      + _layout("w_scale_inv", (3, 2), "float32", [Box.whole((3, 2))]).tensors)
    plans = plan_world(src, [None] * 5 + [dst], fp8_block=(8, 8))
    mine = plans[5]
    assert {t.wire_dtype for t in mine.recvs} == {"bfloat16"} and len(mine.recvs) == 5
    assert all(t.key == "w (shadow)" for t in mine.recvs) and mine.local[0].dst_key == "w (shadow)"
    (step,) = mine.quantize
    assert step.received and step.src_key == "w (shadow)" and step.region == Box.whole((24, 16))
    assert mine.fp8_bytes == (0, 24 * 16)
    assert "quantize" in mine.explain() and "bfloat16 -> float8_e4m3fn" in mine.explain()


def test_fp8_through_a_one_sided_transport_is_quantized_on_receipt() -> None:
    """One-sided transports move bytes as they are (sender_transforms=False): remote
    aligned regions come in the source's dtype and are quantized on receipt; a local
    region is still quantized straight from the source."""
    plans = _plan_fp8([(0, 8), (8, 24)], [(0, 1), (1, 3)], sender_transforms=False)
    assert plans[0].sends[0].wire_dtype == "bfloat16" and len(plans[0].sends) == 1
    assert [q.received for q in plans[0].quantize] == [False]
    assert plans[1].recvs[0].key == "w (shadow)" and plans[1].fp8_bytes == (0, 16 * 16)


def test_narrowing_cast_goes_on_the_wire_in_the_destination_dtype() -> None:
    src = _layout("w", (24, 16), "float32", [Box.whole((24, 16))])
    dst = _layout("w", (24, 16), "bfloat16", [Box.whole((24, 16))])
    plans = plan_world([src, None], [None, dst], cast=True)
    (send,), (recv,) = plans[0].sends, plans[1].recvs
    assert (send.wire_dtype, send.local_dtype) == ("bfloat16", "float32")
    assert (recv.wire_dtype, recv.local_dtype) == ("bfloat16", "bfloat16")
    assert plans[1].bytes_received == 24 * 16 * 2
    wide = plan_world([dst, None], [None, src], cast=True)  # widening: the source's dtype
    assert wide[1].recvs[0].wire_dtype == "bfloat16" and wide[1].recvs[0].local_dtype == "float32"


# ------------------------------------------------------- one world of 4 ranks
DENSE = ModelSpec(layers=2)
MOE = ModelSpec(layers=2, experts=4, bias=False)
VOCAB_PAD = 128


@dataclass(frozen=True)
class Case:
    """``src``: the Megatron trainer's layout (default TP2 x DP2 over every rank), the
    engine whole on ``dst_ranks``; ``receiver``: FP8 tensors quantized on receipt (a
    pattern; the others on the sender), None where replicas share regions by rows
    (cuts that depend on byte counts): then only the totals are checked."""

    id: str
    kind: str
    block: tuple[int, int] = (128, 128)
    error: str | None = None
    spec: ModelSpec = DENSE
    src: Mesh = Mesh(2, ranks=WORLD)
    dst_ranks: tuple[int, ...] = tuple(range(WORLD))
    receiver: str | None = None


# The toy's TP2 cuts: q rows at 12, k / v rows at 6, o columns at 12, gate / up rows at
# 24, down columns at 24; lm_head (per-tensor scale) comes from two vocabulary shards.
TP2_ALONE = {"src": Mesh(2, ranks=2), "dst_ranks": (2, 3)}
CASES = [
    Case("cast-fp32-tp2->bf16", "cast"),
    Case("fp8-megatron-tp2->hf-whole", "fp8-hf", block=(5, 7)),
    # ranks 0 and 1 hold a TP shard and the whole engine: half of it quantized straight from
    # the local shard, half received; ranks 2 and 3 receive it all
    Case("fp8-tp2->hf-sender", "fp8-hf", block=(6, 4), receiver=r"^lm_head", src=Mesh(2, ranks=2)),
    Case("fp8-tp2->hf-receiver", "fp8-hf", block=(5, 7), receiver=r".", **TP2_ALONE),
    Case("fp8-tp2->hf-mixed", "fp8-hf", block=(12, 8), receiver=r"[kvo]_proj|^lm_head",
         src=Mesh(2, ranks=2)),
    # EP2: whole experts per rank, stacked into [E, 2I, H] / [E, H, I] on the sender; q / k / v
    # are 12- and 6-row strips of the fused QKV, which (5, 7) blocks straddle
    Case("fp8-ep2->hf-stacked-experts", "fp8-hf", block=(5, 7), spec=MOE, src=Mesh(ep=2, ranks=2),
         dst_ranks=(2, 3), receiver=r"[qkv]_proj"),
    Case("fp8-fsdp2-qwen2moe->vllm-tp2", "fp8-vllm", block=(6, 4)),
    Case("bad-fp8-grid", "fp8-hf", block=(4, 4),
         error="model.layers.0.mlp.down_proj.weight: model.layers.0.mlp.down_proj.weight_scale_inv "
               "[5, 7] is not the block grid [6, 12] of [24, 48] in blocks of [4, 4] (fp8_block=)"),
]
FP8_HF = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$|\.experts\.(gate_up_proj|down_proj)$")


def _cast(case: Case, rank: int) -> dict:
    src = build_toy(DENSE, Mesh(2, ranks=WORLD), rank, SRC_SEED)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        spec = ModelSpec(layers=2, dtype=dtype, buffer_dtype=dtype)
        dst = build_toy(spec, Mesh(1, ranks=WORLD), rank, DST_SEED)
        r = tr.Refitter(src, dst, cast=True)
        report = r.refit()
        want = {k: v.to(dtype) for k, v in expected_local(DENSE, Mesh(1, ranks=WORLD), rank, SRC_SEED).items()}
        got = dict(dst.state_dict())
        out[str(dtype)] = {"wrong": [k for k, v in want.items() if not torch.equal(got[k], v)],
                           "received": report.bytes_received,
                           "elements": sum(t.region.numel for t in r.plan.recvs)}
    return out


def _fp8_hf_engine(case: Case, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A whole engine in HF names: FP8 linear weights with block grids, lm_head per tensor;
    random starting values. A grid for fp8_block=(5, 7) tests a mismatch when told (4, 4)."""
    gen = torch.Generator().manual_seed(DST_SEED)
    out = {}
    grid = (5, 7) if case.error else case.block
    for n, t in full.items():
        x = torch.randn(t.shape, generator=gen)
        if FP8_HF.search(n):
            out[n] = x.to(FP8)
            cells = (-(-t.shape[-2] // grid[0]), -(-t.shape[-1] // grid[1]))
            out[n + "_scale_inv"] = torch.rand(t.shape[:-2] + cells, generator=gen)
        elif n == "lm_head.weight":
            out[n] = x.to(FP8)
            out[n + "_scale"] = torch.rand(1, generator=gen)
        else:
            out[n] = x
    return out


def _want_fp8(full: dict[str, torch.Tensor], start: dict[str, torch.Tensor],
              block) -> dict[str, torch.Tensor]:
    want = {}
    for n, t in start.items():
        if t.dtype != FP8:
            if not n.endswith(("_scale_inv", "_scale")):
                want[n] = full[n]
            continue
        if n + "_scale" in start:
            want[n], want[n + "_scale"] = oracle_tensor(full[n])
            want[n + "_scale"] = want[n + "_scale"].reshape(1)
        else:
            want[n], want[n + "_scale_inv"] = oracle_blocks(full[n], block)
    return want


def _fp8_hf(case: Case, rank: int) -> dict:
    from test_maps_engines import stacked

    spec = case.spec
    src = build_toy(spec, case.src, rank, SRC_SEED)
    ref = stacked(reference(toy_globals(spec, SRC_SEED), spec.heads, spec.groups), spec.layers,
                  spec.experts)
    full = {n: t for n, t in ref.items() if not re.search(r"(qkv|gate_up)_proj\.", n)
            and (not n.endswith(".bias") or re.search(r"\.(q|k|v)_proj\.bias$", n))}
    start = _fp8_hf_engine(case, full)
    dst = _module(start) if rank in case.dst_ranks else None
    return _refit(case, rank, src, dst, tr.maps.megatron_to_hf(num_heads=spec.heads,
                                                                num_query_groups=spec.groups),
                  _want_fp8(full, start, case.block), {})


def _fp8_vllm(case: Case, rank: int) -> dict:
    from test_maps_engines import Case as EngineCase

    src, full_hf = _fsdp2(EngineCase("x", "vllm", "Qwen2Moe", MOE, None))
    full = vllm_reference(full_hf, VOCAB_PAD)
    gen = torch.Generator().manual_seed(DST_SEED)
    start_full, want_full = {}, {}
    for n, t in full.items():
        x = torch.randn(t.shape, generator=gen)
        if re.search(r"(qkv_proj|gate_up_proj|o_proj|down_proj)\.weight$|w13_weight$|w2_weight$", n):
            start_full[n] = x.to(FP8)
            q, s = oracle_blocks(t, case.block)
            want_full[n], want_full[n + "_scale_inv"] = q, s
            start_full[n + "_scale_inv"] = torch.rand(s.shape, generator=gen)
        else:
            start_full[n] = x
            want_full[n] = torch.where(t.isnan(), x, t)  # padding rows keep the engine's
    dst = _module(_vllm_engine(start_full, rank % 2, MOE))
    want = _vllm_engine(want_full, rank % 2, MOE)
    heads = {"num_attention_heads": MOE.heads, "num_key_value_heads": MOE.groups}
    layout = vllm_tp_layout(rank % 2, 2, num_heads=MOE.heads, num_kv_heads=MOE.groups)
    return _refit(case, rank, src, dst, tr.maps.hf_to_vllm(heads), want, {"dst_layout": layout})


def _refit(case: Case, rank: int, src, dst, name_map, want, kwargs) -> dict:
    params = dict(dst.named_parameters()) if dst is not None else {}
    before = {n: _bits(p.detach()).clone() for n, p in params.items()}
    try:
        r = tr.Refitter(src, dst, name_map=name_map, fp8_block=case.block, **kwargs)
    except tr.RefitError as e:
        return {"raised": f"{type(e).__name__}: {e}", "unchanged": all(
            torch.equal(_bits(p.detach()), before[n]) for n, p in params.items())}
    report = r.refit()
    verified = _verified(r)  # collective: every rank
    if dst is None:
        return {"verified": verified, "fp8_buffers": report.fp8_buffer_bytes}
    got = {n: p.detach() for n, p in params.items()}
    wrong = [n for n, t in want.items() if not torch.equal(_bits(got[n]), _bits(t))]
    fp8 = sorted(n for n, t in got.items() if t.dtype == FP8)
    wire: dict[str, list[int]] = {}  # bytes on the wire into each FP8 tensor, its elements
    for t in r.plan.recvs:
        if t.name in fp8:
            w = wire.setdefault(t.name, [0, 0])
            w[0], w[1] = w[0] + t.nbytes, w[1] + t.region.numel
    if case.id.endswith("mixed"):
        verified = _corrupted_and_caught(r, got, fp8, case.receiver)
    return {"wrong": wrong, "fp8": fp8, "sender": report.fp8_on_sender,
            "receiver": report.fp8_on_receiver, "n": len(want),
            "split": {n: got[n].numel() for n in fp8},  # elements (= FP8 bytes) per tensor
            "wire": wire, "verified": verified,
            "fp8_buffers": report.fp8_buffer_bytes, "shadow": report.fp8_shadow_bytes}


def _corrupted_and_caught(r: tr.Refitter, got, fp8: list[str], on_receipt: str) -> str:
    """Flip one FP8 value of a tensor quantized on the sender and of one quantized on
    receipt, in turn: verify() must name each (the first is compared through the
    exchange, the second against the torch quantization of its shadow)."""
    names = [next(n for n in fp8 if not re.search(on_receipt, n)),
             next(n for n in fp8 if re.search(on_receipt, n))]
    for name in names:
        bits = got[name].view(torch.uint8).view(-1)
        bits[0] ^= 1
        caught = _verified(r)
        bits[0] ^= 1
        if name not in caught:
            return f"verify() missed a corrupted {name}: {caught}"
    return _verified(r)


def _verified(r: tr.Refitter) -> str:
    try:
        r.verify()
    except tr.VerificationError as e:
        return str(e)
    except Exception:
        import traceback
        return traceback.format_exc()
    return "ok"


def _world(rank: int, world: int, cases: list[Case], transport: str = "auto") -> dict[str, dict]:
    settings.configure(transport=transport)  # what "auto" means in every Refitter of this world
    torch.set_num_threads(1)
    out = {}
    for case in cases:
        try:
            out[case.id] = {"cast": _cast, "fp8-hf": _fp8_hf, "fp8-vllm": _fp8_vllm}[case.kind](case, rank)
        except Exception as e:  # recorded per case; the next case still runs on every rank
            import traceback
            out[case.id] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        dist.barrier()
    return out


@pytest.fixture(scope="module", params=usable_transports(cuda=False))
def results(request) -> tuple[str, list[dict[str, dict]]]:
    pytest.importorskip("transformers")
    return request.param, run_world(_world, WORLD, CASES, request.param, timeout=420, pg_timeout=120)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_transform_case(case: Case, results) -> None:
    transport, results = results
    for rank, per_rank in enumerate(results):
        got = per_rank[case.id]
        assert "error" not in got, f"rank {rank}: {got['error']}"
        if case.error is not None:
            assert "raised" in got and got["raised"].startswith("PlanError: "), got
            assert case.error in got["raised"], got["raised"]
            assert got["raised"] == results[0][case.id]["raised"], "ranks raised different errors"
            assert got["unchanged"], f"rank {rank}: destination written by a failed refit"
            continue
        if case.kind == "cast":
            bf16, fp32 = got["torch.bfloat16"], got["torch.float32"]
            assert bf16["wrong"] == [] and fp32["wrong"] == [], (bf16["wrong"], fp32["wrong"])
            assert bf16["elements"] > 0 and bf16["received"] == 2 * bf16["elements"]
            assert fp32["received"] == 2 * bf16["received"]
            continue
        assert "raised" not in got, got.get("raised")
        assert got["verified"] == "ok", got["verified"]
        if rank not in case.dst_ranks:
            continue
        assert got["wrong"] == [], f"rank {rank}: {got['wrong'][:6]}"
        total = sum(got["split"].values())
        assert got["fp8"] and got["sender"] + got["receiver"] == total, got
        if transport_class(transport).protocol == "one_sided":  # senders transform nothing
            assert got["sender"] == 0, got
        elif case.receiver is not None:  # exactly the tensors the block cuts say
            on_receipt = sum(n for name, n in got["split"].items() if re.search(case.receiver, name))
            assert (got["sender"], got["receiver"]) == (total - on_receipt, on_receipt)
            for name, (nbytes, elements) in got["wire"].items():  # FP8, or fp32 into shadows
                assert nbytes == (4 if re.search(case.receiver, name) else 1) * elements, name
            # the report counts the fp32 shadows the exchange fills for those tensors
            assert got["shadow"] == 4 * on_receipt, (got["shadow"], on_receipt)
        if any(n == e for r in results if "wire" in r[case.id] for n, e in r[case.id]["wire"].values()):
            # FP8 on the wire: some sender held FP8 buffers, and the report says so
            assert any(r[case.id].get("fp8_buffers", 0) > 0 for r in results), case.id
        if case.kind == "fp8-vllm":
            assert any(n.endswith("w13_weight") for n in got["fp8"])
            assert any(n.endswith("qkv_proj.weight") for n in got["fp8"])
