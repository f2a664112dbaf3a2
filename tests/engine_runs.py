"""Running an engine driver: a script that starts a real engine (vLLM, SGLang) in a
process of its own, runs a scenario against it and writes its record as JSON. Shared by
the engine tests: one engine start serves every test of a scenario."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

#: what every vLLM CPU driver runs with: a small KV cache (the default takes a large share of
#: the machine's memory), and pickled RPC arguments (the drivers pass Python objects)
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def drive(driver: Path, args: list[str], out: Path, what: str, timeout: int, paths: list[str] = (),
          env: dict[str, str] | None = None) -> tuple[dict, subprocess.CompletedProcess]:
    """Run ``driver`` with ``args`` and ``out`` (the record's path) and return the record
    and the finished process; the test fails, with the driver's stderr, where it wrote no
    record or recorded an error. ``paths`` go on PYTHONPATH after the repository's ``src``."""
    pythonpath = [str(HERE.parent / "src"), *paths, os.environ.get("PYTHONPATH", "")]
    full = dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join(pythonpath))
    proc = subprocess.run([sys.executable, str(driver), *args, str(out)], env=full,
                          capture_output=True, text=True, timeout=timeout)
    if not out.exists():
        pytest.fail(f"the {what} driver wrote nothing (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    if "error" in result:
        pytest.fail(f"{what}: {result['error']}\n{proc.stderr[-3000:]}")
    return result, proc


def wait_healthy(url: str, server, what: str, limit: float = 400.0, every: float = 1.0) -> None:
    """Inside a driver: wait until the HTTP server ``server`` (a ``Popen``) that ``what``
    started answers ``url``'s ``/health`` with 200; raises if it exits first or ``limit``
    seconds pass."""
    import time

    import requests

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{what} exited with {server.returncode}")
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(every)
    raise RuntimeError(f"{what} was not healthy within {limit:g} s")
