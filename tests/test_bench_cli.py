"""``torchrefit bench`` on CPU: it runs, verifies, and writes the JSON keys BENCHMARKS.md
and issue 5 rely on (median, floor and ratio, first refit, peak memory), for the plain and
shared-storage variants."""

import json

from torchrefit.cli import main


def test_bench_writes_the_figures(tmp_path) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--layers", "1", "--hidden", "64", "--heads", "4", "--ffn", "128",
                 "--vocab", "256", "--warmup", "1", "--iters", "2", "--variant", "plain",
                 "--variant", "share", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["configs"]
    assert [r["variant"] for r in rows] == ["plain", "share"]
    for r in rows:
        for key in ("median_ms", "floor_ms", "ratio_to_floor", "first_refit_s", "peak_extra_bytes"):
            assert r[key] is not None, key
        assert r["bytes_local"] > 0 and r["bytes_remote"] == 0
    assert rows[0]["shared_tensors"] == 0 < rows[1]["shared_tensors"]
