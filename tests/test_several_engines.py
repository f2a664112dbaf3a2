"""Several engines of different layouts, on disjoint ranks, refit from one trainer in one
``refit()`` (8 real CPU processes, gloo).

A Megatron-style TP2 trainer (ranks 0-1) feeds a TP2 x PP2 engine (ranks 2-5) and a
TP1 x DP2 engine (ranks 6-7) through one Refitter. Checks every engine rank against
the toy's oracle (plain torch cuts of the global values) after two refits, that
construction gathers metadata once (one roster gather plus the small agreement
gather, as for a single engine), and that both engines carry the version.
"""

from __future__ import annotations

import torch

import torchrefit as tr
import torchrefit.refitter as refitter_module
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local, run_world

SPEC = ModelSpec(layers=2)
TRAINER = Mesh(tp=2, ranks=2)
ENGINE_A = Mesh(tp=2, pp=2, ranks=4, offset=2)
ENGINE_B = Mesh(tp=1, ranks=2, offset=6)


def _engine_mesh(rank: int) -> Mesh | None:
    return ENGINE_A if 2 <= rank < 6 else ENGINE_B if rank >= 6 else None


def _set(model, mesh: Mesh, rank: int, seed: int) -> None:
    want = expected_local(SPEC, mesh, rank, seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(want[name])


def _several(rank: int, world: int) -> dict:
    gathers: list[str] = []

    def counting(name):
        inner = getattr(refitter_module, name)

        def wrapped(*args, **kwargs):
            gathers.append(name)
            return inner(*args, **kwargs)
        setattr(refitter_module, name, wrapped)

    counting("all_gather_rosters")
    counting("all_gather_pickled")
    src = build_toy(SPEC, TRAINER, rank, 0)
    mesh = _engine_mesh(rank)
    dst = build_toy(SPEC, mesh, rank, 99) if mesh is not None else None
    r = tr.Refitter(src, dst)
    out = {"gathers_at_construction": list(gathers)}
    for seed in (1, 2):
        if src is not None:
            _set(src, TRAINER, rank, seed)
        report = r.refit()
        if dst is not None:
            want = expected_local(SPEC, mesh, rank, seed)
            got = dst.state_dict()
            out[f"ok{seed}"] = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    out["gathers_total"] = len(gathers)
    out["version"] = tr.weight_version(dst) if dst is not None else report.version
    out["received"] = report.bytes_received
    return out


def test_two_engines_one_refit() -> None:
    got = run_world(_several, 8, timeout=300)
    for rank, g in enumerate(got):
        # every rank's rosters (both engines') in one gather, then the agreement tuple
        assert g["gathers_at_construction"] == ["all_gather_rosters", "all_gather_pickled"], g
        assert g["gathers_total"] == 2, g  # refits gather nothing
        assert g["version"] == 2
        if rank >= 2:
            assert g["ok1"] and g["ok2"], (rank, g)
            assert g["received"] > 0
