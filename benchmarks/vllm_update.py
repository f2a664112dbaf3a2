"""One weight update into a real vLLM CPU engine: torchrefit's backend against vLLM's own reload.

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 \\
        python benchmarks/vllm_update.py --model dense --repeats 5 [--staged]

Starts one ``vllm.LLM(weight_transfer_config=WeightTransferConfig(backend="torchrefit"))``
(float32, dummy weights) on a model config it writes, with one trainer rank in this
process (gloo) holding a ``transformers`` model of the same config, and prints per model:

* ``torchrefit``: the median wall time of ``sender.send_weights()`` (start, the
  exchange over gloo, vLLM's layerwise reload and post-load steps, finish; every RPC
  to the engine included);
* ``vllm reload``: the median time of vLLM's ``reload_weights`` of tensors of the same
  names and shapes, made inside the worker (no transport at all);
* bytes each trainer rank sent, against vLLM's ``nccl`` backend, where trainer rank 0
  broadcasts every tensor whole (the model's bytes from rank 0, none from the others;
  counted, not run: vLLM's GPU build does not run on the project's GPU machines).

With ``--staged``, the same engine then takes updates with
``serve_while_staging=True``: ``staged stage`` is ``sender.stage_weights()`` (the engine
keeps serving), ``staged stall`` is ``sender.commit_weights()``, the engine's
``finish_weight_update`` (the commit: in-place twins copied, held tensors through vLLM's
layerwise reload), the only part an engine pauses for, against the whole
``send_weights()`` it pauses for otherwise.

Models: ``dense`` / ``moe`` (the test models), ``dense-0.5b`` (a Qwen2-0.5B shape, tied).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

QWEN2_05B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                 intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, head_dim=64, vocab_size=151936,
                 max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e6,
                 tie_word_embeddings=True, torch_dtype="float32")


def _reload_timed(worker, shapes: dict, repeats: int) -> list[float]:
    """vLLM's reload_weights of tensors of the trainer's names and shapes, made in the
    worker (the same bytes as the update; no transport)."""
    import torch

    weights = [(n, torch.randn(s) * 0.02) for n, s in shapes.items()]
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        worker.reload_weights(weights_iterator=weights)
        out.append(time.perf_counter() - t0)
    return out


def _staged(llm, model, repeats: int) -> dict:
    """Staged updates on the same engine: stage and commit timed apart (medians)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm_driver import _Client, _free_port, step

    from torchrefit.engines.vllm import TorchrefitTrainerInitInfo

    sender = WeightTransferTrainerFactory.trainer_init(
        TorchrefitTrainerInitInfo("127.0.0.1", _free_port(2), serve_while_staging=True),
        client=_Client(llm), source=model)
    sender.send_weights(weight_version="staged-warm")
    stage, commit = [], []
    for k in range(repeats):
        step(model, k + 1)
        t0 = time.perf_counter()
        sender.stage_weights()
        t1 = time.perf_counter()
        sender.commit_weights(weight_version=f"staged-{k}")
        stage.append(t1 - t0)
        commit.append(time.perf_counter() - t1)
    sender.shutdown()
    return {"staged_stage_s": statistics.median(stage), "staged_commit_s": statistics.median(commit)}


def run(name: str, repeats: int, staged: bool = False) -> dict:
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm_driver import _Client, _free_port, _full, config, hf_model, start_engine, step

    from torchrefit.engines.vllm import TorchrefitTrainerInitInfo

    cfg = QWEN2_05B if name == "dense-0.5b" else config(name)
    llm = start_engine(cfg)
    port = _free_port(3)  # this process's group, then the trainer's link (port + 1, port + 2)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    model = hf_model(cfg, seed=0)
    sender = WeightTransferTrainerFactory.trainer_init(
        TorchrefitTrainerInitInfo("127.0.0.1", port + 1), client=_Client(llm),
        source=ModuleSource(model))
    sender.send_weights(weight_version="warm")  # the first refit compiles its plan
    ours = []
    for k in range(repeats):
        step(model, k + 1)
        t0 = time.perf_counter()
        sender.send_weights(weight_version=str(k))
        ours.append(time.perf_counter() - t0)
    full = _full(model)
    shapes = {n: list(t.shape) for n, t in full.items()}
    theirs = llm.llm_engine.collective_rpc(_reload_timed, args=(shapes, repeats))[0]
    model_bytes = sum(t.numel() * t.element_size() for t in full.values())
    sent = sum(r.bytes_sent for r in sender.reports)
    routes = sender.routes
    sender.shutdown()
    extra = _staged(llm, model, repeats) if staged else {}
    dist.destroy_process_group()
    llm.llm_engine.engine_core.shutdown()
    return {"model": name, "torchrefit_s": statistics.median(ours),
            "vllm_reload_s": statistics.median(theirs), "bytes_sent_rank0": sent,
            "nccl_bytes_rank0": model_bytes,
            "load_weights_tensors": sum(r.way == "load_weights" for r in routes.values()),
            "direct_tensors": sum(r.way == "direct" for r in routes.values()), **extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["dense", "moe", "dense-0.5b"], default="dense")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--staged", action="store_true",
                    help="also time updates staged while the engine serves (stage, commit)")
    args = ap.parse_args()
    r = run(args.model, args.repeats, args.staged)
    print(f"{r['model']}: torchrefit send_weights {r['torchrefit_s'] * 1e3:.1f} ms | vLLM "
          f"reload_weights (in the worker, no transport) {r['vllm_reload_s'] * 1e3:.1f} ms | "
          f"bytes from trainer rank 0: torchrefit {r['bytes_sent_rank0']:,}, nccl backend "
          f"{r['nccl_bytes_rank0']:,} | tensors: {r['direct_tensors']} in place, "
          f"{r['load_weights_tensors']} through load_weights")
    if args.staged:
        print(f"{r['model']}: staged: stage_weights {r['staged_stage_s'] * 1e3:.1f} ms (serving) | "
              f"commit_weights (the engine's stall) {r['staged_commit_s'] * 1e3:.1f} ms | plain "
              f"send_weights {r['torchrefit_s'] * 1e3:.1f} ms")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
    os._exit(0)
