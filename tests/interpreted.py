"""Runs a test's Python source in a subprocess under Triton's interpreter
(``TRITON_INTERPRET=1``), where Triton kernels run on CPU tensors: the tests of the
batched copy, FP8 and verify kernels use it on machines without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_interpreted(code: str, env: dict | None = None, timeout: float = 600) -> str:
    """``code``'s standard output; the calling test fails with its stderr's tail when
    it exits non-zero, and skips where Triton is not installed."""
    pytest.importorskip("triton", reason="Triton not installed: the kernel runs only on GPUs with it")
    env = dict(os.environ, TRITON_INTERPRET="1", **(env or {}))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
