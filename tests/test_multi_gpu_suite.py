"""``benchmarks/multi_gpu_suite.sh`` cannot rot: its CPU mode runs here on every change.

* ``bash benchmarks/multi_gpu_suite.sh 2 --cpu``: every layout of the suite for 2
  processes over gloo, each run verified (``verify()``) before it reports; exit 0, one
  JSON summary per run with the layout, the transport and 2 processes;
* ``... 8 --dry-run`` (the GPU mode's commands, printed): every transport (nccl, gloo,
  ipc, nvshmem, nixl) on every layout of 8 GPUs, and the GPU tests it runs exist;
* a failing step makes the script exit non-zero (a bench of a transport that does not
  exist).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUITE = ROOT / "benchmarks" / "multi_gpu_suite.sh"


def _suite(*args: str, out: pathlib.Path, env: dict | None = None, timeout: float = 900):
    return subprocess.run(["bash", str(SUITE), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OUT": str(out), **(env or {})}, cwd=ROOT)


def test_cpu_mode_runs_every_layout_over_gloo(tmp_path: pathlib.Path) -> None:
    done = _suite("2", "--cpu", out=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "=== 0 step(s) failed" in done.stdout
    rows = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert sorted(rows) == ["cpu2_tp1_tp2_gloo.json", "cpu2_tp2_tp1_gloo.json"], sorted(rows)
    for name, got in rows.items():
        text = json.dumps(got)
        assert '"gloo"' in text and re.search(r'"world": 2\b', text), (name, text[:500])


def test_gpu_mode_plans_every_transport_and_existing_tests(tmp_path: pathlib.Path) -> None:
    done = _suite("8", "--dry-run", out=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    for t in ("nccl", "gloo", "ipc", "nvshmem", "nixl"):
        for layout in ("tp2_tp1", "tp1_tp2", "tp2pp2_tp4", "noncolloc_tp2_tp2", "tp8_tp4dp2"):
            assert f"gpu8_{layout}_{t}.json" in done.stdout, (t, layout)
    tests = re.findall(r"tests/\S+\.py", done.stdout)
    assert tests and all((ROOT / t).exists() for t in tests), tests


def test_a_failing_step_fails_the_suite(tmp_path: pathlib.Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\nexit 3\n")  # every step fails at once
    (fake / "python3").chmod(0o755)
    done = _suite("2", "--cpu", out=tmp_path, env={"PATH": f"{fake}:{os.environ['PATH']}"}, timeout=120)
    assert done.returncode == 2 and "=== 2 step(s) failed" in done.stdout, done.stdout
