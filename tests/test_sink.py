"""``tr.load_weights_sink``: engines that only accept ``load_weights(iterable of (name,
tensor))`` as refit destinations (one spawned world of 4 CPU processes per transport
usable on CPU here: gloo, and nixl where ``nixl-cu13`` is installed).

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
* a ``bucket_bytes`` smaller than a tensor: the same error on every rank, nothing written;
* a sink that wants two projections as block FP8 with ``_scale_inv`` grids: each weight
  arrives with its scale in one ``load_weights`` call, bit-identical to the torch
  quantization of the whole global tensor (the oracle), one quantized by the senders and
  one on the sink (its blocks straddle the TP shards).

Bucket planning itself (pure): budgets, several sinks, names no sink holds, and an FP8
weight's scale kept in its weight's bucket.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_maps_hf import reference, toy_globals
from torch import nn

import torchrefit as tr
from torchrefit import settings
from torchrefit.testing import (
    Mesh,
    ModelSpec,
    build_toy,
    check_failed_everywhere,
    run_world,
    usable_transports,
)
from torchrefit.testing.toy import global_table, global_value
from torchrefit.transport.base import transport_class
from torchrefit.transport.one_sided.protocol import OneSidedTransport

SPEC = ModelSpec(layers=2, bias=False)  # Llama-shaped: no linear biases
TRAINER = Mesh(tp=2, ranks=2)
BUCKET = 12 * 1024  # several buckets for the toy's ~70 KB
POOL_BYTES = 8 * 1024  # the Refitter's pool_bytes: each bucket alone stays under it
SHARDED = ("embedding.word_embeddings.weight", "output_layer.weight")


class Recorder:
    """A ``load_weights`` that checks what a sink hands over."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.got: dict[str, list[torch.Tensor]] = {}
        self.calls = 0
        self.over_budget: list[str] = []
        self.call_of: dict[str, int] = {}

    def __call__(self, weights) -> None:
        self.calls += 1
        pairs = list(weights)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _, t in pairs}
        span = sum(t.nbytes for _, t in pairs)
        if len(storages) != 1 or max(storages.values()) > self.bucket_bytes or span > self.bucket_bytes:
            self.over_budget.append(f"call {self.calls}: {span} bytes in {len(storages)} storages")
        for name, t in pairs:
            self.got.setdefault(name, []).append(t.clone())  # copies, as engines do
            self.call_of[name] = self.calls


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
    tr.testing.load_seed(model, SPEC, TRAINER, rank, seed)


def _count_attaches(transport) -> list[int]:
    """Count a one-sided transport's ``attach`` calls (tables opened) in a one-item list."""
    count = [0]
    if isinstance(transport, OneSidedTransport):
        attach = transport.attach

        def counted(*args):
            count[0] += 1
            return attach(*args)
        transport.attach = counted
    return count


def _recorders(rank: int) -> dict:
    src = build_toy(SPEC, TRAINER, rank, 0) if rank < 2 else None
    recorder = Recorder(BUCKET)
    engine = nn.Module() if rank >= 2 else None  # stands for the engine: holds the version
    sink = tr.load_weights_sink(recorder, _wanted(rank), bucket_bytes=BUCKET) if rank >= 2 else None
    r = tr.Refitter(src, engine, dst_layout=sink, skip=["extra.*"], pool_bytes=POOL_BYTES)
    out: dict = {"pools": []}
    _refits(r, src, recorder, rank, (1, 2), out)
    out["over_budget"] = recorder.over_budget
    out["version"] = tr.weight_version(engine) if engine is not None else r.version
    out["buffer"] = sink.buffer.numel() if sink is not None else 0
    # message-pool memory the bucket programs hold, counted by storage: one shared pair
    pools = {p.untyped_storage().data_ptr(): p.numel() for prog in r._phase_programs
             for p in (prog.compiled.rounds.pools if prog.compiled.rounds else ()) if p.numel()}
    out["pools_held"] = sum(pools.values())
    with pytest.raises(tr.VerificationError, match="load_weights sink"):
        r.verify()
    if isinstance(r._transport, OneSidedTransport):  # fewer tables kept than buckets
        recorder = Recorder(BUCKET)
        sink = tr.load_weights_sink(recorder, _wanted(rank), bucket_bytes=BUCKET) if rank >= 2 else None
        r = tr.Refitter(src, engine, dst_layout=sink, skip=["extra.*"])
        r._transport.keep = 1  # every rank, before the first refit: both ends forget alike
        _refits(r, src, recorder, rank, (3, 4), out)
    return out


def _refits(r: tr.Refitter, src, recorder: Recorder, rank: int, seeds: tuple[int, ...], out: dict) -> None:
    """Refit once per seed into ``out``: message pools, load_weights calls, tables opened (a
    one-sided transport's ``attach``) and, on the sinks, whether each name came once
    with its value."""
    attached = _count_attaches(r._transport)
    for seed in seeds:
        if src is not None:
            _set(src, rank, seed)
        recorder.got.clear()
        calls, attaches = recorder.calls, attached[0]
        report = r.refit()
        out["pools"].append(report.pool_bytes)
        out[f"attached{seed}"] = attached[0] - attaches
        out[f"calls{seed}"] = recorder.calls - calls
        if rank >= 2:
            names = [n for n, *_ in _wanted(rank) if n != "extra.weight"]
            out[f"once{seed}"] = sorted(recorder.got) == sorted(names) and all(
                len(v) == 1 for v in recorder.got.values())
            out[f"values{seed}"] = [n for n in names
                                    if not torch.equal(recorder.got[n][0], _expected(rank, n, seed))]


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


# FP8 into a sink: blocks of 8 x 24 make linear_proj's TP shards (12 of its 24 columns each)
# cut blocks, so it is quantized on receipt; linear_fc2's shards (24 of 48 columns) are whole
# blocks, quantized by the senders
FP8_BLOCK = (8, 24)
FP8_NAMES = ("linear_proj.weight", "linear_fc2.weight")
FP8_BUCKET = 12 * 1024


def _fp8_wanted() -> list[tuple]:
    out = []
    for name, d in global_table(SPEC).items():
        if not d.persistent:
            continue
        if name.endswith(FP8_NAMES):
            grid = (-(-d.shape[0] // FP8_BLOCK[0]), -(-d.shape[1] // FP8_BLOCK[1]))
            out += [(name, d.shape, torch.float8_e4m3fn), (name + "_scale_inv", grid, torch.float32)]
        else:
            out.append((name, d.shape, torch.float32))
    return out


def _fp8(rank: int) -> dict:
    from torchrefit.transforms import quantize_blocks

    src = build_toy(SPEC, TRAINER, rank, 0) if rank < 2 else None
    recorder = Recorder(FP8_BUCKET)
    sink = tr.load_weights_sink(recorder, _fp8_wanted(), bucket_bytes=FP8_BUCKET) if rank >= 2 else None
    r = tr.Refitter(src, nn.Module() if rank >= 2 else None, dst_layout=sink, fp8_block=FP8_BLOCK,
                    pool_bytes=POOL_BYTES)
    out: dict = {"wrong": [], "apart": []}
    for seed in (1, 2):
        if src is not None:
            _set(src, rank, seed)
        recorder.got.clear()
        report = r.refit()
        out["sender"], out["receiver"] = report.fp8_on_sender, report.fp8_on_receiver
        for name, d in global_table(SPEC).items():
            if rank < 2 or not d.persistent:
                continue
            want = global_value(name, d.shape, seed, SPEC)
            got = recorder.got.get(name, [None])
            if not name.endswith(FP8_NAMES):
                ok = len(got) == 1 and torch.equal(got[0], want)
            else:  # the oracle: the whole global tensor quantized by the torch reference
                q, s = quantize_blocks(want, FP8_BLOCK)
                scale = recorder.got.get(name + "_scale_inv", [None])
                ok = (len(got) == 1 and len(scale) == 1 and torch.equal(got[0].view(torch.uint8), q.view(torch.uint8))
                      and torch.equal(scale[0], s)
                      and recorder.call_of.get(name) == recorder.call_of.get(name + "_scale_inv"))
            if not ok:
                out["wrong"].append((seed, name))
    out["calls"] = recorder.calls
    out["over_budget"] = recorder.over_budget
    return out


def _world(rank: int, world: int, transport: str) -> dict:
    import transformers  # noqa: F401  (every rank pays the import before the first gather)

    settings.configure(transport=transport)  # what "auto" means in every Refitter of this world

    return {"transport": transport, "recorders": _recorders(rank), "transformers": _transformers(rank),
            "too_small": _too_small(rank), "fp8": _fp8(rank)}


@pytest.fixture(scope="module", params=usable_transports(cuda=False))
def results(request) -> list[dict]:
    pytest.importorskip("transformers")
    return run_world(_world, 4, request.param, timeout=400, pg_timeout=180)


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


def test_one_sided_tables_kept_per_bucket(results) -> None:
    """Through a one-sided transport each bucket's program has its own table: the
    transport keeps one per bucket (``keep_tables``), so after the first refit no table
    travels again; with fewer kept than buckets (``keep = 1`` on every rank) both ends
    forget the same ones and the targets send them again (a second Refitter): every
    value still right."""
    if transport_class(results[0]["transport"]).protocol != "one_sided":
        pytest.skip("a rounds transport has no tables")
    for rank in (0, 1):  # the senders initiate (push): they open the sinks' tables
        got = results[rank]["recorders"]
        assert got["attached1"] > 4 and got["attached2"] == 0, got
        assert got["attached3"] > 0 and got["attached4"] > 0, got
    for rank in (2, 3):
        got = results[rank]["recorders"]
        assert got["once3"] and got["once4"] and got["values3"] == got["values4"] == [], got


def test_buckets_share_one_pair_of_pools(results) -> None:
    """The message pools stay under pool_bytes however many buckets a sink refit runs: the
    bucket programs share one pair of pools (one pair each would hold ~buckets x). A
    one-sided transport (nixl) writes into the sink's buffer and stages nothing."""
    staged = transport_class(results[0]["transport"]).protocol == "rounds"
    for rank, r in enumerate(results):
        got = r["recorders"]
        assert (0 < got["pools_held"] if staged else got["pools_held"] == 0), (rank, got["pools_held"])
        assert got["pools_held"] <= POOL_BYTES, (rank, got["pools_held"])
        assert got["pools"][:2] == [got["pools_held"]] * 2, (rank, got["pools"])


def test_transformers_model_loads_through_the_sink(results) -> None:
    for rank in (2, 3):
        got = results[rank]["transformers"]
        assert got["count"] > 10
        assert got["wrong1"] == [] and got["wrong2"] == [], got
        assert got["unexpected"] == [] and got["version"] == 2


def test_bucket_smaller_than_a_tensor_fails_everywhere(results) -> None:
    check_failed_everywhere([r["too_small"] for r in results], tr.LayoutError,
                            "exceed the sink's bucket_bytes 1024", max_seconds=60)


def test_fp8_into_a_sink(results) -> None:
    """FP8 weights and their scales reach ``load_weights`` together, bit-identical to the
    torch quantization of the whole global tensor, quantized on the senders where whole
    blocks of a shard fill them and on the sink where a block straddles two shards (a
    one-sided transport's senders transform nothing: all on the sink)."""
    on_senders = transport_class(results[0]["transport"]).protocol == "rounds"
    for rank in (2, 3):
        got = results[rank]["fp8"]
        assert got["wrong"] == [] and got["over_budget"] == [], got
        assert got["calls"] > 4 and (got["sender"] > 0) == on_senders and got["receiver"] > 0, got


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
    # an FP8 weight's scale goes right after it, in its bucket, wherever the sink lists it
    assert plan_buckets({2: (a, 512)}, scales={"a": "d"}) == (("a", "d"), ("b",), ("c",))
    assert plan_buckets({2: (a, 1024)}, scales={"c": "a"}) == (("b", "c", "a"), ("d",))
    with pytest.raises(tr.PlanError, match=r"c with its scale d: 544 bytes on sink ranks \[2\]"):
        plan_buckets({2: (a, 520)}, scales={"c": "d"})


def test_plan_buckets_align_sizes_that_are_not_multiples_of_256() -> None:
    """Each tensor starts at a 256-byte boundary of the sink's buffer: 40 B, 280 B and
    12 B tensors take 0-40, 256-536 and 768-780 (not 0-332 packed)."""
    from torchrefit.plan.buckets import plan_buckets

    a = _roster([("a", (10,)), ("b", (70,)), ("c", (3,))])
    assert plan_buckets({2: (a, 536)}) == (("a", "b"), ("c",))  # b ends exactly at the budget
    assert plan_buckets({2: (a, 535)}) == (("a",), ("b", "c"))  # b at 0, c at 512-524
    assert plan_buckets({2: (a, 780)}) == (("a", "b", "c"),)
    assert plan_buckets({2: (a, 779)}) == (("a", "b"), ("c",))


@pytest.mark.parametrize("seed", range(20))
def test_plan_buckets_match_a_byte_by_byte_layout(seed: int) -> None:
    """Random sizes (most not multiples of 256 B) and budgets, two sinks holding different
    subsets: each bucket is the longest run of names (in the lowest sink's order) whose
    aligned layout fits every sink's budget, checked by laying the bytes out here."""
    from torchrefit.plan.buckets import plan_buckets

    rng = random.Random(seed)
    sizes = {f"t{i}": rng.randint(1, 200) for i in range(rng.randint(3, 12))}  # float32 elements
    names = list(sizes)
    other = [n for n in names if rng.random() < 0.6] or names[:1]
    budgets = (max(sizes.values()) * 4 + rng.randint(0, 1200), max(sizes.values()) * 4 + rng.randint(0, 600))
    sinks = {2: (_roster([(n, (sizes[n],)) for n in names]), budgets[0]),
             3: (_roster([(n, (sizes[n],)) for n in other]), budgets[1])}

    def end(bucket: list[str], held: list[str]) -> int:
        at = 0
        for n in bucket:
            if n in held:
                start = at if at % 256 == 0 else at + 256 - at % 256
                at = start + 4 * sizes[n]
        return at

    want: list[list[str]] = [[]]
    for n in names:
        if want[-1] and (end(want[-1] + [n], names) > budgets[0] or end(want[-1] + [n], other) > budgets[1]):
            want.append([])
        want[-1].append(n)
    assert plan_buckets(sinks) == tuple(tuple(b) for b in want)
