"""Faults and endurance with one real vLLM CPU engine fed by torchrefit's backend; a script.

``python tests/vllm_faults_driver.py OUT.json`` starts one ``vllm.LLM`` (dense
Qwen2-shaped model, float32, ``WeightTransferConfig(backend="torchrefit")``) in this
process, which then only serves: the trainers are separate processes (2 gloo ranks,
FSDP2), so that either side can be killed. Trainer rank 0's client reaches the ``LLM``
through a pipe (:class:`_PipeClient`); this process answers it, and kills a trainer rank
or the engine's process when a case asks it to. ``tests/test_vllm_engine_faults.py``
judges what was recorded. In order:

* ``endurance``: ``UPDATES`` consecutive updates, each followed by the engine's weight
  version and a checksum of every tensor the worker still holds readable (read on the
  worker by ``collective_rpc``, compared with the trainer's weights put into vLLM's
  layout here); every ``JUDGE_EVERY`` updates greedy tokens and logprobs against a
  ``transformers`` model holding the trainer's weights; the resident memory of the
  engine's process and of each trainer rank sampled.
* ``trainer_killed``: trainer rank 1 is killed (SIGKILL) while an update is in flight
  (the worker's ``load_weights`` held back so the exchange is under way); what the
  engine's ``update_weights`` raised, the version it reports, and its tokens against the
  previous weights.
* ``staged_killed``: a new 2-rank trainer with ``serve_while_staging=True`` initializes
  against the same engine, stages and commits one update, then trainer rank 1 leaves
  (``os._exit``) right after posting the sends of the update's second refit (the
  ``load_weights`` one: the in-place tensors' stage has completed on every rank, their
  staging holds the new version whole) while the engine serves: what each side raised,
  the engine's version, its tokens against the committed and the cut update's weights,
  and the digests of its readable tensors.
* ``restarted``: a new 2-rank trainer (new process group) initializes again against the
  same engine and sends the next version; the engine must equal it exactly.
* ``engine_killed``: the engine's process is killed while an update is in flight: what
  every trainer rank raised and when, and whether its parameters and optimizer state are
  as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm_driver import PROMPTS, _compare, _free_port, _full, config, hf_model, start_engine  # noqa: E402

UPDATES = 200
JUDGE_EVERY = 25
TIMEOUT = 5.0  # seconds any rank of either job waits for a peer
HOLD = 3.0  # the worker's first load_weights bucket of a faulted update waits this long
KILL_AFTER = 1.0  # seconds into the held update that a process is killed
STAGED = "staged"  # the version the staged trainer commits before its rank 1 dies
WORLD = 2


def step(model, k: int) -> None:
    """A deterministic training step (version k) that moves every weight and keeps the
    weights spread however many steps run (a third flip sign, all drift by +-0.001), so
    that greedy tokens still tell versions apart after hundreds of updates."""
    import torch

    with torch.no_grad():
        for i, (_, p) in enumerate(sorted(model.named_parameters())):
            local = p.to_local() if hasattr(p, "to_local") else p
            local.mul_(-1.0 if i % 3 == k % 3 else 1.0).add_(0.001 if k % 2 else -0.001)


# ------------------------------------------------------------------ trainer processes
class _PipeClient:
    """vLLM's four weight-sync methods (and the tests' questions) over a pipe to the
    process that holds the ``LLM``; one request at a time."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()

    def ask(self, method, *args):
        with self.lock:
            self.conn.send((method, args))
            status, value = self.conn.recv()
        if status == "err":
            raise RuntimeError(value)
        return value

    def init_weight_transfer_engine(self, init_info):
        self.ask("init_weight_transfer_engine", init_info)

    def start_weight_update(self):
        self.ask("start_weight_update")

    def update_weights(self, update_info):
        self.ask("update_weights", update_info)

    def finish_weight_update(self, weight_version=None):
        self.ask("finish_weight_update", weight_version)


def _rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def vllm_layout(full: dict) -> dict:
    """The trainer's whole weights put the way vLLM holds them (fused q/k/v and gate/up)."""
    import torch

    out = dict(full)
    for name in list(full):
        if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
            base, leaf = name.rsplit(".q_proj.", 1)
            out[f"{base}.qkv_proj.{leaf}"] = torch.cat(
                [full[f"{base}.{p}_proj.{leaf}"] for p in "qkv"])
        if name.endswith("mlp.gate_proj.weight"):
            base = name.rsplit(".gate_proj.", 1)[0]
            out[f"{base}.gate_up_proj.weight"] = torch.cat(
                [full[f"{base}.gate_proj.weight"], full[f"{base}.up_proj.weight"]])
    return out


def digest(t) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def checksum_mismatches(worker: dict, full: dict) -> list[str]:
    """The worker's readable tensors whose digest differs from the trainer's (or that the
    trainer cannot name); empty when they all agree."""
    ours = vllm_layout(full)
    return [n for n, d in worker.items() if n not in ours or digest(ours[n]) != d]


def trainer_job(rank: int, job: str, dist_port: int, port: int, conn, cfg_json: str):
    os.environ["TORCHREFIT_VLLM_CONFIG_JSON"] = cfg_json
    import faulthandler

    import torch.distributed as dist

    faulthandler.dump_traceback_later(400, exit=True)  # a hung rank shows where, and ends

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank,
                            world_size=WORLD)
    client = _PipeClient(conn) if conn is not None else None
    jobs = {"first": _first_job, "staged": _staged_job, "second": _second_job}
    try:
        out = jobs[job](rank, client, port)
    except Exception:
        out = {"error": f"trainer rank {rank}: {traceback.format_exc()}"}
    if client is not None:
        client.conn.send(("done", (out,)))
    os._exit(0)  # a process group with a dead peer: leave at once


def _trainer(rank: int, client, port: int, staged: bool = False):
    """An FSDP2 model of the fixed seed, an optimizer, and the sender (``staged``: updates
    staged while the engine serves, committed by ``finish_weight_update``)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from torchrefit.engines.vllm import TorchrefitTrainerInitInfo

    model = hf_model(config("dense"), seed=0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    dist.barrier()  # both ranks reach the rendezvous together: it waits TIMEOUT only
    info = TorchrefitTrainerInitInfo("127.0.0.1", port, timeout=TIMEOUT, bucket_bytes=1 << 18,
                                     serve_while_staging=staged)
    sender = WeightTransferTrainerFactory.trainer_init(
        info, client=client if rank == 0 else _Unused(), source=ModuleSource(model))
    return model, optim, sender


class _Unused:
    def __getattr__(self, name):
        raise AssertionError(f"a trainer rank other than 0 called its client's {name}")


def _judge(client, full: dict) -> dict:
    return _compare(client.ask("generate"), full)


def _first_job(rank: int, client, port: int) -> dict:
    import torch.distributed as dist

    model, _, sender = _trainer(rank, client, port)
    out: dict = {"versions": [], "mismatched": [], "judged": [], "rss": []}
    for k in range(1, UPDATES + 1):
        step(model, k)
        sender.send_weights(weight_version=f"v{k}")
        full = _full(model)
        rss = [None] * WORLD
        dist.all_gather_object(rss, _rss_mib())
        if rank == 0:
            out["versions"].append(client.ask("version"))
            bad = checksum_mismatches(client.ask("checksums"), full)
            out["mismatched"].append(bad)
            if k == 1:
                out["checked_tensors"] = sorted(client.ask("checksums"))
            if k % JUDGE_EVERY == 0 or k == 1:
                out["judged"].append(dict(_judge(client, full), update=k))
            out["rss"].append(dict(engine=client.ask("engine_rss"), trainers=rss))
    # trainer rank 1 dies in the middle of the next update
    previous = _full(model)
    step(model, UPDATES + 1)
    new = _full(model)
    if rank == 0:
        client.ask("hold_next_load", HOLD)
        client.ask("kill_at_next_update", "trainer 1", KILL_AFTER)
    seen = _outcome(lambda: sender.send_weights(weight_version=f"v{UPDATES + 1}"))
    if rank == 0:
        out["trainer_killed"] = dict(
            seen, weight_version=client.ask("version"), engine=client.ask("last_update"),
            previous=_judge(client, previous), new=_judge(client, new),
            mismatched=checksum_mismatches(client.ask("checksums"), previous))
    return out


def _outcome(call) -> dict:
    """What ``call()`` did: the exception it raised (its class name and message) or None,
    and how many seconds it took."""
    t0 = time.monotonic()
    try:
        call()
        seen = {"raised": None}
    except Exception as e:
        seen = {"raised": type(e).__name__, "message": str(e)}
    seen["seconds"] = time.monotonic() - t0
    return seen


def _staged_job(rank: int, client, port: int) -> dict:
    model, _, sender = _trainer(rank, client, port, staged=True)
    for k in range(1, UPDATES + 2):  # the first job's cut update, staged this time
        step(model, k)
    sender.send_weights(weight_version=STAGED)  # stage, then commit
    committed = _full(model)
    out: dict = {}
    if rank == 0:
        out["committed"] = dict(_judge(client, committed), weight_version=client.ask("version"))
    step(model, UPDATES + 2)
    new = _full(model)
    if rank == 1:  # leaves mid-stage: the load_weights refit's first sends posted
        transport = sender._refitters[-1]._transport
        start = transport.start

        def dying_start(sends, recvs):
            start(sends, recvs)
            os._exit(9)

        transport.start = dying_start
    seen = _outcome(sender.stage_weights)
    try:
        sender.commit_weights(weight_version=f"{STAGED}+1")
        seen["commit"] = None
    except Exception as e:
        seen["commit"] = f"{type(e).__name__}: {e}"
    if rank == 0:
        out["staged_killed"] = dict(
            seen, weight_version=client.ask("version"), engine=client.ask("stage_error"),
            previous=_judge(client, committed),
            new=_judge(client, new), mismatched=checksum_mismatches(client.ask("checksums"), committed))
    return out


def _second_job(rank: int, client, port: int) -> dict:
    import torch
    import torch.distributed as dist

    model, optim, sender = _trainer(rank, client, port)
    for k in range(1, UPDATES + 3):  # the same model as the first job's, one step further
        step(model, k)
    out: dict = {}
    sender.send_weights(weight_version=f"v{UPDATES + 2}")
    full = _full(model)
    if rank == 0:
        out["restarted"] = dict(_judge(client, full), weight_version=client.ask("version"),
                                mismatched=checksum_mismatches(client.ask("checksums"), full))
    # a real optimizer step, so that the optimizer has state to keep
    model(torch.tensor([PROMPTS[0]])).logits.float().pow(2).mean().backward()
    optim.step()
    params = {n: p.to_local().clone() for n, p in model.named_parameters()}
    state = {(n, k): v.to_local().clone() if hasattr(v, "to_local") else v.clone()
             for n, p in model.named_parameters() for k, v in optim.state[p].items()}
    if rank == 0:
        client.ask("hold_next_load", HOLD)
        client.ask("kill_at_next_update", "engine", KILL_AFTER)
    seen = _outcome(lambda: sender.send_weights(weight_version=f"v{UPDATES + 3}"))
    seen["params_equal"] = all(torch.equal(p.to_local(), params[n])
                               for n, p in model.named_parameters())
    now = {(n, k): v.to_local() if hasattr(v, "to_local") else v
           for n, p in model.named_parameters() for k, v in optim.state[p].items()}
    seen["optimizer_equal"] = (now.keys() == state.keys() and len(state) > 0
                               and all(torch.equal(now[key], state[key]) for key in state))
    ranks = [None] * WORLD
    dist.all_gather_object(ranks, seen)  # the trainers' own group is intact
    if rank == 0:
        out["engine_killed"] = {"ranks": ranks}
    return out


# ------------------------------------------------------------- the engine's process
def _worker_checksums(worker) -> dict:
    """Per tensor the worker holds readable (vLLM CPU empties its packed linears): a
    digest of its bytes."""
    out = {}
    for name, t in worker.model_runner.model.state_dict().items():
        if t.numel() > 0 and "_scale" not in name and "cos_sin_cache" not in name:
            out[name] = hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()
                                       ).hexdigest()[:16]
    return out


def _stage_error(worker) -> str | None:
    return worker.weight_transfer_engine.last_stage_error


def _hold_next_load(worker, seconds: float):
    """The model's next ``load_weights`` call waits ``seconds`` first (an update in
    flight long enough to kill a process in its middle)."""
    model = worker.model_runner.model
    original = model.load_weights

    def held(weights):
        model.load_weights = original
        time.sleep(seconds)
        return original(weights)

    model.load_weights = held


def _engine_pids() -> list[int]:
    """The engine's processes: its core (this process's child) and the worker under it."""
    core = _child(os.getpid(), b"EngineCore")
    return [_child(core, b"Worker"), core]


def _child(parent: int, title: bytes) -> int:
    me = str(parent)
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == me and title in cmd:
            return int(pid)
    raise RuntimeError(f"no child of {parent} titled {title.decode()}")


def _kill(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


class Host:
    """Answers trainer rank 0's pipe: the ``LLM``'s weight-sync calls, the tests' questions,
    and the kills a case asks for."""

    def __init__(self, llm, procs):
        self.llm, self.procs = llm, procs
        self.kill: tuple[str, float] | None = None
        self.last_update: dict = {}
        self.engine_killed = False

    def serve(self, conn) -> dict:
        while True:
            if not conn.poll(1.0):
                if all(not p.is_alive() for p in self.procs):
                    return {"error": "trainer rank 0 exited without its report"}
                continue
            method, args = conn.recv()
            if method == "done":
                return args[0]
            # once the engine is killed its LLM may never answer: the trainers' bound then
            limit = 3 * TIMEOUT + HOLD + 5 if self.engine_killed else 60.0
            conn.send(self.answer(getattr(self, "do_" + method), args, limit))

    @staticmethod
    def answer(call, args, limit: float) -> tuple:
        """``call(*args)`` bounded: an ``LLM`` whose engine was killed may never answer."""
        box: list = [("err", f"no answer from the engine within {limit:g} s")]

        def run():
            try:
                box[0] = ("ok", call(*args))
            except Exception as e:
                box[0] = ("err", f"{type(e).__name__}: {e}")

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(limit)
        return box[0]

    def do_init_weight_transfer_engine(self, init_info):
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def do_start_weight_update(self):
        self.llm.start_weight_update()

    def do_update_weights(self, update_info):
        if self.kill is not None:
            target, after = self.kill
            self.kill = None
            pids = [self.procs[1].pid] if target == "trainer 1" else _engine_pids()
            self.engine_killed = target == "engine"
            threading.Timer(after, _kill, (pids,)).start()
        t0 = time.monotonic()
        try:
            self.llm.update_weights({"update_info": update_info})
            self.last_update = {"raised": None}
        except Exception as e:
            self.last_update = {"raised": type(e).__name__, "message": str(e)}
            raise
        finally:
            self.last_update["seconds"] = time.monotonic() - t0

    def do_finish_weight_update(self, weight_version):
        self.llm.finish_weight_update(weight_version=weight_version)

    def do_version(self):
        return self.llm.get_weight_version()

    def do_checksums(self):
        return self.llm.llm_engine.collective_rpc(_worker_checksums)[0]

    def do_generate(self):
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params,
                                 use_tqdm=False)
        return [(list(o.outputs[0].token_ids),
                 [{t: v.logprob for t, v in lp.items()} for lp in o.outputs[0].logprobs])
                for o in outs]

    def do_stage_error(self):
        return self.llm.llm_engine.collective_rpc(_stage_error)[0]

    def do_engine_rss(self):
        return _rss_mib(_engine_pids()[0])  # the worker: it holds the weights and the link

    def do_hold_next_load(self, seconds):
        self.llm.llm_engine.collective_rpc(_hold_next_load, args=(seconds,))

    def do_kill_at_next_update(self, target, after):
        self.kill = (target, after)

    def do_last_update(self):
        return self.last_update


def run_job(llm, ctx, job: str, cfg_json: str) -> dict:
    import torch.multiprocessing  # noqa: F401  (the spawn context's pickling of tensors)

    ours, theirs = ctx.Pipe()
    port = _free_port(3)  # the trainer's link (port, port + 1), then its job's own group
    dist_port = port + 2
    procs = [ctx.Process(target=trainer_job, args=(r, job, dist_port, port,
                                                   theirs if r == 0 else None, cfg_json))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    host = Host(llm, procs)
    result = host.serve(ours)
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    return result


def main(out_path: str) -> None:
    import torch.multiprocessing as mp

    cfg = config("dense")
    cfg_json = json.dumps(cfg)
    os.environ["TORCHREFIT_VLLM_CONFIG_JSON"] = cfg_json
    llm = start_engine(cfg)
    ctx = mp.get_context("spawn")
    result: dict = {}
    try:
        t0 = time.monotonic()
        result["first"] = run_job(llm, ctx, "first", cfg_json)
        result["first_seconds"] = time.monotonic() - t0
        t0 = time.monotonic()
        result["staged"] = run_job(llm, ctx, "staged", cfg_json)
        result["staged_seconds"] = time.monotonic() - t0
        result["second"] = run_job(llm, ctx, "second", cfg_json)
    except Exception:
        result["error"] = traceback.format_exc()
    for part in ("first", "staged", "second"):
        if "error" in result.get(part, {}):
            result.setdefault("error", result[part]["error"])
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    try:  # the engine was killed; whatever of it is left goes
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)  # vLLM's engine threads (and a killed engine): leave at once
