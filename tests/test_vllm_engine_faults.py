"""Faults and endurance of torchrefit's vLLM backend with a real vLLM CPU engine.

One engine (``tests/vllm_faults_driver.py``, dense Qwen2-shaped model, float32) serves two
2-rank FSDP2 trainer jobs started apart, so that either side can be killed:

* 200 consecutive updates: after each, the engine's weight version and a digest of every
  tensor its worker holds readable equal the trainer's (vLLM's layout computed here);
  greedy tokens and logprobs against a ``transformers`` oracle every 25 updates; the
  resident memory of the engine's process and the trainer ranks stays flat;
* trainer rank 1 killed (SIGKILL) in the middle of an update: the engine's update raises
  a ``TransportError`` naming the trainer rank within the timeout, keeps its previous
  version and generates as the previous weights do; a restarted trainer initializes again
  against the same engine and its next update equals its weights exactly;
* with ``serve_while_staging=True`` (a third trainer job against the same engine): one
  staged update committed, then trainer rank 1 killed in the middle of the next stage
  (after the in-place tensors' stage completed, while the ``load_weights`` tensors move):
  trainer rank 0 raises naming it, the worker keeps it and commits nothing, a later
  ``commit_weights`` is refused, and the engine keeps the committed version exactly (its
  version, the digests of its readable tensors, and tokens and logprobs against a
  ``transformers`` model holding those weights, while the cut update's weights differ) --
  the staged counterpart of the unstaged update's strict xfail below;
* the engine's process killed in the middle of an update: every trainer rank raises
  within the timeout, its parameters and optimizer state untouched.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_runs import VLLM_ENV, drive
from test_vllm_engine import _why_not, assert_fails_oracle, assert_matches_oracle

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "vllm_faults_driver.py"
TIMEOUT = 5.0  # the driver's timeout for both jobs
UPDATES = 200
#: the most either side may wait on a dead peer: the exchange's round, the status gather
#: after it and the wait that names the missing ranks are each bounded by the timeout,
#: plus slack for 2 loaded cores
BOUND = 3 * TIMEOUT + 10
#: resident memory growth allowed over the last 150 updates (after 50 of warm-up), per
#: process: the model is 1.4 MB, moved in ~6 buckets of 256 KiB; keeping one bucket per
#: update grows a process by 37 MiB, one model copy every 10 updates by 21 MiB. Seen: the
#: engine's worker +1.8 MiB, the trainer ranks +4.0 and +5.7 MiB (allocator growth that
#: levels off: +0.02 MiB over the last 50)
RSS_GROWTH_MIB = 16.0
#: a staged update cut by a dead trainer rank: the stage's own wait and the wait naming the
#: missing ranks (twice the timeout from the first live rank's word: ranks reach it up to
#: one timeout apart), then the update's status gather and its naming wait, plus slack
STAGED_BOUND = 5 * TIMEOUT + 10

pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vllm-faults") / "faults.json"
    result, proc = drive(DRIVER, [], out, "vLLM faults", 900, [str(HERE)], VLLM_ENV)
    # the worker's own traceback (vLLM logs it to stdout): its RPC error keeps no class
    result["engine_log"] = proc.stdout + proc.stderr
    return result


def test_consecutive_updates_keep_version_and_checksum(record):
    first = record["first"]
    assert first["versions"] == [f"v{k}" for k in range(1, UPDATES + 1)]
    assert all(bad == [] for bad in first["mismatched"]), [
        (k + 1, bad) for k, bad in enumerate(first["mismatched"]) if bad][:3]
    # the digests cover the tensors vLLM CPU leaves readable: embedding, norms, q/k/v biases
    checked = first["checked_tensors"]
    assert "model.embed_tokens.weight" in checked and "model.norm.weight" in checked, checked
    assert any(n.endswith("qkv_proj.bias") for n in checked), checked
    assert len(first["judged"]) == UPDATES // 25 + 1
    for case in first["judged"]:  # the packed linears, through the oracle
        assert_matches_oracle(case)


def test_consecutive_updates_keep_memory_flat(record):
    rss = record["first"]["rss"]
    assert len(rss) == UPDATES
    warm, last = rss[49], rss[-1]
    assert last["engine"] - warm["engine"] < RSS_GROWTH_MIB, (warm, last)
    for r in range(2):
        assert last["trainers"][r] - warm["trainers"][r] < RSS_GROWTH_MIB, (warm, last)


def test_trainer_killed_mid_update(record):
    case = record["first"]["trainer_killed"]
    engine = case["engine"]  # what the engine's update_weights raised, through the LLM
    assert engine["raised"] is not None, case
    assert "trainer rank 1 died or stopped" in engine["message"], case
    assert ("torchrefit.errors.TransportError: vLLM weight update 201: trainer rank 1 died"
            in record["engine_log"])
    assert engine["seconds"] < BOUND, case
    assert case["raised"] is not None and case["seconds"] < BOUND, case  # trainer rank 0 too
    assert case["weight_version"] == f"v{UPDATES}", case  # the previous version
    # the trainer's own rank 0 names the dead rank too
    assert case["raised"] == "TransportError" and "trainer rank 1" in case["message"], case


@pytest.mark.xfail(strict=True, reason=(
    "an update is applied as it arrives: vLLM's layerwise reload installs each layer once "
    "its tensors are in and the in-place tensors are written directly, so an update cut "
    "short leaves a mix of both versions (the next full update repairs it)"))
def test_trainer_killed_mid_update_leaves_previous_weights(record):
    case = record["first"]["trainer_killed"]
    assert case["mismatched"] == [], case  # readable tensors: the previous weights
    assert_matches_oracle(case["previous"])  # it generates as the previous weights do
    assert_fails_oracle(case["new"])  # and the update's weights differ from them


def test_trainer_killed_mid_stage_keeps_the_committed_version(record):
    committed = record["staged"]["committed"]
    assert committed["weight_version"] == "staged", committed
    assert_matches_oracle(committed)  # the staged update installed exactly
    case = record["staged"]["staged_killed"]
    assert case["raised"] == "TransportError" and "trainer rank 1" in case["message"], case
    assert case["seconds"] < STAGED_BOUND, case
    assert case["commit"] and "nothing staged to commit" in case["commit"], case
    # the engine's side: it installed nothing, and the worker kept the stage's error
    assert case["weight_version"] == "staged", case
    assert case["mismatched"] == [], case  # readable tensors: the committed weights
    assert_matches_oracle(case["previous"])  # it generates as the committed weights do
    assert_fails_oracle(case["new"])  # and the cut update's weights differ from them
    assert case["engine"] and "(staging): trainer rank 1 died or stopped" in case["engine"], case


def test_restarted_trainer_restores_exact_weights(record):
    case = record["second"]["restarted"]
    assert case["weight_version"] == f"v{UPDATES + 2}", case
    assert case["mismatched"] == [], case
    assert_matches_oracle(case)


def test_engine_killed_mid_update(record):
    ranks = record["second"]["engine_killed"]["ranks"]
    assert len(ranks) == 2
    for seen in ranks:
        assert seen["raised"] is not None and seen["seconds"] < BOUND, ranks
        assert seen["params_equal"] and seen["optimizer_equal"], ranks
