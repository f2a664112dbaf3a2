"""A ``tr.Fleet`` feeding real vLLM CPU engines that join through vLLM's own API.

``tests/vllm_fleet_driver.py`` (run in a subprocess) is the trainer (a transformers
Qwen2, one gloo rank) and the launcher of two ``vllm.LLM`` engines started with
``worker_extension_cls=torchrefit.engines.vllm_fleet.FleetWorkerExtension``: engine ``a``
at tensor parallel 2 (its two workers one replica of two ranks, each holding its
shards; a vocabulary of 250 that vLLM pads to 256 before cutting it), ``b`` at TP1; each
engine's workers join the fleet through ``collective_rpc("join_fleet")``. The oracle is a transformers model holding each
version's weights, computed in the engine's process from the same deterministic steps
(never from what the fleet moved): vLLM's greedy tokens and top-5 logprobs must equal
its own, and vLLM's dummy weights must fail it.

Checked: versions 1-3 on both engines (one fed by the trainer, the other relayed by it);
at version 4 the engine the trainer feeds is SIGKILLed while its install of the version
blocks (a gate in its install, inside ``replica.lock``: a generation asked for then does
not finish, so no step runs on a half-installed version), the trainer's update in
flight: the update returns, its report names the drop, the other engine is exact at
version 4; the killed engine restarted (a new join) is seeded by the survivor to version
4 and exact there. At version 5 the other engine is SIGKILLed while it receives (its
workers blocked between two parts of the update, nothing installed: it still serves
version 4; being the earlier join it is the one the trainer feeds): the update returns
and names it, the restarted engine, cut off behind it, is fed in a second round and is
exact at version 5, and the killed one restarted is seeded by it. Version 6 on both. Each update's bytes
leave the trainer once: one replica's layout (a TP2 engine's ranks each receive their
shards and the tensors TP leaves whole).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_runs import VLLM_ENV, drive
from test_vllm_engine import TOL, _why_not, assert_fails_oracle, assert_matches_oracle

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "vllm_fleet_driver.py"
KILL_AT, KILL_RECEIVING_AT, LAST = 4, 5, 6
TP = {"a": 2, "b": 1}

pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vllm-fleet") / "fleet.json"
    result, _ = drive(DRIVER, [], out, "vLLM fleet", 900, [str(HERE)], VLLM_ENV)
    return result


def _checks(r: dict) -> dict[tuple[str, int], dict]:
    return {(c["name"], c["version"]): c for c in r["checks"]}


def _names(run: dict) -> dict[str, list[str]]:
    """Each engine's names, one per start (``a``, ``b``)."""
    out: dict[str, list[str]] = {}
    for e in run["engines"].values():
        out.setdefault(e["joined"]["name"].rsplit("-", 1)[0], []).append(e["joined"]["name"])
    return out


def _layout_bytes(run: dict) -> dict[str, int]:
    """Per replica name: the bytes its ranks hold together (its mirrors)."""
    return {e["joined"]["name"]: sum(w["mirror_bytes"] for w in e["workers"])
            for e in run["engines"].values()}


def test_every_live_engine_equals_the_oracle_at_every_version(run):
    for verdict in run["fair"].values():  # vLLM's dummy weights, before the first version
        assert_fails_oracle(verdict)
    checks = _checks(run)
    victim, survivor, restart = run["victim"], run["survivor"], run["restart"]
    victim2, restart2 = run["victim2"], run["restart2"]
    assert victim2 == survivor and {victim, survivor} == {e[0] for e in _names(run).values()}
    want = [(n, v) for v in range(1, KILL_AT) for n in (victim, survivor)]
    want += [(survivor, KILL_AT), (restart, KILL_AT), (restart, KILL_RECEIVING_AT),
             (restart2, KILL_RECEIVING_AT)]
    want += [(n, v) for v in range(KILL_RECEIVING_AT + 1, LAST + 1) for n in (restart, restart2)]
    assert sorted(checks) == sorted(want)
    for (_, v), c in checks.items():
        assert_matches_oracle(c["verdict"])
        # the fleet's version, and the version vLLM's model was given, are the one judged,
        # on every worker of the engine
        for w in c["workers"]:
            assert w["version"] == v and w["served"] == v, c
            assert w["ready"] and not w["error"] and w["name"] == c["state"]["name"], c
    assert max(c["verdict"]["max_logprob_diff"] for c in checks.values()) < TOL


def test_a_tp2_engine_is_one_replica_of_two_ranks_each_holding_its_shards(run):
    model = run["model_bytes"]
    for key, names in _names(run).items():
        for e in run["engines"].values():
            if e["joined"]["name"] not in names:
                continue
            workers = e["workers"]
            assert [(w["rank"], w["world"], w["tp"]) for w in workers] == [
                (r, TP[key], [r, TP[key]]) for r in range(TP[key])], workers
            assert len({w["name"] for w in workers}) == 1, workers
            if TP[key] == 1:
                assert workers[0]["mirror_bytes"] == model
            else:  # each rank a shard (the norms whole on both), about half the model
                held = [w["mirror_bytes"] for w in workers]
                assert model < sum(held) < 1.01 * model and max(held) < 0.6 * model, workers


def test_an_engine_killed_mid_install_is_dropped_not_fatal(run):
    assert "update_raised" not in run, run["update_raised"]
    report = next(r for r in run["reports"] if r["version"] == KILL_AT)
    victim, survivor = run["victim"], run["survivor"]
    assert set(report["dropped"]) == {victim}, report["text"]
    assert "stopped beating" in report["dropped"][victim]
    outcome = {x["name"]: x for x in report["replicas"]}
    assert outcome[survivor]["version"] == KILL_AT and not outcome[survivor]["mixed"], report["text"]
    # killed inside its install: each of its workers had said so, and a step asked for
    # meanwhile waited for the install's lock
    killed = run["killed"]
    engine = run["engines"][_key(run, victim)]
    assert killed["worker_pids"] == [w["pid"] for w in engine["workers"]], killed
    assert all(w["version"] == KILL_AT for w in killed["at_gate"]), killed
    assert killed["probe"] == {"finished": False}, killed


def test_an_engine_killed_while_receiving_is_dropped_not_fatal(run):
    report = next(r for r in run["reports"] if r["version"] == KILL_RECEIVING_AT)
    victim, peer = run["victim2"], run["restart"]
    assert set(report["dropped"]) == {victim}, report["text"]
    outcome = {x["name"]: x for x in report["replicas"]}
    assert outcome[peer]["version"] == KILL_RECEIVING_AT and not outcome[peer]["mixed"], report["text"]
    # the victim, the earlier join, was the one the trainer fed: its peer, cut off behind
    # it, was fed by the trainer in the update's next round
    assert report["rounds"] == 2 and outcome[peer]["source"] == "trainer", report["text"]
    # killed between two parts of the update: every worker held the previous version, in
    # the fleet and in vLLM, and the engine still served (no lock held while receiving)
    killed = run["killed2"]
    engine = run["engines"][_key(run, victim)]
    assert killed["worker_pids"] == [w["pid"] for w in engine["workers"]], killed
    assert all(w["version"] == w["served"] == KILL_AT for w in killed["at_gate"]), killed
    assert killed["probe"] == {"finished": True}, killed
    # no rank hung: the update ended within the drop's bounds
    assert killed["update_seconds"] < 30, (killed, report["text"])


def test_each_restart_is_seeded_by_its_live_peer(run):
    restart, survivor, restart2 = run["restart"], run["survivor"], run["restart2"]
    assert [s[:3] for s in run["seeds"]] == [[restart, survivor, KILL_AT],
                                              [restart2, restart, KILL_RECEIVING_AT]], run["seeds"]
    later = [r for r in run["reports"] if r["version"] > KILL_RECEIVING_AT]
    assert [r["version"] for r in later] == list(range(KILL_RECEIVING_AT + 1, LAST + 1))
    for r in later:
        assert not r["dropped"] and sorted(x["name"] for x in r["replicas"]) == sorted(
            [restart, restart2]), r["text"]


def test_each_update_leaves_the_trainer_once(run):
    held = _layout_bytes(run)
    victim, survivor, victim2, peer = run["victim"], run["survivor"], run["victim2"], run["restart"]
    for r in run["reports"]:
        out = {x["name"]: x for x in r["replicas"]}
        fed = [x for x in r["replicas"] if not x["dropped"]]
        assert all(x["bytes"] == held[x["name"]] for x in fed), r["text"]
        if r["version"] == KILL_AT:  # the trainer fed the victim, which relayed it all before its install
            assert out[survivor]["source"] == victim, r["text"]
            assert r["trainer_bytes_sent"] == held[victim], r["text"]
        elif r["version"] == KILL_RECEIVING_AT:  # its victim may have been fed first: cut, then its peer
            assert r["trainer_bytes_sent"] < held[victim2] + held[peer], r["text"]
        else:  # one fed by the trainer, the other relayed by it
            first = [x for x in fed if x["source"] == "trainer"]
            assert len(first) == 1 and len(fed) == 2, r["text"]
            assert r["trainer_bytes_sent"] == held[first[0]["name"]], r["text"]


def test_the_run_is_short(run):
    assert run["seconds"] < 600, run["seconds"]


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


def test_an_install_holds_every_ranks_lock_at_once_without_deadlocking_a_step():
    """Without an engine: two ranks in lockstep. Rank 1 runs a step under its lock and
    waits inside it for rank 0's half (a collective); rank 0's install has taken rank 0's
    lock first, so rank 0's half waits for it. ``hold_every_rank`` lets go until both
    ranks hold their locks at one moment: the step finishes on both ranks with the old
    version, then both install, and a rank's install never runs while a peer's step does."""
    import threading
    import time

    import torch.distributed as dist

    from torchrefit.engines.vllm_fleet import hold_every_rank
    from torchrefit.fleet.board import Board

    store = dist.HashStore()
    locks = [threading.Lock(), threading.Lock()]
    collective = threading.Event()
    seen: list[tuple[str, ...]] = []

    def step(rank: int) -> None:
        with locks[rank]:
            seen.append(("step", str(rank)))
            if rank == 0:
                collective.set()
            elif not collective.wait(20):
                seen.append(("step hung", str(rank)))

    both = threading.Barrier(2, timeout=10)

    def install(rank: int) -> None:
        hold_every_rank(locks[rank], Board(store), "install/v1", 2, timeout=30.0, patience=0.1)
        try:
            both.wait()  # the two installs at one moment, each rank holding its lock
            seen.append(("install", str(rank), str(all(lk.locked() for lk in locks))))
            both.wait()
        finally:
            locks[rank].release()

    locks[0].acquire()  # rank 0's install holds its lock; rank 1's step begins
    peer_step = threading.Thread(target=step, args=(1,))
    peer_step.start()
    time.sleep(0.1)
    locks[0].release()
    threads = [threading.Thread(target=install, args=(0,)), threading.Thread(target=step, args=(0,)),
               threading.Thread(target=install, args=(1,))]
    for t in threads:
        t.start()
    for t in [peer_step, *threads]:
        t.join(30)
    assert not any(t.is_alive() for t in [peer_step, *threads]), seen
    assert ("step hung", "1") not in seen, seen
    assert sorted(e for e in seen if e[0] == "install") == [("install", "0", "True"),
                                                              ("install", "1", "True")], seen


def test_installs_leave_two_store_keys_per_engine():
    """Three ranks hold every rank's lock for 6 versions in a row, each attempt's first
    rank slow enough at times that attempts fail: each version's deciding rank deletes the
    previous version's keys and its own failed attempts', so the store ends with the last
    version's two keys, however many attempts there were."""
    import random
    import threading
    import time

    import torch.distributed as dist

    from torchrefit.engines.vllm_fleet import hold_every_rank
    from torchrefit.fleet.board import Board

    store = dist.HashStore()
    locks = [threading.Lock() for _ in range(3)]
    words: list[list[str]] = [[], [], []]
    rng = random.Random(5)
    delays = [[rng.choice([0.0, 0.0, 0.08]) for _ in range(6)] for _ in range(3)]

    def rank(r: int) -> None:
        held = ""
        for v in range(6):
            time.sleep(delays[r][v])  # a rank late to some versions: its peers' attempts fail
            held = hold_every_rank(locks[r], Board(store), f"install/{v}", 3, timeout=30.0, patience=0.03,
                                   previous=held)
            words[r].append(held)
            locks[r].release()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert words[0] == words[1] == words[2]  # every rank held at the same attempt of each version
    attempts = sum(int(w.rsplit("/", 1)[1]) + 1 for w in words[0])
    assert attempts > 6, words[0]  # some attempts failed
    assert store.num_keys() == 2, (store.num_keys(), attempts, words[0])
    last = Board(store)
    assert last.get(f"{words[0][-1]}/all") is True and last.get(f"{words[0][-1]}/held") == 3


def test_an_install_of_a_rank_whose_peer_is_gone_gives_up():
    import threading

    import torch.distributed as dist

    from torchrefit.engines.vllm_fleet import hold_every_rank
    from torchrefit.fleet.board import Board

    lock = threading.Lock()
    with pytest.raises(TimeoutError, match="2 ranks could pause its steps within 0.5 s"):
        hold_every_rank(lock, Board(dist.HashStore()), "install/v1", 2, timeout=0.5, patience=0.05)
    assert not lock.locked()
