"""``tr.load_weights_sink``: engines that only accept ``load_weights(iterable of (name,
tensor))`` as refit destinations (one spawned world of 4 CPU processes, gloo).

A Megatron-style TP2 trainer (ranks 0-1) refits, twice, into:

* two sinks (ranks 2, 3) whose ``load_weights`` is a recorder: every name arrives exactly
  once per refit, with the oracle's values (global tensors cut with plain torch ops);
  rank 3 declares some tensors TP-sharded (it wants the second half of the rows) and
  gets exactly that half; every call's tensors lie in one buffer of at most
  ``bucket_bytes`` and a refit takes several calls; a tensor the map skips is never
  delivered; ``verify()`` refuses on every rank;
* two Hugging Face ``LlamaForCausalLM`` engines (ranks 2, 3) through
  ``tr.maps.megatron_to_hf``, loading with the model's own ``load_state_dict``: every
  parameter equals a reference conversion written with plain indexing
  (``test_maps_hf.reference``), and the version is stamped on the engine;
* a ``bucket_bytes`` smaller than a tensor: the same error on every rank, nothing written.
"""

from __future__ import annotations

import pytest
import torch
from test_maps_hf import reference, toy_globals
from torch import nn

import torchrefit as tr
from torchrefit.testing import Mesh, ModelSpec, build_toy, check_failed_everywhere, run_world
from torchrefit.testing.toy import global_table, global_value

SPEC = ModelSpec(layers=2, bias=False)  # Llama-shaped: no linear biases
TRAINER = Mesh(tp=2, ranks=2)
BUCKET = 12 * 1024  # several buckets for the toy's ~70 KB
STAGING = 8 * 1024  # the Refitter's staging_bytes: each bucket alone stays under it
SHARDED = ("embedding.word_embeddings.weight", "output_layer.weight")


class Recorder:
    """A ``load_weights`` that checks what a sink hands over."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.got: dict[str, list[torch.Tensor]] = {}
        self.calls = 0
        self.over_budget: list[str] = []

    def __call__(self, weights) -> None:
        self.calls += 1
        pairs = list(weights)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _, t in pairs}
        span = sum(t.nbytes for _, t in pairs)
        if len(storages) != 1 or max(storages.values()) > self.bucket_bytes or span > self.bucket_bytes:
            self.over_budget.append(f"call {self.calls}: {span} bytes in {len(storages)} storages")
        for name, t in pairs:
            self.got.setdefault(name, []).append(t.clone())  # copies, as engines do


def _wanted(rank: int) -> list[tuple]:
    out = []
    for name, d in global_table(SPEC).items():
        if not d.persistent:
            continue
        if rank == 3 and name in SHARDED:
            shape, pieces = tr.shard_pieces((d.shape[0] // 2,) + d.shape[1:], 0, 1, 2, name=name)
            out.append((name, tr.TensorSpec(name, shape, pieces), torch.float32))
        else:
            out.append((name, d.shape, torch.float32))
    return out + [("extra.weight", (4,), torch.float32)]  # no source: skipped


def _expected(rank: int, name: str, seed: int) -> torch.Tensor:
    d = global_table(SPEC)[name]
    g = global_value(name, d.shape, seed, SPEC)
    return g.chunk(2)[1] if rank == 3 and name in SHARDED else g


def _set(model, rank: int, seed: int) -> None:
    fresh = build_toy(SPEC, TRAINER, rank, seed)
    with torch.no_grad():
        for p, q in zip(model.state_dict().values(), fresh.state_dict().values()):
            p.copy_(q)


def _recorders(rank: int) -> dict:
    src = build_toy(SPEC, TRAINER, rank, 0) if rank < 2 else None
    recorder = Recorder(BUCKET)
    engine = nn.Module() if rank >= 2 else None  # stands for the engine: holds the version
    sink = tr.load_weights_sink(recorder, _wanted(rank), bucket_bytes=BUCKET) if rank >= 2 else None
    r = tr.Refitter(src, engine, dst_layout=sink, skip=["extra.*"], staging_bytes=STAGING)
    out: dict = {"staging": []}
    for seed in (1, 2):
        if src is not None:
            _set(src, rank, seed)
        recorder.got.clear()
        calls = recorder.calls
        report = r.refit()
        out["staging"].append(report.staging_bytes)
        out[f"calls{seed}"] = recorder.calls - calls
        if rank >= 2:
            names = [n for n, *_ in _wanted(rank) if n != "extra.weight"]
            out[f"once{seed}"] = sorted(recorder.got) == sorted(names) and all(
                len(v) == 1 for v in recorder.got.values())
            out[f"values{seed}"] = [n for n in names
                                    if not torch.equal(recorder.got[n][0], _expected(rank, n, seed))]
    out["over_budget"] = recorder.over_budget
    out["version"] = tr.weight_version(engine) if engine is not None else report.version
    out["buffer"] = sink.buffer.numel() if sink is not None else 0
    # staging memory the bucket programs hold, counted by storage: one shared pair
    pools = {p.untyped_storage().data_ptr(): p.numel() for prog in r._phase_programs
             for p in (prog.compiled.rounds.pools if prog.compiled.rounds else ()) if p.numel()}
    out["staging_held"] = sum(pools.values())
    with pytest.raises(tr.VerificationError, match="load_weights sink"):
        r.verify()
    return out


def _llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=SPEC.hidden, intermediate_size=SPEC.ffn,
                         num_attention_heads=SPEC.heads, num_key_value_heads=SPEC.groups,
                         num_hidden_layers=SPEC.layers, vocab_size=SPEC.vocab,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def _transformers(rank: int) -> dict:
    src = build_toy(SPEC, TRAINER, rank, 0) if rank < 2 else None
    model = _llama(rank) if rank >= 2 else None
    unexpected: list[str] = []

    def load_weights(weights) -> None:  # the model's own loading path
        result = model.load_state_dict(dict(weights), strict=False)
        unexpected.extend(result.unexpected_keys)

    sink = None
    if model is not None:
        wanted = [(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items()]
        sink = tr.load_weights_sink(load_weights, wanted, bucket_bytes=BUCKET if rank == 3 else 1 << 20)
    name_map = tr.maps.megatron_to_hf(num_heads=SPEC.heads, num_query_groups=SPEC.groups)
    r = tr.Refitter(src, model, dst_layout=sink, name_map=name_map)
    out: dict = {}
    for seed in (1, 2):
        if src is not None:
            _set(src, rank, seed)
        r.refit()
        if model is not None:
            ref = reference(toy_globals(SPEC, seed), SPEC.heads, SPEC.groups)
            state = model.state_dict()
            out[f"wrong{seed}"] = [n for n, t in state.items() if not torch.equal(t, ref[n])]
            out["count"] = len(state)
    out["unexpected"] = unexpected
    out["version"] = tr.weight_version(model) if model is not None else None
    return out


def _too_small(rank: int) -> dict:
    from torchrefit.testing import attempt_refit

    src = build_toy(SPEC, TRAINER, rank, 0) if rank < 2 else None
    dst = nn.Module() if rank >= 2 else None
    sink = tr.load_weights_sink(Recorder(1 << 30), _wanted(2), bucket_bytes=1024) if rank >= 2 else None
    return attempt_refit(src, dst, dst_layout=sink, skip=["extra.*"])


def _world(rank: int, world: int) -> dict:
    import transformers  # noqa: F401  (every rank pays the import before the first gather)

    return {"recorders": _recorders(rank), "transformers": _transformers(rank),
            "too_small": _too_small(rank)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    pytest.importorskip("transformers")
    return run_world(_world, 4, timeout=400, pg_timeout=180)


def test_every_name_once_with_the_right_values(results) -> None:
    for rank in (2, 3):
        got = results[rank]["recorders"]
        for seed in (1, 2):
            assert got[f"once{seed}"], (rank, seed)
            assert got[f"values{seed}"] == [], (rank, seed, got[f"values{seed}"])
            assert got[f"calls{seed}"] > 2, got  # several buckets
        assert got["over_budget"] == [], got["over_budget"]
        assert 0 < got["buffer"] <= BUCKET
        assert got["version"] == 2
    assert all(r["recorders"]["calls1"] == 0 for r in results[:2])


def test_buckets_share_one_staging(results) -> None:
    """Staging stays under staging_bytes however many buckets a sink refit runs: the
    bucket programs share one pair of pools (one pair each would hold ~buckets x)."""
    for rank, r in enumerate(results):
        got = r["recorders"]
        assert 0 < got["staging_held"] <= STAGING, (rank, got["staging_held"])
        assert got["staging"] == [got["staging_held"]] * 2, (rank, got["staging"])


def test_transformers_model_loads_through_the_sink(results) -> None:
    for rank in (2, 3):
        got = results[rank]["transformers"]
        assert got["count"] > 10
        assert got["wrong1"] == [] and got["wrong2"] == [], got
        assert got["unexpected"] == [] and got["version"] == 2


def test_bucket_smaller_than_a_tensor_fails_everywhere(results) -> None:
    check_failed_everywhere([r["too_small"] for r in results], tr.LayoutError,
                            "exceed the sink's bucket_bytes 1024", max_seconds=60)


# ------------------------------------------------------------- bucket planning (pure)
def _roster(entries: list[tuple[str, tuple[int, ...]]]) -> bytes:
    from torchrefit.layout import ModelLayout, TensorLayout, whole_piece
    from torchrefit.plan.roster import encode_roster

    return encode_roster(ModelLayout(tuple(
        (n, TensorLayout(n, s, "float32", s, whole_piece(s))) for n, s in entries)))


def test_plan_buckets_rule() -> None:
    from torchrefit.plan.buckets import plan_buckets

    a = _roster([("a", (64,)), ("b", (64,)), ("c", (128,)), ("d", (8,))])  # 256, 256, 512, 32 B
    b = _roster([("d", (8,)), ("a", (64,))])
    # one sink of 512 B: a + b fit (256 + 256), c alone, d after it
    assert plan_buckets({2: (a, 512)}) == (("a", "b"), ("c",), ("d",))
    assert plan_buckets({2: (a, 2048)}) == (("a", "b", "c", "d"),)
    # a second sink (its own order comes after the lowest rank's) with a budget of 280 B
    # cannot hold a (256 B) and d (32 B at offset 256): the bucket closes before d
    assert plan_buckets({3: (b, 280), 2: (a, 2048)}) == (("a", "b", "c"), ("d",))
    # names no sink holds join the first bucket; the result is the same from any rank order
    assert plan_buckets({2: (a, 512)}, ["z", "a"]) == (("a", "b", "z"), ("c",), ("d",))
    with pytest.raises(tr.PlanError, match=r"c: 512 bytes on sink ranks \[2\] exceed their bucket_bytes 300"):
        plan_buckets({2: (a, 300)})
