"""One weight update into a real SGLang CPU engine: torchrefit against SGLang's own two paths.

    SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=src:tests/sglang_cpu_stub \\
        python benchmarks/sglang_update.py --model dense --tp 1 --repeats 5

Starts one ``sglang.Engine`` (CPU, float32, dummy weights) on a model config it writes,
with one trainer rank in this process holding a ``transformers`` model of the same
config, and times on that one engine, in this order:

* ``torchrefit``: ``sender.send_weights()`` (SGLang's ``begin_weight_update``, the
  exchange over gloo straight into each TP worker's live shards, ``end_weight_update``,
  ``flush_cache``, the weight version);
* ``update_weights_from_distributed``: SGLang's broadcast from trainer rank 0 over a
  gloo group (``init_weights_update_group`` once; per update begin, every tensor whole
  by ``broadcast``, the model's ``load_weights``, end);
* ``update_weights_from_tensor``: SGLang's serialized whole tensors to every TP worker
  (begin, ``update_weights_from_tensor``, end).

Each update writes the same weights; the engine's greedy tokens after each path are
checked equal to torchrefit's (``tokens agree``). ``bytes_sent`` into the engine:
torchrefit's ``RefitReport.bytes_sent`` (each worker its own shard; the tensors every
worker holds whole, the norms, once per worker); SGLang's paths deliver every tensor
whole to every TP worker (``tp`` x the model's bytes; counted). Prints one JSON object.

Models: ``dense`` (the test model, 1.4 MB), ``dense-0.5b`` (a Qwen2-0.5B shape, tied).

``--http``: the engine is a ``sglang.launch_server`` HTTP server (with torchrefit's
``--custom-weight-loader``) instead, and every path goes through its HTTP routes:
torchrefit through :class:`~torchrefit.engines.sglang_http.HTTPClient`, SGLang's two
through ``/init_weights_update_group`` + ``/update_weights_from_distributed`` and
``/update_weights_from_tensor`` (the tensors' bytes inline in the request, pickled).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

QWEN2_05B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                 intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, head_dim=64, vocab_size=151936,
                 max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e6,
                 tie_word_embeddings=True, torch_dtype="float32")


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _ok(result, what: str) -> None:
    ok, message = result if isinstance(result, tuple) else (True, "")
    if not ok:
        raise RuntimeError(f"{what}: {message}")


def _distributed(engine, model, tp: int, port: int):
    """SGLang's ``update_weights_from_distributed``: the trainer is rank 0 of a gloo group
    with every TP worker (``init_custom_process_group``, as slime and verl make it)."""
    import torch.distributed as dist
    from sglang.srt.utils.common import init_custom_process_group

    group = "torchrefit_bench"
    box = {}
    joiner = threading.Thread(target=lambda: box.setdefault("r", engine.init_weights_update_group(
        "127.0.0.1", port, 1, 1 + tp, group, backend="gloo")))
    joiner.start()
    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                                   world_size=1 + tp, rank=0, group_name=group)
    joiner.join()
    _ok(box["r"], "init_weights_update_group")
    named = [(n, p.detach()) for n, p in model.named_parameters()]

    def update():
        _ok(engine.begin_weight_update(), "begin_weight_update")
        got = {}
        rpc = threading.Thread(target=lambda: got.setdefault("r", (
            engine.update_weights_from_distributed(
                [n for n, _ in named], [str(t.dtype).split(".")[1] for _, t in named],
                [list(t.shape) for _, t in named], group_name=group))))
        rpc.start()
        handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in named]
        for h in handles:
            h.wait()
        rpc.join()
        _ok(got["r"], "update_weights_from_distributed")
        _ok(engine.end_weight_update(), "end_weight_update")

    return update


def _from_tensor(engine, model):
    named = [(n, p.detach()) for n, p in model.named_parameters()]

    def update():
        _ok(engine.begin_weight_update(), "begin_weight_update")
        _ok(engine.update_weights_from_tensor(named), "update_weights_from_tensor")
        _ok(engine.end_weight_update(), "end_weight_update")

    return update


class _HTTPEngine:
    """The ``sglang.Engine`` calls the paths above make, through the server's routes."""

    def __init__(self, url: str, tp: int) -> None:
        self.url, self.tp = url, tp

    def _post(self, route: str, body: dict):
        import requests

        got = requests.post(self.url + route, json=body, timeout=3600).json()
        return got.get("success", True), got.get("message", "")

    def begin_weight_update(self):
        return self._post("/begin_weight_update", {})

    def end_weight_update(self):
        return self._post("/end_weight_update", {})

    def init_weights_update_group(self, address, port, offset, world, group, backend):
        return self._post("/init_weights_update_group", dict(
            master_address=address, master_port=port, rank_offset=offset, world_size=world,
            group_name=group, backend=backend))

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name):
        return self._post("/update_weights_from_distributed", dict(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name))

    def update_weights_from_tensor(self, named):
        """The tensors' bytes inline (pickled, base64): SGLang's own serializer passes CPU
        tensors as file descriptors, which only its own child processes may open."""
        import base64
        import pickle

        payload = base64.b64encode(pickle.dumps(named)).decode()
        return self._post("/update_weights_from_tensor", dict(
            serialized_named_tensors=[payload] * self.tp))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("dense", "dense-0.5b"), default="dense")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--http", action="store_true", help="an HTTP server, through its routes")
    args = ap.parse_args()

    import torch.distributed as dist
    from sglang_driver import generate, start_engine, start_server
    from vllm_driver import _free_port, config, hf_model

    from torchrefit.engines.sglang import SGLangInitInfo, init_sender

    cfg = config("dense") if args.model == "dense" else QWEN2_05B
    os.environ["TORCHREFIT_SGLANG_CONFIG_JSON"] = json.dumps(cfg)
    if args.tp > 1:
        os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND",
                              "|".join(str(r % (os.cpu_count() or 1)) for r in range(args.tp)))
    server = None
    share = 0.2 if args.model == "dense" else 0.3  # the 0.5B shape's weights need more
    if args.http:
        engine, server = start_server(cfg, args.tp, share)  # engine: the URL
    else:
        engine = start_engine(cfg, tp=args.tp, mem_fraction_static=share)
    sglang_calls = _HTTPEngine(engine, args.tp) if args.http else engine
    port = _free_port(8)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = hf_model(cfg, seed=0)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sender = init_sender(SGLangInitInfo("127.0.0.1", port + 2), model, engine)
    results: dict = {"model": args.model, "tp": args.tp, "http": args.http,
                     "model_bytes": model_bytes, "repeats": args.repeats}
    times = _timed(lambda: sender.send_weights(weight_version="bench"), args.repeats)
    tokens = [g[0] for g in generate(engine)]
    results["torchrefit"] = {"median_s": statistics.median(times), "all_s": times,
                             "bytes_sent": sum(r.bytes_sent for r in sender.reports)}
    for name, update in (("update_weights_from_distributed",
                          _distributed(sglang_calls, model, args.tp, port + 4)),
                         ("update_weights_from_tensor", _from_tensor(sglang_calls, model))):
        times = _timed(update, args.repeats)
        results[name] = {"median_s": statistics.median(times), "all_s": times,
                         "bytes_sent": model_bytes * args.tp,  # whole, to every worker
                         "tokens agree": [g[0] for g in generate(engine)] == tokens}
    sender.shutdown()
    print(json.dumps(results, indent=1))
    if server is not None:
        import signal

        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
    else:
        engine.shutdown()


if __name__ == "__main__":
    main()
    os._exit(0)
