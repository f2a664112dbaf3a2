"""Bad-input checks shared by tests: a refit that must fail raises the same
:class:`~torchrefit.RefitError` on every rank, quickly, and writes nothing."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

__all__ = ["attempt_refit", "check_failed_everywhere"]


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {} if model is None else {k: v.clone() for k, v in model.state_dict().items()}


def attempt_refit(src, dst, **kwargs) -> dict:
    """Build a Refitter and refit once on this rank: what it raised (``raised``,
    ``msg``), how long it took (``seconds``) and which destination tensors changed
    (``written``)."""
    from .. import RefitError, Refitter

    before = _snapshot(dst)
    t0 = time.perf_counter()
    try:
        Refitter(src, dst, **kwargs).refit()
        out: dict = {"raised": None}
    except RefitError as e:
        out = {"raised": type(e).__name__, "msg": str(e)}
    out["seconds"] = time.perf_counter() - t0
    after = _snapshot(dst)
    out["written"] = [k for k in before if not torch.equal(before[k], after[k])]
    return out


def check_failed_everywhere(per_rank: Sequence[dict], error: type, text: str,
                            max_seconds: float = 30.0) -> None:
    """Assert every rank's :func:`attempt_refit` result raised ``error`` with ``text``
    in its message within ``max_seconds`` and wrote nothing."""
    for rank, got in enumerate(per_rank):
        assert got["raised"] == error.__name__, f"rank {rank}: raised {got['raised']}: {got.get('msg')}"
        assert text in got["msg"], f"rank {rank}: {got['msg']}"
        assert got["written"] == [], f"rank {rank} wrote {got['written']}"
        assert got["seconds"] < max_seconds, f"rank {rank} took {got['seconds']:.1f} s to raise"
