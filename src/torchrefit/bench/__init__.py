"""Benchmarks of refits: configurations, timing against the physical floor, runners.

``torchrefit bench`` is the command line over :func:`run_bench`; the scripts under
``benchmarks/`` call it for the tables of ``BENCHMARKS.md``.
"""

from .config import BenchConfig, spec_from_preset
from .runner import run_bench

__all__ = ["BenchConfig", "spec_from_preset", "run_bench"]
