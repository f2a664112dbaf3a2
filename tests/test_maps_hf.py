"""``tr.maps.megatron_to_hf``: Megatron-core trainers refit into Hugging Face / vLLM names.

Every expected value comes from a reference conversion written here with plain
torch indexing (``unflatten`` of ``linear_qkv`` by query group, ``chunk`` of
``linear_fc1``) from the toy's global Megatron tensors, never from the map.

In one process: the map's segments, applied to full tensors, equal the reference
for MHA, GQA, MQA, a head dim other than hidden / heads, the local spec's norm
names, Qwen3 q/k norms and shared experts; identity fallback, config parsing,
``cache_key`` and argument errors.

In one spawned world of 4 gloo ranks: real refits from toy trainers (GQA, SwiGLU,
TP2 / TP4 / PP2 / EP2 / expert-TP2 sources) into Hugging Face-named engines, held
whole on every rank or sharded vLLM-style (``layout.vllm_tp``, TP2 and TP4 with
replicated kv heads): split and fused names, Qwen2 qkv biases, tied embeddings,
MoE with ``local_experts.K`` and grouped ``weightK`` experts, the router's
``expert_bias``. Bad cases (head counts that do not fit, a gate/up that does not
fit, a mapped and an unmapped name with no source) raise the same error on every
rank, naming the tensor, and write nothing.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchrefit as tr
from torchrefit.layout._types import Box
from torchrefit.layout.vllm_tp import vllm_tp_layout
from torchrefit.testing import Mesh, ModelSpec, build_toy, run_world
from torchrefit.testing.toy import global_table, global_value

WORLD = 4
SRC_SEED, DST_SEED = 1, 2
EMB = "embedding.word_embeddings.weight"


# --------------------------------------------------------------- the reference
def _split_qkv(t: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, ...]:
    """Megatron's [q x heads/groups, k, v] per query group -> (q, k, v), plain indexing."""
    per = heads // groups
    x = t.unflatten(0, (groups, per + 2, -1))
    return x[:, :per].flatten(0, 2), x[:, per].flatten(0, 1), x[:, per + 1].flatten(0, 1)


def _gated(out: dict, prefix: str, leaf: str, t: torch.Tensor) -> None:
    gate, up = t.chunk(2)
    out[f"{prefix}gate_proj.{leaf}"], out[f"{prefix}up_proj.{leaf}"] = gate, up
    out[f"{prefix}gate_up_proj.{leaf}"] = t


_RENAMES = {  # Megatron layer suffix -> Hugging Face layer suffix (whole tensors)
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
_EXPERT = re.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.linear_(fc\d)\.weight|linear_(fc\d)\.weight(\d+))")


def reference(g: dict[str, torch.Tensor], heads: int, groups: int) -> dict[str, torch.Tensor]:
    """Every Hugging Face / vLLM tensor (split and fused forms) from global Megatron tensors."""
    out = {"model.embed_tokens.weight": g[EMB], "model.norm.weight": g["decoder.final_layernorm.weight"],
           "lm_head.weight": g.get("output_layer.weight", g[EMB])}
    for name, t in g.items():
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
        if m is None:
            continue
        p, rest = f"model.layers.{m.group(1)}.", m.group(2)
        e = _EXPERT.fullmatch(rest)
        if rest in _RENAMES:
            out[p + _RENAMES[rest]] = t
        elif rest.startswith("self_attention.linear_qkv."):
            leaf = rest.rsplit(".", 1)[1]
            q, k, v = _split_qkv(t, heads, groups)
            for kind, x in zip("qkv", (q, k, v)):
                out[f"{p}self_attn.{kind}_proj.{leaf}"] = x
            out[f"{p}self_attn.qkv_proj.{leaf}"] = torch.cat([q, k, v])
        elif rest.startswith("mlp.linear_fc1."):
            _gated(out, p + "mlp.", rest.rsplit(".", 1)[1], t)
        elif rest == "mlp.shared_experts.linear_fc1.weight":
            _gated(out, p + "mlp.shared_experts.", "weight", t)
        elif e is not None:
            expert, fc = (e.group(1), e.group(2)) if e.group(1) else (e.group(4), e.group(3))
            q = f"{p}mlp.experts.{expert}."
            if fc == "fc1":
                _gated(out, q, "weight", t)
            else:
                out[q + "down_proj.weight"] = t
    return out


def toy_globals(spec: ModelSpec, seed: int = SRC_SEED) -> dict[str, torch.Tensor]:
    """The toy trainer's global tensors, from its oracle."""
    return {n: global_value(n, d.shape, seed, spec) for n, d in global_table(spec).items()
            if d.persistent}


def pick(ref: dict[str, torch.Tensor], *, fused: bool, biases: str = "qkv") -> dict[str, torch.Tensor]:
    """The names one engine holds: split or fused; biases "qkv" (Qwen2), "all" or "none"."""
    drop = ("q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj.") if fused else \
        ("qkv_proj.", "gate_up_proj.")
    out = {}
    for n, t in ref.items():
        if any(f".{d}" in n for d in drop):
            continue
        if n.endswith(".bias") and (biases == "none" or (
                biases == "qkv" and not re.search(r"\.(q|k|v|qkv)_proj\.bias$", n))):
            continue
        out[n] = t
    return out


def apply_map(name_map, dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor],
              aliases: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Fill each destination tensor from the map's segments over full source tensors,
    checking each element is written exactly once."""
    out = {}
    for name, want in dst.items():
        segs = name_map.segments(name, tuple(want.shape), src, aliases or {})
        assert segs is not None, f"{name}: no source"
        got = torch.zeros_like(want)
        hits = torch.zeros(want.shape, dtype=torch.int32)
        for s in segs:
            got[s.dst_box.slices()] = src[s.src_name][Box(s.src_offset, s.dst_box.size).slices()]
            hits[s.dst_box.slices()] += 1
        assert bool((hits == 1).all()), f"{name}: not covered exactly once"
        out[name] = got
    return out


# ------------------------------------------------------------ in one process
UNIT_SPECS = {
    "gqa": ModelSpec(layers=2),
    "mha": ModelSpec(layers=2, heads=4, groups=4),
    "mqa": ModelSpec(layers=2, heads=4, groups=1),
    "moe-local": ModelSpec(layers=2, experts=4, router_bias=True),
    "moe-grouped": ModelSpec(layers=2, experts=4, grouped_experts=True),
    "tied": ModelSpec(layers=2, tie=True),
}


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("key", list(UNIT_SPECS))
def test_segments_equal_reference(key: str, fused: bool) -> None:
    spec = UNIT_SPECS[key]
    g = toy_globals(spec)
    want = pick(reference(g, spec.heads, spec.groups), fused=fused, biases="all")
    aliases = {"output_layer.weight": EMB} if spec.tie else {}
    got = apply_map(tr.maps.megatron_to_hf(num_heads=spec.heads, num_query_groups=spec.groups),
                    want, g, aliases)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def _local_spec_state(heads=8, groups=2, hd=5, hidden=16, ffn=12) -> dict[str, torch.Tensor]:
    """A local-spec (no Transformer Engine) layer with q/k norms and shared experts,
    and a head dim other than hidden / heads."""
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "embedding.word_embeddings.weight": (32, hidden), "output_layer.weight": (32, hidden),
        "decoder.final_layernorm.weight": (hidden,),
        "decoder.layers.0.input_layernorm.weight": (hidden,),
        "decoder.layers.0.self_attention.linear_qkv.weight": ((heads + 2 * groups) * hd, hidden),
        "decoder.layers.0.self_attention.linear_qkv.bias": ((heads + 2 * groups) * hd,),
        "decoder.layers.0.self_attention.q_layernorm.weight": (hd,),
        "decoder.layers.0.self_attention.k_layernorm.weight": (hd,),
        "decoder.layers.0.self_attention.linear_proj.weight": (hidden, heads * hd),
        "decoder.layers.0.pre_mlp_layernorm.weight": (hidden,),
        "decoder.layers.0.mlp.router.weight": (2, hidden),
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight": (2 * ffn, hidden),
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight": (hidden, ffn),
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight": (2 * ffn, hidden),
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight": (hidden, ffn),
        "decoder.layers.0.mlp.shared_experts.linear_fc1.weight": (2 * ffn, hidden),
        "decoder.layers.0.mlp.shared_experts.linear_fc2.weight": (hidden, ffn),
        "decoder.layers.0.mlp.shared_experts.gate_weight": (1, hidden),
    }
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


@pytest.mark.parametrize("head_dim", [None, 5])
def test_local_spec_qk_norms_shared_experts_head_dim(head_dim) -> None:
    g = _local_spec_state()
    want = pick(reference(g, 8, 2), fused=False, biases="all")
    want["model.layers.0.mlp.shared_expert.up_proj.weight"] = \
        want["model.layers.0.mlp.shared_experts.up_proj.weight"]  # Qwen2-MoE's singular name
    got = apply_map(tr.maps.megatron_to_hf(num_heads=8, num_query_groups=2, head_dim=head_dim),
                    want, g)
    assert "model.layers.0.self_attn.q_norm.weight" in want
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_unlisted_names_fall_back_to_identity_and_unmapped_have_no_source() -> None:
    m = tr.maps.megatron_to_hf(num_heads=4, num_query_groups=2)
    src = {"extra.scale": torch.zeros(3), EMB: torch.zeros(8, 4)}
    seg = m.segments("extra.scale", (3,), src, {})
    assert [(s.src_name, s.dst_box) for s in seg] == [("extra.scale", Box((0,), (3,)))]
    assert m.segments("model.layers.0.self_attn.q_proj.weight", (4, 4), src, {}) is None
    assert m.segments("lm_head.weight", (8, 4), src, {}) is None  # untied, and no output layer
    tied = m.segments("lm_head.weight", (8, 4), src, {"output_layer.weight": EMB})
    assert [s.src_name for s in tied] == [EMB]


def test_config_objects_and_cache_key() -> None:
    class MegatronConfig:  # TransformerConfig's field names; None groups: one per head
        num_attention_heads, num_query_groups, kv_channels = 8, None, 16

    assert tr.maps.megatron_to_hf(MegatronConfig()) == tr.maps.MegatronToHF(8, 8, 16)
    hf = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}
    assert tr.maps.megatron_to_hf(hf) == tr.maps.MegatronToHF(8, 2, 64)
    assert tr.maps.megatron_to_hf(hf, num_query_groups=4).num_query_groups == 4
    keys = {tr.maps.MegatronToHF(8, 2).cache_key(), tr.maps.MegatronToHF(8, 4).cache_key(),
            tr.maps.MegatronToHF(8, 2, 64).cache_key(), tr.maps.Identity().cache_key()}
    assert len(keys) == 4
    assert tr.maps.megatron_to_hf(hf).cache_key() == tr.maps.MegatronToHF(8, 2, 64).cache_key()


@pytest.mark.parametrize("kwargs,match", [
    ({"num_heads": 6, "num_query_groups": 4}, "not a multiple of num_query_groups 4"),
    ({"num_heads": 0, "num_query_groups": 1}, "must be positive"),
    ({"num_query_groups": 2}, "give num_heads"),
])
def test_bad_arguments(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        tr.maps.megatron_to_hf(**kwargs)


# ------------------------------------------------------- one world of 4 ranks
@dataclass(frozen=True)
class Case:
    id: str
    spec: ModelSpec
    src: Mesh
    fused: bool = False
    biases: str = "qkv"
    dst_tp: int = 1  # 1: the engine holds the whole model on every rank; else vLLM-style TP
    map_heads: tuple[int, int] | None = None  # (heads, groups) given to the map, if not the model's
    dst_spec: ModelSpec | None = None  # the engine's shapes, if not the trainer's
    extra: tuple[str, ...] = ()  # destination names with no source
    error: str | None = None  # expected in the message every rank raises
    all_local: bool = False  # every rank holds its engine shard as a source: no bytes move


def _m(tp=1, pp=1, ep=1) -> Mesh:
    return Mesh(tp=tp, pp=pp, ep=ep, ranks=WORLD)


GQA = ModelSpec(layers=2)
CASES = [
    Case("gqa-tp2->hf-qwen2", GQA, _m(2)),
    Case("gqa-pp2tp2->hf-fused", GQA, _m(2, 2), fused=True),
    Case("mha-tp4-llama->hf", ModelSpec(layers=2, heads=4, groups=4, bias=False), _m(4), biases="none"),
    Case("mqa-pp2->hf-all-biases", ModelSpec(layers=2, heads=4, groups=1), _m(1, 2), biases="all"),
    Case("tied-tp2->hf", replace(GQA, tie=True), _m(2)),
    Case("tied-pp2->hf-fused", replace(GQA, tie=True), _m(1, 2), fused=True),
    Case("moe-ep2->hf-qwen2moe", ModelSpec(layers=2, experts=4), _m(ep=2)),
    Case("moe-grouped-tp2ep2-router-bias->hf-deepseek",
         ModelSpec(layers=2, experts=4, grouped_experts=True, router_bias=True), _m(2, ep=2), fused=True),
    # Megatron TP2 rank r and vLLM TP2 rank r hold the same heads and ffn columns.
    Case("gqa-tp2->vllm-tp2-fused", GQA, _m(2), fused=True, dst_tp=2, all_local=True),
    Case("gqa-pp2->vllm-tp4-fused-kv-replicated", GQA, _m(1, 2), fused=True, dst_tp=4),
    Case("gqa-tp2pp2->vllm-tp4-split-kv-replicated", GQA, _m(2, 2), dst_tp=4),
    Case("moe-ep2->vllm-tp2-experts", ModelSpec(layers=2, experts=4), _m(ep=2), dst_tp=2),
    # Bad input: the same PlanError on every rank, naming the tensor; nothing written.
    Case("bad-head-counts", GQA, _m(2), map_heads=(4, 1),
         error="model.layers.0.self_attn.k_proj.bias: shapes do not fit num_heads=4, num_query_groups=1"),
    # qkv_proj's 48 rows fit 4 heads in 4 groups of head dim 4; linear_proj's 24 columns do not.
    Case("bad-fused-head-counts", GQA, _m(2), fused=True, map_heads=(4, 4),
         error="model.layers.0.self_attn.qkv_proj.bias: shapes do not fit num_heads=4, "
               "num_query_groups=4"),
    Case("bad-ffn", GQA, _m(2), dst_spec=replace(GQA, ffn=40),
         error="model.layers.0.mlp.gate_proj.weight: a gated linear_fc1 is [gate; up]: its 96 rows"),
    Case("bad-no-source", GQA, _m(2),
         extra=("model.layers.0.self_attn.q_norm.weight", "model.rotary.weight"),
         error="model.layers.0.self_attn.q_norm.weight: destination tensor (dst ranks [0, 1, 2, 3]) "
               "has no source tensor (no source rank holds "
               "'decoder.layers.0.self_attention.q_layernorm.weight' or an alias of it"),
]


def _engine_full(case: Case, seed: int) -> dict[str, torch.Tensor]:
    spec = case.dst_spec or case.spec
    full = pick(reference(toy_globals(spec, seed), spec.heads, spec.groups), fused=case.fused,
                biases=case.biases)
    for n in case.extra:
        full[n] = torch.zeros(spec.head_dim)
    return full


def _vllm_shard(name: str, t: torch.Tensor, r: int, tp: int, heads: int, kv: int) -> torch.Tensor:
    """What vLLM's rank r holds of a whole tensor (plain torch; kv heads replicated when tp > kv)."""
    module, leaf = name.split(".")[-2:]

    def kv_rows(x):
        return x.chunk(tp)[r] if tp <= kv else x.chunk(kv)[r // (tp // kv)]

    if module in ("q_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"):
        return t.chunk(tp)[r]
    if module in ("o_proj", "down_proj") and leaf == "weight":
        return t.chunk(tp, 1)[r]
    if module in ("k_proj", "v_proj"):
        return kv_rows(t)
    if module == "gate_up_proj":
        gate, up = t.chunk(2)
        return torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
    if module == "qkv_proj":
        hd = t.shape[0] // (heads + 2 * kv)
        q, k, v = t.split([heads * hd, kv * hd, kv * hd])
        return torch.cat([q.chunk(tp)[r], kv_rows(k), kv_rows(v)])
    return t


def _engine(case: Case, rank: int, seed: int) -> dict[str, torch.Tensor]:
    spec = case.dst_spec or case.spec
    full = _engine_full(case, seed)
    if case.dst_tp == 1:
        return full
    return {n: _vllm_shard(n, t, rank % case.dst_tp, case.dst_tp, spec.heads, spec.groups).clone()
            for n, t in full.items()}


def _module(tensors: dict[str, torch.Tensor]) -> nn.Module:
    root = nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(t.clone()))
    return root


def _run_case(case: Case, rank: int) -> dict:
    spec = case.dst_spec or case.spec
    src = build_toy(case.spec, case.src, rank, SRC_SEED)
    dst = _module(_engine(case, rank, DST_SEED))
    heads, groups = case.map_heads or (case.spec.heads, case.spec.groups)
    kwargs = {"name_map": tr.maps.megatron_to_hf(num_heads=heads, num_query_groups=groups)}
    if case.dst_tp > 1:
        kwargs["dst_layout"] = vllm_tp_layout(rank % case.dst_tp, case.dst_tp,
                                              num_heads=spec.heads, num_kv_heads=spec.groups)
    before = {n: p.detach().clone() for n, p in dst.named_parameters()}
    t0 = time.perf_counter()
    try:
        r = tr.Refitter(src, dst, **kwargs)
    except tr.RefitError as e:
        unchanged = all(torch.equal(p, before[n]) for n, p in dst.named_parameters())
        return {"raised": f"{type(e).__name__}: {e}", "detail": e.detail,
                "seconds": time.perf_counter() - t0,
                "unchanged": unchanged}
    expected = _engine(case, rank, SRC_SEED)
    same_before = [n for n, t in before.items() if torch.equal(t, expected[n])]
    r.refit()
    wrong = [n for n, p in dst.named_parameters() if not torch.equal(p.detach(), expected[n])]
    r.verify()
    return {"same_before": same_before, "wrong": wrong, "n": len(expected),
            "remote": r.plan.bytes_sent + r.plan.bytes_received}


def _world(rank: int, world: int, cases: list[Case]) -> dict[str, dict]:
    out = {}
    for case in cases:
        try:
            out[case.id] = _run_case(case, rank)
        except Exception as e:  # recorded per case; the next case still runs on every rank
            out[case.id] = {"error": f"{type(e).__name__}: {e}"}
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict]]:
    return run_world(_world, WORLD, CASES, timeout=240)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_refit_case(case: Case, results) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank[case.id]
        assert "error" not in got, f"rank {rank}: {got['error']}"
        if case.error is not None:
            assert "raised" in got, f"rank {rank}: no error raised"
            assert got["raised"].startswith("PlanError"), f"rank {rank}: {got['raised']}"
            # the message is the first problem; err.detail lists every one
            assert case.error in got["detail"], f"rank {rank}: {got['detail']}"
            assert "\n" not in got["raised"], f"rank {rank}: {got['raised']}"
            assert got["raised"] == results[0][case.id]["raised"], "ranks raised different errors"
            assert got["unchanged"], f"rank {rank}: destination written by a failed refit"
            assert got["seconds"] < 10, f"rank {rank}: took {got['seconds']:.1f} s to raise"
            continue
        assert "raised" not in got, f"rank {rank}: {got.get('raised')}"
        assert got["n"] > 0
        assert got["same_before"] == [], f"rank {rank}: equal before the refit: {got['same_before']}"
        assert got["wrong"] == [], f"rank {rank}: differ after the refit: {got['wrong'][:5]}"


def test_refits_move_bytes_between_ranks(results) -> None:
    """Guards the suite: the good cases exercise the transport, not only local copies,
    except where equal tensor parallel cuts make the whole refit local."""
    for c in CASES:
        if c.error is None:
            moved = sum(r[c.id].get("remote", 0) for r in results)
            assert (moved == 0) == c.all_local, f"{c.id}: {moved} bytes between ranks"
