"""A ``tr.Fleet`` feeding real vLLM CPU engines that join through vLLM's own API.

``tests/vllm_fleet_driver.py`` (run in a subprocess) is the trainer (a transformers
Qwen2, one gloo rank) and the launcher of two ``vllm.LLM`` engines started with
``worker_extension_cls=torchrefit.engines.vllm_fleet.FleetWorkerExtension``; each engine's
worker joins the fleet through ``collective_rpc("join_fleet")``. The oracle is a
transformers model holding each version's weights, computed in the engine's process
from the same deterministic steps (never from what the fleet moved): vLLM's greedy tokens
and top-5 logprobs must equal its own, and vLLM's dummy weights must fail it.

Checked: versions 1-3 on both engines (one fed by the trainer, the other relayed by it);
at version 4 the relaying engine is SIGKILLed while its install of the version blocks
(a gate in its install, inside ``replica.lock``: a generation asked for then does not
finish, so no step runs on a half-installed version), the trainer's update in flight:
the update returns, its report names the drop, the other engine is exact at version 4;
the killed engine restarted (a new join) is seeded by the survivor to version 4 and
exact there; versions 5-6 on both. Each update's bytes leave the trainer once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_runs import VLLM_ENV, drive
from test_vllm_engine import TOL, _why_not, assert_fails_oracle, assert_matches_oracle

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "vllm_fleet_driver.py"
KILL_AT, LAST = 4, 6

pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vllm-fleet") / "fleet.json"
    result, _ = drive(DRIVER, [], out, "vLLM fleet", 600, [str(HERE)], VLLM_ENV)
    return result


def _checks(r: dict) -> dict[tuple[str, int], dict]:
    return {(c["name"], c["version"]): c for c in r["checks"]}


def test_every_live_engine_equals_the_oracle_at_every_version(run):
    for verdict in run["fair"].values():  # vLLM's dummy weights, before the first version
        assert_fails_oracle(verdict)
    checks = _checks(run)
    first = [n for n in run["engines"] if n != "restart"]
    names = {k: run["engines"][k]["joined"]["name"] for k in first}
    victim, survivor, restart = run["victim"], run["survivor"], run["restart"]
    want = [(n, v) for v in range(1, KILL_AT) for n in names.values()]
    want += [(survivor, KILL_AT), (restart, KILL_AT)]
    want += [(n, v) for v in range(KILL_AT + 1, LAST + 1) for n in (survivor, restart)]
    assert sorted(checks) == sorted(want)
    assert victim in names.values() and victim != survivor
    for (_, v), c in checks.items():
        assert_matches_oracle(c["verdict"])
        # the fleet's version, and the version vLLM's model was given, are the one judged
        assert c["state"]["version"] == v and c["state"]["served"] == v, c
        assert c["state"]["ready"] and not c["state"]["error"], c
    assert max(c["verdict"]["max_logprob_diff"] for c in checks.values()) < TOL


def test_an_engine_killed_mid_install_is_dropped_not_fatal(run):
    assert "update_raised" not in run, run["update_raised"]
    report = next(r for r in run["reports"] if r["version"] == KILL_AT)
    victim, survivor = run["victim"], run["survivor"]
    assert set(report["dropped"]) == {victim}, report["text"]
    assert "stopped beating" in report["dropped"][victim]
    outcome = {x["name"]: x for x in report["replicas"]}
    assert outcome[survivor]["version"] == KILL_AT and not outcome[survivor]["mixed"], report["text"]
    # killed inside its install: its worker had said so, and a step asked for meanwhile
    # waited for the install's lock
    assert run["killed"]["worker_pid"] == run["engines"][_key(run, victim)]["joined"]["pid"]
    assert run["killed"]["probe"] == {"finished": False}, run["killed"]


def test_the_restart_is_seeded_by_its_live_peer(run):
    restart, survivor = run["restart"], run["survivor"]
    seeds = [s for s in run["seeds"] if s[0] == restart]
    assert [s[1:3] for s in seeds] == [[survivor, KILL_AT]], run["seeds"]
    later = [r for r in run["reports"] if r["version"] > KILL_AT]
    assert [r["version"] for r in later] == list(range(KILL_AT + 1, LAST + 1))
    for r in later:
        assert not r["dropped"] and sorted(r["replicas"][i]["name"] for i in range(2)) == sorted(
            [restart, survivor]), r["text"]


def test_each_update_leaves_the_trainer_once(run):
    for r in run["reports"]:
        assert r["trainer_bytes_sent"] == run["model_bytes"], r["text"]
        fed = [x for x in r["replicas"] if not x["dropped"]]
        assert all(x["bytes"] == run["model_bytes"] for x in fed), r["text"]
        if len(fed) == 2:  # one fed by the trainer, the other relayed by it
            assert sorted(x["source"] == "trainer" for x in fed) == [False, True], r["text"]


def test_the_run_is_short(run):
    assert run["seconds"] < 300, run["seconds"]


def _key(run: dict, name: str) -> str:
    return next(k for k, e in run["engines"].items() if e["joined"]["name"] == name)


def test_the_step_guard_holds_the_lock_from_execute_model_to_sample_tokens():
    """Without an engine: a worker whose ``execute_model`` leaves logits for
    ``sample_tokens`` holds the replica's lock until they are sampled; one that returns its
    output at once releases it; an exception releases it; a second ``execute_model``
    before sampling does not deadlock."""
    import threading
    from types import SimpleNamespace

    from torchrefit.engines.vllm_fleet import EngineMember

    lock = threading.Lock()
    seen = []
    runner = SimpleNamespace(execute_model_state=None)

    def execute(defer: bool, fail: bool = False):
        seen.append(("execute", lock.locked()))
        if fail:
            raise ValueError("injected")
        runner.execute_model_state = "logits" if defer else None
        return None if defer else "output"

    def sample():
        seen.append(("sample", lock.locked()))
        runner.execute_model_state = None
        return "sampled"

    worker = SimpleNamespace(execute_model=execute, sample_tokens=sample, model_runner=runner)
    member = EngineMember.__new__(EngineMember)
    member.worker, member.replica, member._stepping = worker, SimpleNamespace(lock=lock), False
    member._guard()
    assert worker.execute_model(True) is None and lock.locked()  # logits wait for sampling
    assert worker.sample_tokens() == "sampled" and not lock.locked()
    assert worker.execute_model(False) == "output" and not lock.locked()
    with pytest.raises(ValueError):
        worker.execute_model(False, fail=True)
    assert not lock.locked()
    worker.execute_model(True)
    again = threading.Thread(target=worker.execute_model, args=(True,), daemon=True)
    again.start()  # no sampling between: still one hold, no deadlock
    again.join(5)
    assert not again.is_alive() and lock.locked()
    worker.sample_tokens()
    assert not lock.locked()
    assert all(held for _, held in seen), seen  # the engine's code always ran under the lock
