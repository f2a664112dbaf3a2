"""torchrefit inside SGLang (``torchrefit.engines.sglang``), on real SGLang CPU engines.

Each scenario starts one engine in a subprocess (``tests/sglang_driver.py``): an
in-process ``sglang.Engine`` reached through ``Engine.collective_rpc`` (the scheduler
methods the ``sglang.srt.plugins`` entry point adds), or a ``sglang.launch_server`` HTTP
server reached through ``HTTPClient`` (SGLang's ``/update_weights_from_tensor`` calling
torchrefit's custom weight loader), each wrapped in SGLang's own begin / end of the
weight-update window, ``flush_cache`` and the weight version; it drives it from a 1- or
2-rank gloo trainer and records what it saw; the tests here judge it. The oracle is a
``transformers`` model holding the trainer's weights: SGLang's greedy tokens and top-5
logprobs must equal its own for two successive versions, and the weight version SGLang
reports on each request what was sent. SGLang's dummy weights and a skipped update fail it.

Covered: Qwen2 at engine TP1 from one whole Hugging Face trainer (init errors: a name
map, a shape and a dtype that differ; an exception inside the engine's update; updates
staged while the engine serves); Llama at engine TP1 from one whole Hugging Face trainer
(two versions); Llama at engine TP2 (each TP worker receives its own
shard of the fused ``qkv_proj`` / ``gate_up_proj``) from two trainer ranks: Hugging Face
under FSDP2, megatron-core tensor parallel, torchtitan under FSDP2, then a trainer rank
killed mid-stage; Qwen2 at engine TP2 through the HTTP server from an FSDP2 Hugging Face
trainer (versions, staged updates, the MLP's ``down_proj``, ``lm_head`` and the embeddings
forced through the model's ``load_weights``, an init error).

The engine's environment (the test setup, not the product): SGLang imports
``sgl_kernel``, whose builds are CUDA-only, at start-up, so ``tests/sglang_cpu_stub``
(an import-only stand-in whose every function raises) goes on its ``PYTHONPATH`` where
no real ``sgl_kernel`` is installed;
``SGLANG_USE_CPU_ENGINE=1`` selects SGLang's CPU path.
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from engine_runs import drive

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "sglang_driver.py"
STUB = HERE / "sglang_cpu_stub"
TOL = 1e-4  # float32: SGLang's CPU kernels against transformers'


def _why_not() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (pip install 'torchrefit[sglang]'; see .ci/run for CPU)"
    if not any(e.name == "torchrefit" for e in entry_points(group="sglang.srt.plugins")):
        return ("torchrefit's sglang.srt.plugins entry point is not installed (pip install -e .):"
                " SGLang's scheduler processes find the backend only through it")
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")

_RESULTS: dict[str, dict] = {}


def run(scenario: str, tmp_path_factory) -> dict:
    """The driver's record of one scenario (one engine start, shared by the tests)."""
    if scenario in _RESULTS:
        return _RESULTS[scenario]
    out = tmp_path_factory.mktemp("sglang") / f"{scenario}.json"
    stub = [] if importlib.util.find_spec("sgl_kernel") else [str(STUB)]  # never shadow a real one
    result, _ = drive(DRIVER, [scenario], out, f"SGLang {scenario}", 900, stub, {"SGLANG_USE_CPU_ENGINE": "1"})
    _RESULTS[scenario] = result
    return result


def assert_matches_oracle(case: dict) -> None:
    assert case["tokens_equal"], case
    assert case["max_logprob_diff"] < TOL, case


def assert_fails_oracle(case: dict) -> None:
    assert not case["tokens_equal"] or case["max_logprob_diff"] > 100 * TOL, case


@pytest.mark.parametrize("scenario, prefix", [("qwen2", ""), ("llama", ""), ("llama-tp2", ""),
                                              ("llama-tp2", "titan-"),
                                              ("llama-tp2", "megatron-"),
                                              ("qwen2-http-tp2", "")])
def test_two_versions_equal_the_oracle(scenario, prefix, tmp_path_factory):
    r = run(scenario, tmp_path_factory)
    cases = r["cases"]
    if prefix == "megatron-" and "megatron-version_1" not in cases:
        pytest.skip("megatron-core is not installed (pip install --no-deps megatron-core)")
    if not prefix:
        assert_fails_oracle(r["dummy"])  # SGLang's dummy weights before the first update
    for k in (1, 2):
        case = cases[f"{prefix}version_{k}"]
        assert_matches_oracle(case)
        assert case["weight_version"] == f"{prefix}v{k}", case
    assert_fails_oracle(cases[f"{prefix}skipped_update"])  # the step between versions shows


@pytest.mark.parametrize("scenario", ["qwen2", "llama", "llama-tp2", "qwen2-http-tp2"])
def test_every_weight_is_written_in_place(scenario, tmp_path_factory):
    routes = run(scenario, tmp_path_factory)["routes"]
    assert any(n.endswith("qkv_proj.weight") for n in routes), routes
    assert routes and all(way == "direct" for way, _ in routes.values()), routes


@pytest.mark.parametrize("scenario, prefix, workers", [("qwen2", "", 1), ("llama", "", 1),
                                                       ("llama-tp2", "", 2),
                                                       ("llama-tp2", "titan-", 2),
                                                       ("llama-tp2", "megatron-", 2),
                                                       ("qwen2-http-tp2", "", 2)])
def test_each_rank_sends_only_its_shards(scenario, prefix, workers, tmp_path_factory):
    """Every trainer rank sends its own shards, each byte to the one TP worker that holds
    it: a tensor-parallel engine is sent the model once (plus, per extra worker, the
    tensors every worker holds whole: the norms), not once per worker."""
    r = run(scenario, tmp_path_factory)
    case = r["cases"].get(f"{prefix}version_2")
    if case is None:
        pytest.skip("megatron-core is not installed (pip install --no-deps megatron-core)")
    sent, total = case["bytes_sent"], r["cases"]["version_2"]["model_bytes"]
    assert len(sent) == len(r.get("trainer_exit", [])) + 1, case
    assert all(0 < s < total for s in sent) or len(sent) == 1, case
    assert sum(sent) == total + (workers - 1) * _whole_bytes(), case


def _whole_bytes() -> int:
    """Bytes of the tensors every TP worker holds whole: the driver's model's norms (2
    per layer and the final one, hidden size 128, float32)."""
    layers, hidden = 2, 128
    return (2 * layers + 1) * hidden * 4


def test_forced_tensors_go_through_load_weights(tmp_path_factory):
    """Tensors routed through SGLang's ``load_weights`` (forced here: on this CPU every
    tensor could be written in place) are received whole, Hugging Face-named, and loaded
    by the model inside the same window (at engine TP2, through the HTTP server: each TP
    worker's ``load_weights`` slices its shard of each whole tensor, assembled from both
    trainer ranks' shards): two versions equal the oracle."""
    r = run("qwen2-http-tp2", tmp_path_factory)
    routes, cases = r["lw_routes"], r["cases"]
    loaded = sorted(n for n, (way, _) in routes.items() if way == "load_weights")
    assert loaded == ["lm_head.weight", "model.embed_tokens.weight",
                      "model.layers.0.mlp.down_proj.weight",
                      "model.layers.1.mlp.down_proj.weight"], routes
    assert all("load_weights pattern" in routes[n][1] for n in loaded), routes
    assert routes["model.layers.0.mlp.gate_up_proj.weight"][0] == "direct", routes
    for k in (1, 2):
        case = cases[f"lw-version_{k}"]
        assert_matches_oracle(case)
        assert case["weight_version"] == f"lw-v{k}", case
    assert_fails_oracle(cases["lw-skipped_update"])
    unmatched = cases["lw-unmatched_pattern"]
    assert unmatched["raised"] == "RefitError", unmatched  # the engine's planning, told
    assert "*no_such_tensor*" in unmatched["message"], unmatched


def test_init_errors_name_the_difference(tmp_path_factory):
    cases = run("qwen2", tmp_path_factory)["cases"]
    nm = cases["disagreeing_name_map"]
    assert nm["raised"] == "PlanError" and "same name_map" in nm["message"], nm
    assert "('HfToVllm', 4, 4)" in nm["message"] and "('HfToVllm', 4, 2)" in nm["message"]
    shape = cases["mismatched_shape"]
    assert shape["raised"] == "PlanError", shape
    assert "model.layers.0.mlp.down_proj.weight" in shape["message"], shape
    assert "[128, 192]" in shape["message"] and "[128, 256]" in shape["message"], shape
    dtype = cases["mismatched_dtype"]
    assert dtype["raised"] == "PlanError" and "float16" in dtype["message"], dtype
    assert "float32" in dtype["message"], dtype
    for case in (nm, shape, dtype):
        assert case["seconds"] < 15, case  # at once, not by a timeout


def test_engine_exception_reaches_the_trainer(tmp_path_factory):
    cases = run("qwen2", tmp_path_factory)["cases"]
    case = cases["engine_raises"]
    assert case["raised"] == "RefitError" and case["seconds"] < 15, case
    assert "engine rank 0" in case["message"], case
    assert "begin_weight_update" in case["message"], case
    assert_matches_oracle(case["after"])  # nothing written, the version kept
    assert case["after"]["weight_version"] == "v2", case
    after = cases["after_failure"]
    assert_matches_oracle(after)
    assert after["weight_version"] == "v4", after


@pytest.mark.parametrize("scenario, served", [("qwen2", "v4"), ("qwen2-http-tp2", "v2")])
def test_serve_while_staging(scenario, served, tmp_path_factory):
    """Staged: once every byte is in staging the engine still serves its version
    exactly; after ``commit_weights`` the staged one."""
    cases = run(scenario, tmp_path_factory)["cases"]
    for k in (5, 6):
        case = cases[f"staged_{k}"]
        assert_matches_oracle(case["staged"])
        assert case["staged"]["weight_version"] == served, case
        assert_fails_oracle(case["staged_vs_next"])
        assert_matches_oracle(case["committed"])
        assert case["committed"]["weight_version"] == f"v{k}"
        served = f"v{k}"


def test_killed_trainer_rank_leaves_the_engine_at_its_version(tmp_path_factory):
    r = run("llama-tp2", tmp_path_factory)
    case = r["cases"]["killed_rank"]
    assert case["raised"] in ("TransportError", "RefitError"), case
    # the link's timeout is 10 s: the kill is seen at once, then the live ranks wait up to
    # twice the timeout for one another's word, so that a live rank is never named dead
    assert case["seconds"] < 2 * 10 + 3, case
    assert "trainer rank 1 died or stopped" in case["message"], case
    assert case["commit_raised"] == "RefitError", case
    assert_matches_oracle(case)  # the version staged before the kill, still served
    assert case["weight_version"] == "before-kill", case
    assert r["trainer_exit"] == [3], r


def test_http_server(tmp_path_factory):
    """Through ``sglang.launch_server`` (``--custom-weight-loader`` torchrefit's) and
    :class:`~torchrefit.engines.sglang_http.HTTPClient` (the versions, the staged updates
    and the shards above are its too): the version reported apart from any request
    (``/model_info``) is the one sent; an init error reaches both trainer ranks at once,
    and the server serves on."""
    r = run("qwen2-http-tp2", tmp_path_factory)
    cases = r["cases"]
    for case in [cases["version_1"], cases["version_2"], cases["staged_5"]["committed"],
                 cases["staged_6"]["staged"], cases["staged_6"]["committed"]]:
        assert case["model_info_version"] == case["weight_version"], case
    shape = cases["mismatched_shape"]
    assert [seen["raised"] for seen in shape["ranks"]] == ["PlanError"] * 2, shape
    assert "model.layers.0.mlp.down_proj.weight" in shape["message"], shape
    assert all(seen["seconds"] < 15 for seen in shape["ranks"]), shape
