"""One trainer's ``tr.Fleet`` feeding two real vLLM CPU engines; run as a script.

``python tests/vllm_fleet_driver.py OUT.json``: this process is the trainer (a
transformers Qwen2 model, one gloo rank) and the launcher. It starts two engine
processes, each a ``vllm.LLM`` with ``worker_extension_cls=FleetWorkerExtension``
(``torchrefit.engines.vllm_fleet``) whose workers join the fleet through vLLM's
``collective_rpc("join_fleet", ...)``: engine ``a`` at tensor parallel 2 (its two
workers are the two ranks of one replica, each holding its shards), engine ``b`` at
TP1. It runs:

1. the oracle shown fair: each engine's dummy weights do not match version 1;
2. versions 1-3: after each ``Fleet.update``, each engine's greedy tokens and top-5
   logprobs against the oracle, a transformers model holding that version's weights
   (built in the engine's process from the same deterministic steps, not from the fleet);
3. version 4: the engine the trainer feeds is SIGKILLed while it installs the version (a
   gate the launcher put in its install blocks it there, the trainer's update in flight);
   the update must return, name it as dropped, and leave the other exact at version 4;
4. the killed engine restarted (a new join): seeded by the other to version 4, judged;
5. version 5: the other engine is SIGKILLed while it receives the version (a gate blocks
   its workers between two parts: bytes of version 5 in its staging, none installed, the
   engine still serving version 4); the update must return, name it, and leave the
   restarted engine exact at version 5; the killed one restarted, seeded by its peer;
6. version 6: both engines judged again.

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
KILL_AT, KILL_RECEIVING_AT, LAST = 4, 5, 6
TP = {"a": 2, "b": 1}  # each engine's tensor parallel size (a restart keeps it)
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
def _at_gate(path: str, rank: int, said: dict) -> None:
    """A worker at a gate: say so in ``path.RANK`` (its pid and what it holds), then block
    until the launcher kills it."""
    with open(f"{path}.{rank}.tmp", "w") as f:
        json.dump({"pid": os.getpid(), **said}, f)
    os.replace(f"{path}.{rank}.tmp", f"{path}.{rank}")
    time.sleep(3600)


def _gate(worker, version: int, path: str) -> None:
    """On every worker of the victim: its install of ``version`` blocks (inside the
    replica's lock) at the gate."""
    import torchrefit.engines.vllm_fleet as vf

    load = vf.load_into_vllm
    replica = worker._torchrefit_fleet.replica

    def gated(*args):
        if replica.version == version:
            _at_gate(path, replica.rank, {"version": replica.version})
        load(*args)

    vf.load_into_vllm = gated


def _gate_receiving(worker, version: int, path: str) -> None:
    """On every worker of the victim: while it receives ``version``, it blocks at the gate
    before the update's second part (its first part received into staging, nothing
    installed: the worker's version and vLLM's are the previous one)."""
    member = worker._torchrefit_fleet
    fleet = member.replica._worker
    receive, word = fleet._receive, fleet._word
    now: dict = {}

    def receiving(task, e, outs):
        now["version"] = task["version"]
        try:
            return receive(task, e, outs)
        finally:
            now.clear()

    def gated_word(b, key, part, until=None):
        if now.get("version") == version and part == 1 and b is fleet.board:
            _at_gate(path, member.replica.rank, {"version": member.replica.version,
                                                 "served": member.served})
        return word(b, key, part, until)

    fleet._receive, fleet._word = receiving, gated_word


def engine(name: str, port: int, secret_file: str, cfg_json: str, tp: int, conn) -> None:
    """An engine process: start vLLM, join the fleet, then answer the launcher's commands."""
    if tp > 1:  # one NUMA node here: vLLM CPU cannot bind each worker to its own
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM

    os.setsid()  # its own process group: the launcher kills the engine and its engine core at once
    threading.Thread(target=_orphaned, args=(os.getppid(),), daemon=True).start()
    cfg = json.loads(cfg_json)
    t0 = time.monotonic()
    llm = LLM(model=vd.model_dir(cfg), load_format="dummy", skip_tokenizer_init=True, dtype="float32",
              enforce_eager=True, max_model_len=128, worker_extension_cls=EXTENSION,
              tensor_parallel_size=tp,
              gpu_memory_utilization=0.3)  # on CPU: the share of memory it wants free (two engines)
    started = time.monotonic() - t0
    states = llm.collective_rpc("join_fleet", kwargs=dict(address="127.0.0.1", port=str(port), name=name,
                                                          secret_file=secret_file, timeout="60"))
    conn.send({"joined": states[0], "workers": states, "start_seconds": started})
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
            if cmd[0] == "gate":  # ("gate", which, ...) by reference: the worker imports this module
                import vllm_fleet_driver

                llm.collective_rpc(getattr(vllm_fleet_driver, cmd[1]), args=cmd[2:])
                conn.send({"gated": True})
            elif cmd[0] == "check":  # ("check", fleet version to wait for, oracle version)
                states = _wait_version(llm, cmd[1])
                conn.send({"state": states[0], "workers": states, "verdict": judge(llm, cfg, cmd[2])})
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


def _wait_version(llm, version: int, limit: float = 60.0) -> list[dict]:
    """Every worker's fleet state, once all hold ``version`` (or ``limit`` passed)."""
    deadline = time.monotonic() + limit
    while True:
        states = llm.collective_rpc("fleet_state")
        if all(s["version"] >= version and (version == 0 or s["ready"]) for s in states) or (
                time.monotonic() > deadline):
            return states
        time.sleep(0.05)


class Engine:
    """The launcher's handle on one engine process."""

    def __init__(self, ctx, name: str, port: int, secret_file: str, cfg_json: str) -> None:
        self.tp = TP[name]
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine, args=(name, port, secret_file, cfg_json, self.tp, child))
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

    # a vocabulary vLLM pads (to 256) before cutting it: the TP2 engine's ranks hold 128
    # and 122 of its rows, not an even share
    cfg = dict(vd.config("dense"), vocab_size=250)
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

        def kill_during(version, key, gate_kind):
            """Update to ``version`` while engine ``key`` blocks at the gate and is killed
            there; returns what the killer saw."""
            gate = os.path.join(workdir, f"gate-{version}")
            engines[key].ask("gate", gate_kind, version, gate)
            killed: dict = {}
            killer = threading.Thread(target=_kill_at_gate, args=(gate, engines[key], killed),
                                      daemon=True)
            killer.start()
            t0 = time.monotonic()
            try:
                update(version)
            except Exception:
                out.setdefault("update_raised", []).append(traceback.format_exc())
                say(out["update_raised"][-1])
            killed["update_seconds"] = time.monotonic() - t0
            killed["began"] = t0  # on the clock of "at" (the kill): what came after the kill
            killer.join(PROBE + 30)
            say(f"killed at version {version}: {killed}")
            if "worker_pids" not in killed:
                raise RuntimeError(f"engine {key} was not killed at its gate: {killed}")
            return killed

        def restart(key, label):
            """Engine ``key`` again (a new join, seeded by its live peer); its new name."""
            t0 = time.monotonic()
            engines[key] = Engine(ctx, key, port, secret_file, cfg_json)
            out["engines"][label] = engines[key].wait_joined(300)
            names[key] = engines[key].joined["joined"]["name"]
            say(f"engine {key} restarted: {engines[key].joined}")
            _wait_table(fleet, {names[key]}, {"ready"}, 60)
            out[f"{label}_seconds"] = time.monotonic() - t0
            return names[key]

        for v in range(1, KILL_AT):
            update(v)
            check(("a", "b"), v)
        # the first victim: the engine the trainer fed (the relay the other one hangs from)
        fed = {x["name"]: x["source"] for x in out["reports"][-1]["replicas"]}
        victim = next(k for k in names if fed[names[k]] == "trainer")
        survivor = next(k for k in names if k != victim)
        out["victim"], out["survivor"] = names[victim], names[survivor]
        # version KILL_AT: the victim is killed inside its install, the update in flight
        out["killed"] = kill_during(KILL_AT, victim, "_gate")
        check((survivor,), KILL_AT)
        out["restart"] = restart(victim, "restart")
        check((victim,), KILL_AT)
        # version KILL_RECEIVING_AT: the other engine is killed while it receives
        out["victim2"] = names[survivor]
        out["killed2"] = kill_during(KILL_RECEIVING_AT, survivor, "_gate_receiving")
        check((victim,), KILL_RECEIVING_AT)
        out["restart2"] = restart(survivor, "restart2")
        check((survivor,), KILL_RECEIVING_AT)
        out["seeds"] = [list(s) for s in fleet.coordinator.seeds]
        say(f"seeds: {out['seeds']}")
        for v in range(KILL_RECEIVING_AT + 1, LAST + 1):
            update(v)
            check(("a", "b"), v)
    finally:
        for e in engines.values():
            e.stop()
        fleet.close()
        dist.destroy_process_group()


def _kill_at_gate(gate: str, eng: Engine, killed: dict, limit: float = 60.0) -> None:
    """Once every worker of the victim is blocked at the gate: ask it for a generation
    (``probe``: whether one finishes while the workers wait there), then SIGKILL its
    workers (the fleet's ranks) and the rest of the engine."""
    paths = [f"{gate}.{r}" for r in range(eng.tp)]
    deadline = time.monotonic() + limit
    while not all(map(os.path.exists, paths)) and time.monotonic() < deadline:
        time.sleep(0.01)
    if not all(map(os.path.exists, paths)):
        killed["error"] = f"the gate was not reached by every worker: {[os.path.exists(p) for p in paths]}"
        eng.kill()
        return
    workers = []
    for path in paths:
        with open(path) as f:
            workers.append(json.load(f))
    try:
        killed["probe"] = eng.ask("probe", PROBE)
    except Exception as e:
        killed["probe"] = {"error": repr(e)}
    for w in workers:
        os.kill(w["pid"], signal.SIGKILL)
    eng.kill()
    killed.update(worker_pids=[w["pid"] for w in workers], at_gate=workers, at=time.monotonic())


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
