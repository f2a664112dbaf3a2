"""Weight versions on 2 real CPU processes (gloo): what ``refit(version=...)`` stamps.

Covers version 0 stamped as given (report, ``r.version``, ``tr.weight_version``);
negative, bool, float and string versions rejected with ``ValueError`` / ``TypeError``
on every rank before any byte moves, the Refitter still usable after; the counter
going on from an explicit version; and a refit whose verification fails
(``verify="every"``): it raises ``VerificationError`` on every rank, its bytes were
written, and both ``r.version`` and ``tr.weight_version`` stay at the previous version
until a refit that verifies.
"""

from __future__ import annotations

import torch
from torch import nn

import torchrefit as tr
from torchrefit.testing import run_world

BAD = {"negative": (-1, "ValueError"), "bool": (True, "TypeError"), "float": (2.0, "TypeError"),
       "string": ("3", "TypeError")}


class _Model(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.full((4, 6), value))
        self.b = nn.Parameter(torch.full((6,), value))


def _stamps(r, dst) -> tuple:
    return r.version, tr.weight_version(dst)


def _versions(rank: int, world: int) -> dict:
    out = {}
    src, dst = _Model(1.0), _Model(0.0)
    r = tr.Refitter(src, dst, timeout=20)
    out["zero"] = (r.refit(version=0).version, *_stamps(r, dst))
    out["zero_written"] = torch.equal(dst.a, src.a)
    with torch.no_grad():
        src.a.fill_(5.0)
    for name, (version, _) in BAD.items():
        try:
            r.refit(version=version)
            out[name] = None
        except (TypeError, ValueError) as e:
            out[name] = (type(e).__name__, str(e))
        out[name + "_after"] = (*_stamps(r, dst), bool((dst.a == 1.0).all()))
    out["next"] = (r.refit().version, *_stamps(r, dst), bool((dst.a == 5.0).all()))
    out["explicit"] = r.refit(version=7).version
    out["after_explicit"] = r.refit().version
    return out


def test_versions_zero_and_bad() -> None:
    for rank, got in enumerate(run_world(_versions, 2, timeout=120, pg_timeout=30)):
        assert got["zero"] == (0, 0, 0) and got["zero_written"], (rank, got["zero"])
        for name, (version, error) in BAD.items():
            assert got[name] is not None, f"rank {rank}: refit(version={version!r}) did not raise"
            assert got[name][0] == error and "int >= 0" in got[name][1], (rank, got[name])
            assert got[name + "_after"] == (0, 0, True), f"rank {rank} {name}: {got[name + '_after']}"
        assert got["next"] == (1, 1, 1, True), (rank, got["next"])
        assert (got["explicit"], got["after_explicit"]) == (7, 8)


def _failed_verification(rank: int, world: int) -> dict:
    out = {}
    # rank 0 trains, rank 1 serves: every byte crosses the transport
    src = _Model(1.0) if rank == 0 else None
    dst = _Model(0.0) if rank == 1 else None
    r = tr.Refitter(src, dst, verify="every", timeout=20)
    out["first"] = (r.refit(version=3).version, *_stamps(r, dst))
    program = r._program
    run = program.run

    def corrupted(*args):  # the transfer lands one wrong element on the engine
        stats = run(*args)
        if dst is not None:
            with torch.no_grad():
                dst.b[2] += 1.0
        return stats

    program.run = corrupted
    if src is not None:
        with torch.no_grad():
            src.a.fill_(2.0)
    try:
        r.refit()
        out["raised"] = None
    except tr.VerificationError as e:
        out["raised"] = str(e)
    out["after"] = _stamps(r, dst)
    out["written"] = bool((dst.a == 2.0).all()) if dst is not None else None
    program.run = run
    out["retry"] = (r.refit().version, *_stamps(r, dst))
    return out


def test_failed_verification_leaves_the_previous_version() -> None:
    for rank, got in enumerate(run_world(_failed_verification, 2, timeout=120, pg_timeout=30)):
        want = 3 if rank == 1 else None  # only the engine rank holds a model to stamp
        assert got["first"] == (3, 3, want), (rank, got["first"])
        assert got["raised"] is not None and "b" in got["raised"], (rank, got["raised"])
        assert got["after"] == (3, want), f"rank {rank}: a failed verification stamped {got['after']}"
        assert got["written"] in ((None,) if rank == 0 else (True,)), rank
        assert got["retry"] == (4, 4, 4 if rank == 1 else None), (rank, got["retry"])
