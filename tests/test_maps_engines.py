"""Maps for real engines: ``hf_to_vllm``, ``megatron_to_vllm``, ``hf_to_megatron``,
``torchtitan_to_hf`` and ``transformers`` 5 stacked experts in ``megatron_to_hf``.

Every expected value is computed here with plain torch (``cat``, ``stack``,
``chunk``, ``view``/``transpose``) from full tensors, never from the maps.

In one process: each map's segments, applied to full tensors, equal the reference
(vLLM's fused ``[q; k; v]`` and ``[gate; up]``, stacked ``w13_weight`` /
``w2_weight`` from three source forms, padded vocabularies whose padding rows stay,
Megatron's experts into ``transformers`` 5's stacked ``gate_up_proj`` /
``down_proj``, Megatron -> vLLM as the composition, HF -> Megatron inverting
both split and fused sources, torchtitan's rotary row order); shapes that do not
fit raise ``PlanError`` naming the tensor.

In one spawned world of 4 ranks per transport usable on CPU here (gloo; nixl where
``nixl-cu13`` is installed: fused and stacked regions written remotely), real refits into ``transformers`` models
built from tiny random configs (no downloads): Megatron-style TP2 / PP2 / EP2 toy
trainers into ``Qwen2ForCausalLM``, ``LlamaForCausalLM`` and ``MixtralForCausalLM``,
and an FSDP2 ``Qwen2MoeForCausalLM`` trainer into its own class, each checked by
logits against a model loaded from the reference conversion (rtol 1e-5); an FSDP2
Qwen2-MoE trainer and a Megatron EP2 trainer into a vLLM-style TP2 engine with
fused, stacked-expert, vocabulary-padded tensors, checked weight by weight.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from test_maps_hf import _module, _vllm_shard, reference, toy_globals

import torchrefit as tr
from torchrefit import settings
from torchrefit.layout._types import Box
from torchrefit.layout.vllm_tp import vllm_tp_layout
from torchrefit.maps import relocate
from torchrefit.testing import Mesh, ModelSpec, build_toy, run_world, usable_transports

transformers = pytest.importorskip("transformers")

WORLD = 4
SRC_SEED, DST_SEED = 1, 2
TOKENS = torch.tensor([[3, 17, 42, 5, 88, 1, 60, 33]])


# --------------------------------------------------------------- the references
def stacked(ref: dict[str, torch.Tensor], layers: int, experts: int) -> dict[str, torch.Tensor]:
    """transformers 5 names: per-expert ``gate_up_proj`` / ``down_proj`` stacked on dim 0."""
    out = {n: t for n, t in ref.items() if ".experts." not in n}
    for i in range(layers):
        p = f"model.layers.{i}.mlp.experts."
        if f"{p}0.down_proj.weight" not in ref:
            continue
        out[p + "gate_up_proj"] = torch.stack([ref[f"{p}{e}.gate_up_proj.weight"] for e in range(experts)])
        out[p + "down_proj"] = torch.stack([ref[f"{p}{e}.down_proj.weight"] for e in range(experts)])
    return out


def vllm_reference(hf: dict[str, torch.Tensor], vocab: int) -> dict[str, torch.Tensor]:
    """vLLM names from transformers 5 names: fused attention and MLP, w13/w2 experts,
    embeddings padded to ``vocab`` rows (padding rows NaN: whatever the engine had)."""
    out = {}
    for n, t in hf.items():
        m = re.fullmatch(r"(model\.layers\.\d+\.)(self_attn|mlp(?:\.shared_experts?)?)\."
                         r"(q_proj|gate_proj|experts\.\w+)(.*)", n)
        if m is None:
            if re.search(r"\.(k|v|up)_proj\.", n):
                continue
            if n in ("model.embed_tokens.weight", "lm_head.weight"):
                t = torch.cat([t, torch.full((vocab - t.shape[0], t.shape[1]), float("nan"))])
            out[n] = t
            continue
        p, mod, what, leaf = m.groups()
        if what == "q_proj":
            out[f"{p}self_attn.qkv_proj{leaf}"] = torch.cat(
                [hf[f"{p}self_attn.{x}_proj{leaf}"] for x in "qkv"])
        elif what == "gate_proj":  # also a shared expert's
            out[f"{p}{mod}.gate_up_proj{leaf}"] = torch.cat([t, hf[f"{p}{mod}.up_proj{leaf}"]])
        elif what == "experts.gate_up_proj":
            out[f"{p}mlp.experts.w13_weight"] = t
        elif what == "experts.down_proj":
            out[f"{p}mlp.experts.w2_weight"] = t
    return out


def apply_map(name_map, dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor],
              aliases: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Fill each destination from the map's segments over full sources; every element
    written exactly once, padding rows kept as they were."""
    out = {}
    for name, want in dst.items():
        shape = tuple(want.shape)
        segs = name_map.segments(name, shape, src, aliases or {})
        assert segs is not None, f"{name}: no source"
        got = want.clone()
        hits = torch.zeros(shape, dtype=torch.int32)
        for s in segs:
            box = relocate(s.dst_box, s.dst_box.offset, s.src_offset)
            got[s.dst_box.slices()] = src[s.src_name][box.slices()].reshape(s.dst_box.size)
            hits[s.dst_box.slices()] += 1
        for pad in name_map.padding(name, shape, src, aliases or {}):
            hits[pad.slices()] += 1
        assert bool((hits == 1).all()), f"{name}: not covered exactly once"
        out[name] = got
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b, 7.0))


def _hf_model(cls_name: str, spec: ModelSpec, seed: int, vocab: int | None = None):
    """A transformers model of the toy's geometry, random weights from ``seed``."""
    T = transformers
    common = dict(vocab_size=vocab or spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                  num_attention_heads=spec.heads, num_key_value_heads=spec.groups,
                  head_dim=spec.head_dim, tie_word_embeddings=False)
    if cls_name == "Llama":
        cfg = T.LlamaConfig(intermediate_size=spec.ffn, **common)
    elif cls_name == "Qwen2":
        cfg = T.Qwen2Config(intermediate_size=spec.ffn, **common)
    elif cls_name == "Mixtral":
        cfg = T.MixtralConfig(intermediate_size=spec.expert_ffn, num_local_experts=spec.experts,
                              num_experts_per_tok=2, **common)
    else:
        cfg = T.Qwen2MoeConfig(intermediate_size=spec.ffn, moe_intermediate_size=spec.expert_ffn,
                               shared_expert_intermediate_size=spec.ffn, num_experts=spec.experts,
                               num_experts_per_tok=2, decoder_sparse_step=1, **common)
    torch.manual_seed(seed)
    model = getattr(T, f"{cls_name}ForCausalLM")(cfg).eval()
    return model


# ------------------------------------------------------------ in one process
H, FF, E, HEADS, KV, D = 8, 6, 4, 4, 2, 2


def _hf_state(form: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g)

    p = "model.layers.0."
    out = {p + "self_attn.q_proj.weight": r(HEADS * D, H), p + "self_attn.k_proj.weight": r(KV * D, H),
           p + "self_attn.v_proj.weight": r(KV * D, H), p + "self_attn.q_proj.bias": r(HEADS * D),
           p + "self_attn.k_proj.bias": r(KV * D), p + "self_attn.v_proj.bias": r(KV * D),
           p + "mlp.shared_expert.gate_proj.weight": r(FF, H), p + "mlp.shared_expert.up_proj.weight": r(FF, H),
           "model.embed_tokens.weight": r(10, H)}
    if form == "hf5":
        out[p + "mlp.experts.gate_up_proj"] = r(E, 2 * FF, H)
        out[p + "mlp.experts.down_proj"] = r(E, H, FF)
    for e in range(E):
        if form == "hf4":
            out.update({p + f"mlp.experts.{e}.gate_proj.weight": r(FF, H),
                        p + f"mlp.experts.{e}.up_proj.weight": r(FF, H),
                        p + f"mlp.experts.{e}.down_proj.weight": r(H, FF)})
        elif form == "mixtral4":
            x = p + f"block_sparse_moe.experts.{e}."
            out.update({x + "w1.weight": r(FF, H), x + "w3.weight": r(FF, H), x + "w2.weight": r(H, FF)})
    return out


def _w13_w2(src: dict[str, torch.Tensor], form: str) -> tuple[torch.Tensor, torch.Tensor]:
    p = "model.layers.0."
    if form == "hf5":
        return src[p + "mlp.experts.gate_up_proj"], src[p + "mlp.experts.down_proj"]
    names = {"hf4": ("mlp.experts.{}.gate_proj.weight", "mlp.experts.{}.up_proj.weight",
                     "mlp.experts.{}.down_proj.weight"),
             "mixtral4": ("block_sparse_moe.experts.{}.w1.weight", "block_sparse_moe.experts.{}.w3.weight",
                          "block_sparse_moe.experts.{}.w2.weight")}[form]
    gate, up, down = ([src[p + n.format(e)] for e in range(E)] for n in names)
    return torch.stack([torch.cat([a, b]) for a, b in zip(gate, up)]), torch.stack(down)


@pytest.mark.parametrize("moe", ["mlp", "block_sparse_moe"])
@pytest.mark.parametrize("form", ["hf5", "hf4", "mixtral4"])
def test_hf_to_vllm_segments_equal_reference(form: str, moe: str) -> None:
    src = _hf_state(form)
    p = "model.layers.0."
    dst = {p + "self_attn.qkv_proj.weight": torch.zeros((HEADS + 2 * KV) * D, H),
           p + "self_attn.qkv_proj.bias": torch.zeros((HEADS + 2 * KV) * D),
           p + "mlp.shared_expert.gate_up_proj.weight": torch.zeros(2 * FF, H),
           p + f"{moe}.experts.w13_weight": torch.zeros(E, 2 * FF, H),
           p + f"{moe}.experts.w2_weight": torch.zeros(E, H, FF),
           "model.embed_tokens.weight": torch.full((16, H), 7.0),
           "lm_head.weight": torch.full((16, H), 5.0)}
    got = apply_map(tr.maps.hf_to_vllm({"num_attention_heads": HEADS, "num_key_value_heads": KV}),
                    dst, src, {"lm_head.weight": "model.embed_tokens.weight"})  # tied
    for leaf in ("weight", "bias"):
        want = torch.cat([src[f"{p}self_attn.{x}_proj.{leaf}"] for x in "qkv"])
        assert torch.equal(got[f"{p}self_attn.qkv_proj.{leaf}"], want)
    assert torch.equal(got[p + "mlp.shared_expert.gate_up_proj.weight"],
                       torch.cat([src[p + "mlp.shared_expert.gate_proj.weight"],
                                  src[p + "mlp.shared_expert.up_proj.weight"]]))
    w13, w2 = _w13_w2(src, form)
    assert torch.equal(got[p + f"{moe}.experts.w13_weight"], w13)
    assert torch.equal(got[p + f"{moe}.experts.w2_weight"], w2)
    for name, pad in (("model.embed_tokens.weight", 7.0), ("lm_head.weight", 5.0)):
        assert torch.equal(got[name][:10], src["model.embed_tokens.weight"])
        assert bool((got[name][10:] == pad).all()), f"{name}: padding rows written"


MOE = ModelSpec(layers=2, experts=4, bias=False)


@pytest.mark.parametrize("spec", [MOE, ModelSpec(layers=2, experts=4, grouped_experts=True)],
                         ids=["local-experts", "grouped"])
def test_megatron_to_hf_stacks_experts_and_composes_to_vllm(spec: ModelSpec) -> None:
    g = toy_globals(spec)
    hf = stacked(reference(g, spec.heads, spec.groups), spec.layers, spec.experts)
    hf = {n: t for n, t in hf.items() if not re.search(r"(qkv|gate_up)_proj\.", n)}
    got = apply_map(tr.maps.megatron_to_hf(num_heads=spec.heads, num_query_groups=spec.groups),
                    {n: torch.zeros_like(t) for n, t in hf.items()}, g)
    for n, t in hf.items():
        assert torch.equal(got[n], t), n
    assert "model.layers.1.mlp.experts.gate_up_proj" in got
    vllm = vllm_reference(hf, 128)
    got = apply_map(tr.maps.megatron_to_vllm(num_heads=spec.heads, num_query_groups=spec.groups),
                    {n: torch.full_like(t, float("nan")) for n, t in vllm.items()}, g)
    for n, t in vllm.items():
        assert _same(got[n], t), n


@pytest.mark.parametrize("fused", [False, True, None], ids=["from-split", "from-fused", "from-both"])
def test_hf_to_megatron_inverts_the_table(fused: bool | None) -> None:
    spec = ModelSpec(layers=2, experts=4, router_bias=True)
    g = toy_globals(spec)
    hf = stacked(reference(g, spec.heads, spec.groups), spec.layers, spec.experts)
    drop = {True: r"\.(q|k|v|gate|up)_proj\.", False: r"(qkv|gate_up)_proj\.", None: "^$"}[fused]
    hf = {n: t for n, t in hf.items() if not re.search(drop, n)}
    got = apply_map(tr.maps.hf_to_megatron(num_heads=spec.heads, num_query_groups=spec.groups),
                    {n: torch.zeros_like(t) for n, t in g.items()}, hf)
    for n, t in g.items():
        assert torch.equal(got[n], t), n


def test_relocate_moves_boxes_between_stacked_and_single_experts() -> None:
    one = Box((2, 0), (3, 4))  # rows 2:5 of an expert [8, 4]
    stacked = relocate(one, (0, 0), (5, 0, 0))  # expert 5 of [E, 8, 4]
    assert stacked == Box((5, 2, 0), (1, 3, 4))
    assert relocate(stacked, (5, 0, 0), (0, 0)) == one
    assert relocate(Box((1, 1), (2, 2)), (1, 0), (3, 0)) == Box((3, 1), (2, 2))


def test_torchtitan_to_hf_reorders_rotary_rows_as_torchtitan_does() -> None:
    g = torch.Generator().manual_seed(0)
    heads, kv, d, hidden = 4, 2, 6, 24
    src = {"layers.0.attention.wq.weight": torch.randn(heads * d, hidden, generator=g),
           "layers.0.attention.wk.weight": torch.randn(kv * d, hidden, generator=g),
           "layers.0.feed_forward.w3.weight": torch.randn(10, hidden, generator=g),
           "tok_embeddings.weight": torch.randn(10, hidden, generator=g)}

    def permute(w: torch.Tensor, n: int) -> torch.Tensor:  # torchtitan's own adapter
        return w.view(n, w.shape[0] // n // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    want = {"model.layers.0.self_attn.q_proj.weight": permute(src["layers.0.attention.wq.weight"], heads),
            "model.layers.0.self_attn.k_proj.weight": permute(src["layers.0.attention.wk.weight"], kv),
            "model.layers.0.mlp.up_proj.weight": src["layers.0.feed_forward.w3.weight"],
            "model.embed_tokens.weight": src["tok_embeddings.weight"]}
    m = tr.maps.torchtitan_to_hf({"n_heads": heads, "n_kv_heads": kv})
    got = apply_map(m, {n: torch.zeros_like(t) for n, t in want.items()}, src)
    for n, t in want.items():
        assert torch.equal(got[n], t), n


@pytest.mark.parametrize("name,shape,match", [
    ("model.layers.0.self_attn.qkv_proj.weight", (10, H), "is not \\[q; k; v\\] with num_heads=4"),
    ("model.layers.0.mlp.experts.w13_weight", (E, 2 * FF, H + 1), "differs from its source"),
    ("model.embed_tokens.weight", (8, H), "cannot hold the source's"),
])
def test_hf_to_vllm_shapes_that_do_not_fit(name, shape, match) -> None:
    with pytest.raises(tr.PlanError, match=match):
        tr.maps.hf_to_vllm(num_heads=HEADS, num_kv_heads=KV).segments(name, shape, _hf_state("hf5"), {})


# ------------------------------------------------------- one world of 4 ranks
@dataclass(frozen=True)
class Case:
    id: str
    kind: str  # "logits": a whole transformers model; "vllm": a vLLM-style TP2 engine
    dst: str  # transformers class prefix
    spec: ModelSpec
    src: Mesh | None  # a Megatron toy trainer; None: an FSDP2 transformers trainer


def _m(tp=1, pp=1, ep=1) -> Mesh:
    return Mesh(tp=tp, pp=pp, ep=ep, ranks=WORLD)


QWEN2 = ModelSpec(layers=2)
CASES = [
    Case("megatron-tp2->qwen2", "logits", "Qwen2", QWEN2, _m(2)),
    Case("megatron-pp2->llama", "logits", "Llama", ModelSpec(layers=2, bias=False), _m(pp=2)),
    Case("megatron-ep2->mixtral", "logits", "Mixtral", MOE, _m(ep=2)),
    Case("fsdp2-qwen2moe->qwen2moe", "logits", "Qwen2Moe", MOE, None),
    Case("fsdp2-qwen2moe->vllm-tp2", "vllm", "Qwen2Moe", MOE, None),
    Case("megatron-ep2tp2->vllm-tp2-mixtral", "vllm", "Mixtral", MOE, _m(2, ep=2)),
    # No name map: the error names the closest source names and both detected layouts.
    Case("bad-megatron-tp2->qwen2-without-map", "bad", "Qwen2", QWEN2, _m(2)),
]
NO_MAP_ERROR = (
    "lm_head.weight: destination tensor (dst ranks [0, 1, 2, 3]) has no source tensor "
    "(no source rank holds 'lm_head.weight' or an alias of it; closest source names: "
    "'output_layer.weight', ",
    "(and 26 more; err.detail lists them). Tensors without a source (source detected as "
    "megatron (ranks [0, 1, 2, 3]), destination detected as replicated (ranks [0, 1, 2, 3])): "
    "where the two sides name tensors differently, pass a name map (name_map=tr.maps.megatron_to_hf")
VOCAB_PAD = 128


def _megatron_hf(case: Case) -> dict[str, torch.Tensor]:
    s = case.spec
    return stacked(reference(toy_globals(s, SRC_SEED), s.heads, s.groups), s.layers, s.experts)


def _fsdp2(case: Case):
    """The transformers trainer, FSDP2-sharded over all ranks (per layer and root)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _hf_model(case.dst, case.spec, SRC_SEED)
    full = {n: t.detach().clone() for n, t in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh), full


def _source(case: Case, rank: int):
    if case.src is not None:
        src = build_toy(case.spec, case.src, rank, SRC_SEED)
        return src, _megatron_hf(case), tr.maps.megatron_to_hf
    src, full = _fsdp2(case)
    return src, full, None


def _run_logits(case: Case, rank: int) -> dict:
    src, full_hf, map_fn = _source(case, rank)
    ref = _hf_model(case.dst, case.spec, DST_SEED)
    missing, unexpected = ref.load_state_dict(full_hf, strict=False)
    assert not missing, missing
    dst = _hf_model(case.dst, case.spec, DST_SEED)
    kwargs = {"name_map": map_fn(dst.config)} if map_fn else {}
    with torch.no_grad():
        want, before = ref(TOKENS).logits, dst(TOKENS).logits
    r = tr.Refitter(src, dst, **kwargs)
    r.refit()
    with torch.no_grad():
        got = dst(TOKENS).logits
    r.verify()
    return {"differed_before": not torch.allclose(before, want),
            "max_err": float((got - want).abs().max()), "ok": torch.allclose(got, want, rtol=1e-5, atol=1e-6),
            "remote": r.plan.bytes_sent + r.plan.bytes_received, "transport": r.transport_name}


def _run_bad(case: Case, rank: int) -> dict:
    src, _, _ = _source(case, rank)
    dst = _hf_model(case.dst, case.spec, DST_SEED)
    before = {n: p.detach().clone() for n, p in dst.named_parameters()}
    try:
        tr.Refitter(src, dst)
    except tr.RefitError as e:
        return {"raised": f"{type(e).__name__}: {e}", "detail": e.detail,
                "parts": (e.tensor, e.ranks, e.rule),
                "unchanged": all(torch.equal(p, before[n]) for n, p in dst.named_parameters()),
                "remote": -1}
    return {"raised": None}


def _vllm_engine(full: dict[str, torch.Tensor], r: int, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """vLLM TP2 rank r's shards, plain torch: the attention / MLP rules of test_maps_hf,
    and w13 = [its gate rows; its up rows] of every expert, w2 its columns."""
    out = {}
    for n, t in full.items():
        base = n.removesuffix("_scale_inv")  # an FP8 block grid is cut as its weight
        if base.endswith("w13_weight"):
            gate, up = t.chunk(2, 1)
            out[n] = torch.cat([gate.chunk(2, 1)[r], up.chunk(2, 1)[r]], 1)
        elif base.endswith("w2_weight"):
            out[n] = t.chunk(2, 2)[r]
        else:
            out[n] = _vllm_shard(base, t, r, 2, spec.heads, spec.groups)
    return {n: t.clone() for n, t in out.items()}


def _run_vllm(case: Case, rank: int) -> dict:
    src, full_hf, map_fn = _source(case, rank)
    want_full = vllm_reference(full_hf, VOCAB_PAD)
    if case.dst == "Mixtral":  # vLLM's Mixtral names its MoE block block_sparse_moe
        want_full = {n.replace(".mlp.experts.w", ".block_sparse_moe.experts.w")
                      .replace(".mlp.gate.", ".block_sparse_moe.gate."): t for n, t in want_full.items()}
    gen = torch.Generator().manual_seed(DST_SEED)
    start = {n: torch.randn(t.shape, generator=gen) for n, t in want_full.items()}
    dst = _module(_vllm_engine(start, rank % 2, case.spec))
    want = _vllm_engine({n: torch.where(t.isnan(), start[n], t) for n, t in want_full.items()},
                        rank % 2, case.spec)
    heads = {"num_attention_heads": case.spec.heads, "num_key_value_heads": case.spec.groups}
    name_map = tr.maps.megatron_to_vllm(heads) if map_fn else tr.maps.hf_to_vllm(heads)
    r = tr.Refitter(src, dst, name_map=name_map, dst_layout=vllm_tp_layout(
        rank % 2, 2, num_heads=case.spec.heads, num_kv_heads=case.spec.groups))
    r.refit()
    wrong = [n for n, p in dst.named_parameters() if not torch.equal(p.detach(), want[n])]
    r.verify()
    return {"wrong": wrong, "n": len(want), "remote": r.plan.bytes_sent + r.plan.bytes_received,
            "names": sorted(want)}


def _world(rank: int, world: int, cases: list[Case], transport: str = "auto") -> dict[str, dict]:
    settings.configure(transport=transport)  # what "auto" means in every Refitter of this world
    torch.set_num_threads(1)
    out = {}
    for case in cases:
        try:
            run = {"logits": _run_logits, "vllm": _run_vllm, "bad": _run_bad}[case.kind]
            out[case.id] = run(case, rank)
        except Exception as e:  # recorded per case; the next case still runs on every rank
            import traceback
            out[case.id] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        dist.barrier()
    return out


@pytest.fixture(scope="module", params=usable_transports(cuda=False))
def results(request) -> tuple[str, list[dict[str, dict]]]:
    return request.param, run_world(_world, WORLD, CASES, request.param, timeout=420, pg_timeout=120)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_refit_into_engine(case: Case, results) -> None:
    transport, results = results
    for rank, per_rank in enumerate(results):
        got = per_rank[case.id]
        assert "error" not in got, f"rank {rank}: {got['error']}"
        if case.kind == "bad":
            assert got["raised"] is not None and got["raised"].startswith("PlanError: "), got
            assert all(part in got["raised"] for part in NO_MAP_ERROR), got["raised"]
            # one line; every tensor without a source in err.detail, the first's parts apart
            assert "\n" not in got["raised"]
            assert "closest source names: 'embedding.word_embeddings.weight', " in got["detail"]
            assert got["parts"] == ("lm_head.weight", (0, 1, 2, 3), "no source"), got["parts"]
            assert got["raised"] == results[0][case.id]["raised"], "ranks raised different errors"
            assert got["unchanged"], f"rank {rank}: destination written by a failed refit"
            continue
        assert got["remote"] > 0, "the refit moved nothing between ranks"
        if case.kind == "logits":
            assert got["differed_before"], "logits equal before the refit: the test proves nothing"
            assert got["ok"], f"rank {rank}: logits differ by {got['max_err']}"
            assert got["transport"] == transport, got["transport"]  # TORCHREFIT_TRANSPORT followed
        else:
            assert got["wrong"] == [], f"rank {rank}: {got['wrong'][:5]}"
            assert any(n.endswith("experts.w13_weight") for n in got["names"])
            assert any(n.endswith("qkv_proj.weight") for n in got["names"])
