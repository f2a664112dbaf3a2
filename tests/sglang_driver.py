"""One real SGLang CPU engine fed by torchrefit's SGLang backend, many cases; run as a script.

``python tests/sglang_driver.py SCENARIO OUT.json`` starts one ``sglang.Engine`` or
``sglang.launch_server`` (CPU, float32, dummy weights) on a small model config it
writes, runs the trainer's ranks (rank 0 in this process, holding the ``Engine`` or the
server's URL as its client; the others spawned, gloo), runs the scenario's cases in order and writes what each saw to OUT.json for
``tests/test_sglang_engine.py`` to judge. The oracle is a ``transformers`` model holding
the trainer's weights: SGLang's greedy tokens and top-5 logprobs against its own,
teacher-forced on SGLang's tokens; the weight version is the one SGLang reports on each
generated request.

Scenarios (``SCENARIOS``): ``qwen2`` (Qwen2, engine TP1, one whole Hugging Face
trainer: init errors, two versions, updates staged while serving, an engine-side
error), ``llama`` (Llama, engine TP1, one whole Hugging Face trainer: two versions), ``llama-tp2`` (Llama, engine TP2, two trainer ranks: Hugging Face FSDP2,
megatron-core TP2, torchtitan FSDP2, then a trainer rank killed mid-stage),
``qwen2-http-tp2`` (Qwen2, engine TP2 as a ``sglang.launch_server`` HTTP server with
torchrefit's custom weight loader, two trainer ranks, Hugging Face FSDP2: an init error,
two versions, staged updates, tensors forced through ``load_weights``).
The test setup puts ``tests/sglang_cpu_stub`` (an import-only ``sgl_kernel``) on
``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_runs import wait_healthy  # noqa: E402
from vllm_driver import (  # noqa: E402  (the same models, steps and oracle scoring)
    MAX_TOKENS,
    PROMPTS,
    TOP,
    _free_port,
    _full,
    _score,
    config,
    hf_model,
    model_dir,
    step,
    titan_config,
    titan_model,
    titan_to_hf,
)

SCENARIOS = {
    "qwen2": dict(model="dense", trainers=1, tp=1),
    "llama": dict(model="llama", trainers=1, tp=1),
    "llama-tp2": dict(model="llama", trainers=2, tp=2, titan="llama3", megatron=True,
                      kill=True),
    "qwen2-http-tp2": dict(model="dense", trainers=2, tp=2, http=True),
}


def start_engine(cfg: dict, tp: int = 1, mem_fraction_static: float = 0.2):
    """An in-process ``sglang.Engine`` of ``cfg`` on CPU (float32, dummy weights);
    ``mem_fraction_static``: of the machine's memory, for weights and KV cache. SGLang
    CPU counts as the weights' whatever the machine's free memory lost while it loaded
    them (other jobs' allocations too), so the share is ample; ``max_total_tokens``
    keeps the KV cache small."""
    import sglang

    return sglang.Engine(model_path=model_dir(cfg), load_format="dummy", device="cpu",
                         skip_tokenizer_init=True, disable_cuda_graph=True,
                         disable_overlap_schedule=True, dtype="float32", tp_size=tp,
                         mem_fraction_static=mem_fraction_static, max_total_tokens=4096,
                         log_level=os.environ.get("TORCHREFIT_SGLANG_LOG", "error"),
                         random_seed=0)


def start_server(cfg: dict, tp: int, mem_fraction_static: float = 0.2) -> tuple[str, object]:
    """``python -m sglang.launch_server`` of ``cfg`` (the same settings as
    :func:`start_engine`) with torchrefit's weight loader; its URL and process."""
    import subprocess

    from torchrefit.engines.sglang_http import LOADER

    port = _free_port(1)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir(cfg),
           "--load-format", "dummy", "--device", "cpu", "--skip-tokenizer-init",
           "--disable-cuda-graph", "--disable-overlap-schedule", "--dtype", "float32",
           "--tp-size", str(tp), "--mem-fraction-static", str(mem_fraction_static),
           "--max-total-tokens", "4096",
           "--random-seed", "0", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", os.environ.get("TORCHREFIT_SGLANG_LOG", "error"),
           "--custom-weight-loader", LOADER]
    server = subprocess.Popen(cmd, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server, "sglang.launch_server")
    except BaseException:
        import signal

        os.killpg(server.pid, signal.SIGKILL)
        raise
    return url, server


# ------------------------------------------------------------------------- oracle
def generate(engine) -> list:
    """Per prompt, SGLang's greedy tokens, its top-5 logprobs at each step and the weight
    version it reports (``engine``: an ``sglang.Engine``, or an HTTP server's URL)."""
    params = dict(input_ids=PROMPTS, sampling_params={
        "temperature": 0.0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True},
        return_logprob=True, top_logprobs_num=TOP)
    if isinstance(engine, str):
        import requests

        outs = requests.post(f"{engine}/generate", json=params, timeout=300).json()
    else:
        outs = engine.generate(**params)
    got = []
    for o in outs:
        meta = o["meta_info"]
        tokens = [t for _, t, _ in meta["output_token_logprobs"]]
        tops = [{t: v for v, t, _ in step} for step in meta["output_top_logprobs"]]
        got.append((tokens, tops, meta.get("weight_version")))
    return got


def judge(engine, weights: dict) -> dict:
    """:func:`generate` against a transformers model holding ``weights``."""
    import torch

    got = generate(engine)
    oracle = hf_model(json.loads(os.environ["TORCHREFIT_SGLANG_CONFIG_JSON"]), seed=0)
    missing = oracle.load_state_dict(weights, strict=False)
    assert not missing.missing_keys, missing
    with torch.no_grad():
        logps = [torch.log_softmax(oracle(torch.tensor([p + g[0]])).logits[0].double(), -1)
                 for p, g in zip(PROMPTS, got)]
    seen = dict(_score([(g[0], g[1]) for g in got], logps), weight_version=got[0][2])
    if isinstance(engine, str):  # the version the server reports apart from any request
        import requests

        seen["model_info_version"] = requests.get(f"{engine}/model_info",
                                                  timeout=60).json()["weight_version"]
    return seen


# ------------------------------------------------------------------ trainer ranks
def trainer(rank: int, world: int, scenario: str, port: int, dist_port: int, engine=None,
            out: dict | None = None):
    """Every trainer rank runs the same sequence; rank 0 also judges the engine."""
    import torch.distributed as dist

    import torchrefit as tr
    from torchrefit.engines.sglang import SGLangInitInfo, init_sender

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
    out = {"cases": {}} if out is None else out
    out.setdefault("cases", {})
    ports = iter(range(port, port + 100, 2))

    def init(source=model, timeout=60.0, **kw):
        info = SGLangInitInfo("127.0.0.1", next(ports), timeout=timeout, **kw)
        return init_sender(info, source, engine)

    def expect_error(name, fn):
        t0 = time.monotonic()
        try:
            fn()
            seen = {"raised": None}
        except Exception as e:
            seen = {"raised": type(e).__name__, "message": str(e),
                    "seconds": time.monotonic() - t0}
        ranks = [None] * world
        dist.all_gather_object(ranks, seen)
        out["cases"][name] = dict(seen, ranks=ranks)

    if sc.get("http"):  # an init error through the HTTP route: the server lives on
        expect_error("mismatched_shape", lambda: init(
            source=hf_model(dict(cfg, intermediate_size=192), seed=0)))
    if scenario == "qwen2":
        expect_error("disagreeing_name_map", lambda: init(
            name_map=tr.maps.hf_to_vllm(num_heads=4, num_kv_heads=4)))
        expect_error("mismatched_shape", lambda: init(
            source=hf_model(dict(cfg, intermediate_size=192), seed=0)))
        import torch
        expect_error("mismatched_dtype", lambda: init(
            source=hf_model(cfg, seed=0).to(torch.float16), cast=False))

    sender = init()
    if rank == 0:
        out["routes"] = {k: [r.way, r.why] for k, r in sender.routes.items()}
        out["dummy"] = judge(engine, _full(model))
    else:
        _full(model)
    _versions(out, "", sender, model, engine, rank, world, lambda m: _full(m))
    sender.shutdown()
    if sc.get("http"):
        _staged(out, init(serve_while_staging=True), model, engine, rank)
        _through_load_weights(out, init, model, engine, rank, world)
    if scenario == "qwen2":
        _engine_error(out, init, model, engine, rank, expect_error)
        _staged(out, init(serve_while_staging=True), model, engine, rank)
    if "titan" in sc:
        _torchtitan_trainer(out, sc, cfg, engine, rank, world, init)
    if sc.get("megatron") and importlib.util.find_spec("megatron") is not None:
        _megatron_trainer(out, cfg, engine, rank, world, init)
    if sc.get("kill"):
        _killed_rank(out, init, model, engine, rank)
    dist.destroy_process_group()
    return out


def _versions(out, prefix, sender, model, engine, rank, world, weights, judge_fn=None) -> None:
    """Two versions sent (``weights(model)``: the oracle's weights), a skipped update
    judged in between."""
    import torch.distributed as dist

    judge_fn = judge_fn or judge
    for k in (1, 2):
        if k == 2:
            step(model, k)
            w = weights(model)
            if rank == 0:  # a skipped update: the engine still holds version 1
                out["cases"][f"{prefix}skipped_update"] = judge_fn(engine, w)
        t0 = time.monotonic()
        sender.send_weights(weight_version=f"{prefix}v{k}")
        seconds = time.monotonic() - t0
        sent = [None] * world
        dist.all_gather_object(sent, sum(r.bytes_sent for r in sender.reports))
        full = _full(model)
        w = weights(model)
        if rank == 0:
            out["cases"][f"{prefix}version_{k}"] = dict(
                judge_fn(engine, w), seconds=seconds, bytes_sent=sent,
                model_bytes=sum(t.numel() * t.element_size() for t in full.values()))


def _engine_error(out, init, model, engine, rank, expect_error) -> None:
    """An exception inside the engine's update (its scheduler method called outside an
    open weight-update window) reaches the trainer at once; the engine writes nothing
    and keeps its version; the next update applies in full."""
    sender = init()
    serving = _full(model)
    original = sender.client.begin
    sender.client.begin = lambda: None  # skip SGLang's begin_weight_update once
    step(model, 3)
    expect_error("engine_raises", lambda: sender.send_weights(weight_version="v3"))
    sender.client.begin = original
    out["cases"]["engine_raises"]["after"] = judge(engine, serving)
    sender.send_weights(weight_version="v4")
    out["cases"]["after_failure"] = judge(engine, _full(model))
    sender.shutdown()


def _staged(out, sender, model, engine, rank) -> None:
    """Two staged updates: the engine serves its version while the stage is in flight
    and once it is fully staged; after ``commit_weights`` the staged one. Rank 0 judges."""
    def judge_on_0(weights):
        return judge(engine, weights) if rank == 0 else None

    serving = _full(model)
    for k in (5, 6):
        step(model, k)
        staged = _full(model)
        seen = {}
        sender.stage_weights()
        seen["staged"] = judge_on_0(serving)
        seen["staged_vs_next"] = judge_on_0(staged)
        sender.commit_weights(weight_version=f"v{k}")
        seen["committed"] = judge_on_0(staged)
        out["cases"][f"staged_{k}"] = seen
        serving = staged
    sender.shutdown()


#: SGLang tensors the ``load_weights`` case sends through the model's ``load_weights``
LOAD_WEIGHTS = ("*.mlp.down_proj.weight", "lm_head.weight", "model.embed_tokens.weight")


def _through_load_weights(out, init, model, engine, rank, world) -> None:
    """Two versions with :data:`LOAD_WEIGHTS` forced through SGLang's ``load_weights``
    (the rest written in place), each after a step, so the forced tensors change too;
    and a pattern that names nothing, refused at init."""
    def expect_error():
        try:
            init(load_weights=("*no_such_tensor*",)).shutdown()
            return {"raised": None}
        except Exception as e:
            return {"raised": type(e).__name__, "message": str(e)}

    out["cases"]["lw-unmatched_pattern"] = expect_error()
    sender = init(load_weights=LOAD_WEIGHTS)
    if rank == 0:
        out["lw_routes"] = {k: [r.way, r.why] for k, r in sender.routes.items()}
    step(model, 11)
    _versions(out, "lw-", sender, model, engine, rank, world, lambda m: _full(m))
    sender.shutdown()


def _killed_rank(out, init, model, engine, rank) -> None:
    """Trainer rank 1 dies while a staged update streams: the engine commits nothing
    and keeps its version; rank 0 raises within twice the link's timeout."""
    sender = init(serve_while_staging=True, timeout=10.0)
    sender.send_weights(weight_version="before-kill")
    serving = _full(model)
    step(model, 9)
    if rank == 1:
        sender._refitter.stage = lambda *a, **k: os._exit(3)  # dies mid-update
    t0 = time.monotonic()
    try:
        sender.stage_weights()
        seen = {"raised": None}
    except Exception as e:
        seen = {"raised": type(e).__name__, "message": str(e)}
    seen["seconds"] = time.monotonic() - t0
    try:
        sender.commit_weights(weight_version="after-kill")
        seen["commit_raised"] = None
    except Exception as e:
        seen["commit_raised"] = type(e).__name__
    out["cases"]["killed_rank"] = dict(seen, **judge(engine, serving))


# ---------------------------------------------------------- other trainers
def _megatron_trainer(out, cfg, engine, rank, world, init) -> None:
    """A megatron-core ``GPTModel`` of the engine's model, tensor parallel over the
    trainer's ranks, through ``megatron_to_vllm``; judged by megatron-core's forward."""
    from megatron_models import GptShape, build_gpt, megatron_pp_logits

    import torchrefit as tr

    shape = GptShape("llama", layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
                     heads=cfg["num_attention_heads"], groups=cfg["num_key_value_heads"],
                     ffn=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                     eps=cfg["rms_norm_eps"], rope_base=cfg["rope_theta"])
    model = build_gpt(shape, tp=world, seed=11)
    sender = init(source=model, name_map=tr.maps.megatron_to_vllm(model.config))

    def judge_megatron(engine_, _):
        import torch
        import torch.distributed as dist

        box = [generate(engine_) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        got = box[0]
        logps = [torch.log_softmax(megatron_pp_logits(model, torch.tensor([p + g[0]]),
                                                      shape.hidden)[0].double(), -1)
                 for p, g in zip(PROMPTS, got)]
        return dict(_score([(g[0], g[1]) for g in got], logps), weight_version=got[0][2])

    _megatron_versions(out, sender, model, engine, rank, world, judge_megatron)
    sender.shutdown()


def _megatron_versions(out, sender, model, engine, rank, world, judge_fn) -> None:
    import torch.distributed as dist

    for k in (1, 2):
        if k == 2:
            step(model, k)
            seen = judge_fn(engine, None)
            if rank == 0:
                out["cases"]["megatron-skipped_update"] = seen
        sender.send_weights(weight_version=f"megatron-v{k}")
        sent = [None] * world
        dist.all_gather_object(sent, sum(r.bytes_sent for r in sender.reports))
        seen = judge_fn(engine, None)
        if rank == 0:
            out["cases"][f"megatron-version_{k}"] = dict(seen, bytes_sent=sent)


def _torchtitan_trainer(out, sc, cfg, engine, rank, world, init) -> None:
    """A torchtitan Llama 3 (FSDP2 over the trainer's ranks) through
    ``torchtitan_to_vllm``; the oracle holds torchtitan's own ``to_hf`` conversion."""
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
    sender = init(source=model, name_map=tr.maps.torchtitan_to_vllm(tcfg))

    def weights(m):
        full = _full(m)
        return titan_to_hf(family, tcfg, mirror, full) if rank == 0 else None

    _versions(out, "titan-", sender, model, engine, rank, world, weights)
    sender.shutdown()


# --------------------------------------------------------------------------- main
def _spawned(rank, world, scenario, port, dist_port, cfg_json):
    os.environ["TORCHREFIT_SGLANG_CONFIG_JSON"] = cfg_json
    trainer(rank, world, scenario, port, dist_port)


def main(scenario: str, out_path: str) -> None:
    import torch.multiprocessing as mp

    sc = SCENARIOS[scenario]
    cfg = config(sc["model"])
    cfg_json = json.dumps(cfg)
    os.environ["TORCHREFIT_SGLANG_CONFIG_JSON"] = cfg_json
    if sc["tp"] > 1:  # one NUMA node here: SGLang CPU wants each TP rank's cores named
        cores = os.cpu_count() or 1
        os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(
            str(r % cores) for r in range(sc["tp"])))
    t0 = time.monotonic()
    server = None
    if sc.get("http"):
        engine, server = start_server(cfg, sc["tp"])
    else:
        engine = start_engine(cfg, tp=sc["tp"])
    started = time.monotonic() - t0
    port = _free_port(101)
    dist_port = port + 100
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_spawned, args=(r, sc["trainers"], scenario, port, dist_port,
                                                 cfg_json))
             for r in range(1, sc["trainers"])]
    for p in procs:
        p.start()
    result: dict = {"engine_start_seconds": started}
    try:
        try:
            trainer(0, sc["trainers"], scenario, port, dist_port, engine=engine, out=result)
        except Exception:
            result["error"] = traceback.format_exc()
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
                p.join()
            result.setdefault("trainer_exit", []).append(p.exitcode)
        result["seconds"] = time.monotonic() - t0
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    finally:
        if server is not None:  # the server and its scheduler processes, whatever happened
            import signal

            os.killpg(server.pid, signal.SIGTERM)
            server.wait(60)
        else:
            engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    os._exit(0)
