"""``torchrefit bench`` on CPU: it runs, verifies, and writes the JSON keys the
benchmark tables rely on (median, floor and ratio, first refit, peak memory), for the plain and
shared-storage variants; its table names its columns plainly and leaves out what a CPU
run cannot have (the CUDA-graph variant, host-time and megatron-core columns).
``--watch manual`` reaches the bench's config and Refitter, and rows record it; a
``BenchConfig``'s settings reach the spawned rank processes, and rows record them. ``--stage`` adds
a row with the plain refit's, the stage's and the commit's times. The wait
that ends each timed call is torch's C synchronize where the device is current."""

import json

import pytest
import torch

from torchrefit.cli import main


def test_bench_writes_the_figures(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--layers", "1", "--hidden", "64", "--heads", "4", "--ffn", "128",
                 "--vocab", "256", "--warmup", "1", "--iters", "2", "--variant", "plain",
                 "--variant", "share", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["configs"]
    assert [r["variant"] for r in rows] == ["plain", "share"]
    assert [r["watch"] for r in rows] == ["every", "every"]
    for r in rows:
        for key in ("median_ms", "floor_ms", "ratio_to_floor", "first_refit_s", "peak_extra_bytes"):
            assert r[key] is not None, key
        assert r["bytes_local"] > 0 and r["bytes_remote"] == 0
    assert rows[0]["shared_tensors"] == 0 < rows[1]["shared_tensors"]
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("impl"))
    assert header.split()[:8] == ["impl", "variant", "transport", "watch", "local", "remote", "median", "ms"]
    assert "floor ms" in header and "vs floor" in header
    assert "vs mcore" not in header and "host ms" not in header and "x floor" not in header


def test_bench_watch_manual_reaches_the_refitter(tmp_path, capsys, monkeypatch) -> None:
    """``--watch manual``: in the config, in the Refitter (the row reads it back from the
    Refitter), in the JSON and in the printed table; a bad value is refused by argparse."""
    import torchrefit.bench as bench

    seen = []
    real = bench.run_bench
    monkeypatch.setattr(bench, "run_bench", lambda cfg: seen.append(cfg.watch) or real(cfg))
    out = tmp_path / "watch.json"
    assert main(["bench", "--layers", "1", "--hidden", "64", "--heads", "4", "--ffn", "128",
                 "--vocab", "256", "--warmup", "1", "--iters", "2", "--variant", "plain",
                 "--watch", "manual", "--json", str(out)]) == 0
    assert seen == ["manual"]
    (row,) = json.loads(out.read_text())["configs"]
    assert row["watch"] == "manual" and row["median_ms"] is not None
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("impl"))
    cells = next(line for line in lines if line.startswith("torchrefit")).split()
    assert cells[header.split().index("watch")] == "manual"
    with pytest.raises(SystemExit):
        main(["bench", "--watch", "sometimes"])
    from torchrefit.bench import BenchConfig
    from torchrefit.testing import ModelSpec

    with pytest.raises(ValueError, match="'sometimes'"):
        BenchConfig(spec=ModelSpec(layers=1), watch="sometimes")


def test_bench_settings_reach_the_rank_processes() -> None:
    from torchrefit import settings
    from torchrefit.bench import BenchConfig, run_bench
    from torchrefit.testing import ModelSpec

    spec = ModelSpec(layers=1, hidden=64, heads=4, groups=2, ffn=128, vocab=256, dtype=torch.float32)
    with settings.overridden(batched_copy="all", branches=3):
        cfg = BenchConfig(spec=spec, warmup=1, iters=2, settings=settings.current())
    (row,) = run_bench(cfg)
    assert row["settings"]["batched_copy"] == "all" and row["settings"]["branches"] == 3
    (plain,) = run_bench(BenchConfig(spec=spec, warmup=1, iters=2))
    assert plain["settings"]["batched_copy"] == "auto" and plain["settings"]["branches"] == 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU defaults")
def test_bench_on_cpu_offers_no_cuda_graph(capsys) -> None:
    from torchrefit.cli.bench import _variants

    assert _variants(None) == ("plain",)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["bench", "--variant", "graph", "--layers", "1", "--hidden", "64"])


def test_shape_presets_are_one_table_for_plan_and_bench() -> None:
    """Every preset ``bench`` can build gives the toy model the same tensors and
    parameter count ``plan`` simulates (gpt-4b aside: toy models have no learned
    positions or norm biases); MLA and mixed dense/MoE presets are refused by name."""
    import math

    import pytest

    from torchrefit.bench.config import spec_from_preset
    from torchrefit.cli.bench import _toy_presets
    from torchrefit.simulate.shapes import PRESETS, global_tensors
    from torchrefit.testing.toy import global_table

    names = _toy_presets()
    assert {"llama-8b", "dense-0.5b", "qwen3-30b-a3b", "deepseek-v3-moe"} <= set(names)
    for name in names:
        if name == "gpt-4b":
            continue
        sim = global_tensors(PRESETS[name].with_overrides(layers=2))
        toy = global_table(spec_from_preset(name, layers=2))
        params = sum(math.prod(t.shape) for t in sim if not t.buffer)
        assert params == sum(math.prod(d.shape) for d in toy.values() if not d.buffer), name
    assert PRESETS["qwen3-30b-a3b"].experts == 128 and PRESETS["deepseek-v3-moe"].expert_ffn == 2048
    with pytest.raises(ValueError, match="deepseek-v3"):
        spec_from_preset("deepseek-v3")


def test_bench_map_hf_fp8_quantizes_and_reports_its_floor(tmp_path) -> None:
    """``--map hf --fp8``: Megatron names into a whole Hugging Face-named engine whose
    projections and stacked experts are block FP8; verified, floor from the bytes read
    and written."""
    out = tmp_path / "fp8.json"
    assert main(["bench", "--layers", "1", "--hidden", "256", "--heads", "4", "--ffn", "256",
                 "--vocab", "512", "--experts", "2", "--expert-ffn", "128", "--warmup", "1",
                 "--iters", "2", "--variant", "plain", "--map", "hf", "--fp8",
                 "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["configs"]
    # q, k, v, o of one layer and its two stacked expert tensors, one byte an element:
    # q / k / v are 64-row strips of the fused QKV, which 128-row blocks straddle (quantized
    # on receipt); o and the experts are whole blocks of one piece (from the source)
    h = 256
    assert row["fp8_on_receiver"] == 3 * h * h and row["fp8_on_sender"] > h * h
    assert row["fp8"] and row["name_map"] == "hf"
    assert row["floor_ms"] > 0 and row["floor_note"].startswith("HBM floor: source bytes read")
    read = row["bytes_local"] + row["bytes_quantize_read"]
    assert row["floor_ms"] == pytest.approx((read + row["dst_bytes"]) / row["copy_bandwidth_gbs"] / 1e6)
    assert row["dst_bytes"] < read  # FP8 engine smaller than the bf16 source


def test_bench_moves_bytes_between_ranks(tmp_path) -> None:
    """Two processes, TP2 -> TP1: the figures include bytes that crossed between ranks."""
    out = tmp_path / "bench2.json"
    assert main(["bench", "--layers", "1", "--hidden", "64", "--heads", "4", "--ffn", "128",
                 "--vocab", "256", "--warmup", "1", "--iters", "2", "--variant", "plain",
                 "--nproc", "2", "--src", "tp2", "--dst", "tp1", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["configs"][0]
    assert row["bytes_remote"] > 0 and row["median_ms"] is not None, row


def test_the_bench_waits_for_its_own_device_with_torchs_c_call(monkeypatch) -> None:
    """The wait that ends each timed call (``bench.timing._sync``): torch's C synchronize
    where the device is the current one, ``torch.cuda.synchronize(device)`` (which switches
    devices) where it is not, nothing for CPU tensors. CUDA faked: only who is called."""
    from torchrefit.bench import timing

    calls: list[str] = []
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_synchronize", lambda: calls.append("c"), raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(f"torch {device}"))
    for device in ("cuda:0", "cuda:1", "cpu"):
        timing._sync(torch.device(device))
    assert calls == ["c", "torch cuda:1"], calls


def test_bench_stage_times_refit_stage_and_commit(tmp_path, capsys) -> None:
    """``--stage``: one more row, timed on one Refitter in the same run, with the plain
    refit's, the stage's and the commit's figures; every destination byte committed."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--stage", "--nproc", "2", "--mode", "non-collocated", "--transport", "gloo",
                 "--layers", "1", "--hidden", "64", "--heads", "4", "--ffn", "128", "--vocab", "256",
                 "--warmup", "1", "--iters", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["configs"]
    assert [r["variant"] for r in rows] == ["plain", "stage (device)"]
    staged = rows[1]
    for key in ("refit_ms", "stage_ms", "commit_ms", "refit_over_commit"):
        assert staged[key] > 0, key
    assert staged["commit_to_floor"] is None  # a GPU's figure
    # every byte of the engine crosses gloo into staging, and all of it is committed
    assert staged["commit_bytes"] == staged["staged_bytes"] == staged["bytes_remote"] > 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("impl"))
    assert "stage ms" in header and "commit ms" in header and "refit/commit" in header
    assert "commit/floor" not in header
