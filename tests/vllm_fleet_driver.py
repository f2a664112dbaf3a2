"""One trainer's ``tr.Fleet`` feeding two real vLLM CPU engines; run as a script.

``python tests/vllm_fleet_driver.py OUT.json``: this process is the trainer (a
transformers Qwen2 model, one gloo rank) and the launcher. It starts two engine
processes, each a ``vllm.LLM`` with ``worker_extension_cls=FleetWorkerExtension``
(``torchrefit.engines.vllm_fleet``) whose workers join the fleet through vLLM's
``collective_rpc("join_fleet", ...)``, and runs:

1. the oracle shown fair: each engine's dummy weights do not match version 1;
2. versions 1-3: after each ``Fleet.update``, each engine's greedy tokens and top-5
   logprobs against the oracle, a transformers model holding that version's weights
   (built in the engine's process from the same deterministic steps, not from the fleet);
3. version 4: engine B is SIGKILLed while it installs the version (a gate the launcher
   put in B's install blocks it there, the trainer's update in flight); the update must
   return, name B as dropped, and leave A exact at version 4;
4. B restarted (a new join): seeded by A to version 4 and judged at it;
5. versions 5-6: both engines judged again.

Everything seen goes to OUT.json for ``tests/test_vllm_fleet.py`` to judge.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_driver as vd  # noqa: E402

EXTENSION = "torchrefit.engines.vllm_fleet.FleetWorkerExtension"
SECRET = "vllm-fleet-test-secret"
KILL_AT, LAST = 4, 6
PROBE = 3.0  # seconds a generation asked for during the blocked install is given


_T0 = time.monotonic()


def say(what: str) -> None:
    """Progress on stderr (the test shows it when the driver fails)."""
    print(f"[fleet driver {time.monotonic() - _T0:7.1f} s] {what}", file=sys.stderr, flush=True)


def weights(cfg: dict, version: int) -> dict:
    """The trainer's weights at ``version``: seed 0, then steps 1..version (the oracle's
    own computation: no fleet involved)."""
    model = vd.hf_model(cfg, seed=0)
    for k in range(1, version + 1):
        vd.step(model, k)
    return {k: v.clone() for k, v in model.state_dict().items()}


def judge(llm, cfg: dict, version: int) -> dict:
    import torch

    oracle = vd.hf_model(cfg, seed=0)
    oracle.load_state_dict(weights(cfg, version))
    outs = vd._generate(llm)
    with torch.no_grad():
        logps = [torch.log_softmax(oracle(torch.tensor([p + gen])).logits[0].double(), -1)
                 for p, (gen, _) in zip(vd.PROMPTS, outs)]
    return vd._score(outs, logps)


# ------------------------------------------------------------------ engine processes
def _gate(worker, version: int, path: str) -> None:
    """On B's worker: its install of ``version`` blocks (inside the replica's lock) after
    saying so in ``path`` with the worker's pid, until the launcher kills it."""
    import torchrefit.engines.vllm_fleet as vf

    load = vf.load_into_vllm

    def gated(model, model_config, mirror):
        if worker._torchrefit_fleet.replica.version == version:
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(path + ".tmp", path)
            time.sleep(3600)
        load(model, model_config, mirror)

    vf.load_into_vllm = gated


def engine(name: str, port: int, secret_file: str, cfg_json: str, conn) -> None:
    """An engine process: start vLLM, join the fleet, then answer the launcher's commands."""
    from vllm import LLM

    os.setsid()  # its own process group: the launcher kills the engine and its engine core at once
    threading.Thread(target=_orphaned, args=(os.getppid(),), daemon=True).start()
    cfg = json.loads(cfg_json)
    t0 = time.monotonic()
    llm = LLM(model=vd.model_dir(cfg), load_format="dummy", skip_tokenizer_init=True, dtype="float32",
              enforce_eager=True, max_model_len=128, worker_extension_cls=EXTENSION,
              gpu_memory_utilization=0.3)  # on CPU: the share of memory it wants free (two engines)
    started = time.monotonic() - t0
    state = llm.collective_rpc("join_fleet", kwargs=dict(address="127.0.0.1", port=str(port), name=name,
                                                         secret_file=secret_file, timeout="60"))[0]
    conn.send({"joined": state, "start_seconds": started})
    while True:
        cmd = conn.recv()
        try:
            if cmd[0] == "stop":  # leave the fleet; the launcher then kills the engine
                llm.collective_rpc("leave_fleet")
                conn.send({"left": True})
                continue
            if cmd[0] == "probe":
                conn.send({"finished": _probe(llm, cmd[1])})
                continue
            if cmd[0] == "gate":  # by reference: the engine's worker imports this module
                import vllm_fleet_driver

                llm.collective_rpc(vllm_fleet_driver._gate, args=cmd[1:])
                conn.send({"gated": True})
            elif cmd[0] == "check":  # ("check", fleet version to wait for, oracle version)
                state = _wait_version(llm, cmd[1])
                conn.send({"state": state, "verdict": judge(llm, cfg, cmd[2])})
        except Exception:
            conn.send({"error": traceback.format_exc()})


def _orphaned(launcher: int) -> None:
    """The launcher died (a test's timeout, say): take the engine's whole group with it."""
    while os.getppid() == launcher:
        time.sleep(1.0)
    os.killpg(0, signal.SIGKILL)


def _probe(llm, seconds: float) -> bool:
    """Whether a generation asked for now finishes within ``seconds``."""
    done = threading.Event()

    def generate() -> None:
        vd._generate(llm)
        done.set()

    threading.Thread(target=generate, daemon=True).start()
    return done.wait(seconds)


def _wait_version(llm, version: int, limit: float = 60.0) -> dict:
    deadline = time.monotonic() + limit
    while True:
        state = llm.collective_rpc("fleet_state")[0]
        if (state["version"] >= version and (version == 0 or state["ready"])) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


class Engine:
    """The launcher's handle on one engine process."""

    def __init__(self, ctx, name: str, port: int, secret_file: str, cfg_json: str) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine, args=(name, port, secret_file, cfg_json, child))
        self.proc.start()
        self.joined: dict | None = None

    def wait_joined(self, limit: float) -> dict:
        if not self.conn.poll(limit):
            raise TimeoutError("the engine did not join in time")
        self.joined = self.conn.recv()
        return self.joined

    def ask(self, *cmd, limit: float = 120.0) -> dict:
        self.conn.send(cmd)
        if not self.conn.poll(limit):
            raise TimeoutError(f"the engine did not answer {cmd!r}")
        out = self.conn.recv()
        if "error" in out:
            raise RuntimeError(out["error"])
        return out

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.ask("stop", limit=30)
            except Exception:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the engine's process group (its front and its engine core)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.join()


# --------------------------------------------------------------------------- trainer
def run(out: dict, workdir: str) -> None:
    import multiprocessing as mp

    import torch.distributed as dist

    import torchrefit as tr
    from torchrefit.testing.jobs import free_ports

    cfg = vd.config("dense")
    cfg_json = json.dumps(cfg)
    secret_file = os.path.join(workdir, "secret")
    with open(secret_file, "w") as f:
        f.write(SECRET)
    port, dist_port = free_ports(2)
    # the trainer job's own default group (one rank), as every fleet member has one
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=0, world_size=1)
    model = vd.hf_model(cfg, seed=0)
    fleet = tr.Fleet(model, 0, 1, "127.0.0.1", port, secret_file=secret_file, timeout=30.0,
                     drop_after=3.0, join_timeout=60.0)
    ctx = mp.get_context("spawn")
    engines = {"a": Engine(ctx, "a", port, secret_file, cfg_json),
               "b": Engine(ctx, "b", port, secret_file, cfg_json)}
    out["engines"] = {}
    out["checks"] = []  # per judged engine and version: its fleet state and the oracle's verdict
    out["reports"] = []
    out["model_bytes"] = sum(t.numel() * t.element_size() for t in model.parameters())
    try:
        for key, e in engines.items():
            out["engines"][key] = e.wait_joined(300)
            say(f"engine {key} joined: {e.joined}")
        names = {k: e.joined["joined"]["name"] for k, e in engines.items()}
        _wait_table(fleet, set(names.values()), {"waiting", "ready"}, 60)
        say("both in the fleet")
        out["fair"] = {k: e.ask("check", 0, 1)["verdict"] for k, e in engines.items()}

        def check(keys, version):
            for k in keys:
                got = engines[k].ask("check", version, version)
                out["checks"].append({"engine": k, "name": names[k], "version": version, **got})
                say(f"engine {k} at version {version}: {got}")

        def update(v):
            vd.step(model, v)
            out["reports"].append(_report(fleet.update(v)))
            say(out["reports"][-1]["text"])

        for v in range(1, KILL_AT):
            update(v)
            check(("a", "b"), v)
        # the victim: the engine the trainer fed (the relay the other one hangs from)
        fed = {x["name"]: x["source"] for x in out["reports"][-1]["replicas"]}
        victim = next(k for k in names if fed[names[k]] == "trainer")
        survivor = next(k for k in names if k != victim)
        out["victim"], out["survivor"] = names[victim], names[survivor]
        # version KILL_AT: the victim is killed inside its install, the update in flight
        gate = os.path.join(workdir, "gate")
        engines[victim].ask("gate", KILL_AT, gate)
        killed: dict = {}
        killer = threading.Thread(target=_kill_at_gate, args=(gate, engines[victim], killed), daemon=True)
        killer.start()
        t0 = time.monotonic()
        try:
            update(KILL_AT)
        except Exception:
            out["update_raised"] = traceback.format_exc()
            say(out["update_raised"])
        out["kill_update_seconds"] = time.monotonic() - t0
        killer.join(PROBE + 30)
        out["killed"] = killed
        say(f"killed: {killed}")
        if "worker_pid" not in killed:
            raise RuntimeError(f"the victim was not killed inside its install: {killed}")
        check((survivor,), KILL_AT)
        # the victim restarts: a new join, seeded by the survivor
        t0 = time.monotonic()
        engines[victim] = Engine(ctx, victim, port, secret_file, cfg_json)
        out["engines"]["restart"] = engines[victim].wait_joined(300)
        names[victim] = out["restart"] = engines[victim].joined["joined"]["name"]
        say(f"engine {victim} restarted: {engines[victim].joined}")
        _wait_table(fleet, {names[victim]}, {"ready"}, 60)
        out["restart_seconds"] = time.monotonic() - t0
        out["seeds"] = [list(s) for s in fleet.coordinator.seeds]
        say(f"seeds: {out['seeds']}")
        check((victim,), KILL_AT)
        for v in range(KILL_AT + 1, LAST + 1):
            update(v)
            check(("a", "b"), v)
    finally:
        for e in engines.values():
            e.stop()
        fleet.close()
        dist.destroy_process_group()


def _kill_at_gate(gate: str, eng: Engine, killed: dict, limit: float = 60.0) -> None:
    """Once the victim's install is blocked at the gate: ask it for a generation (which
    must not finish: the install holds the lock its steps take), then SIGKILL its worker
    (the fleet member) and the rest of the engine."""
    deadline = time.monotonic() + limit
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)
    if not os.path.exists(gate):
        killed["error"] = "the gate was never reached"
        return
    with open(gate) as f:
        worker = int(f.read())
    try:  # a step asked for now must wait: the install holds the replica's lock
        killed["probe"] = eng.ask("probe", PROBE)
    except Exception as e:
        killed["probe"] = {"error": repr(e)}
    os.kill(worker, signal.SIGKILL)
    eng.kill()
    killed.update(worker_pid=worker, at=time.monotonic())


def _wait_table(fleet, names: set[str], states: set[str], limit: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        table = {m.name: m.state for m in fleet.replicas()}
        if all(table.get(n) in states for n in names):
            return
        time.sleep(0.05)
    raise TimeoutError(f"replicas {sorted(names)} not {sorted(states)} within {limit:g} s: "
                       f"{[(m.name, m.state) for m in fleet.replicas()]}")


def _report(r) -> dict:
    return {"version": r.version, "seconds": r.seconds, "trainer_bytes_sent": r.trainer_bytes_sent,
            "rounds": r.rounds, "dropped": r.dropped, "text": str(r),
            "replicas": [{"name": x.name, "version": x.version, "mixed": x.mixed, "source": x.source,
                          "dropped": x.dropped, "bytes": x.bytes} for x in r.replicas]}


def main(out_path: str) -> None:
    import logging
    import tempfile

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("torchrefit.fleet").setLevel(logging.INFO)
    t0 = time.monotonic()
    result: dict = {}
    try:
        run(result, tempfile.mkdtemp(prefix="torchrefit-vllm-fleet-"))
    except Exception:
        result["error"] = traceback.format_exc()
    result["seconds"] = time.monotonic() - t0
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)  # vLLM's engine threads: leave at once
