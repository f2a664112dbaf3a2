"""The predicted refit time (``torchrefit.simulate.predict``, ``torchrefit plan --net-gbs``).

A hand-made traffic on 2 nodes of 2 GPUs whose terms are worked out by hand (send,
receive, link and copy each set the time in one variant); a simulated refit whose
per-rank terms equal those recomputed from the ranks' own plans (bytes per peer,
peers placed on nodes); the command's text and JSON, its documented defaults, and a
bad bandwidth refused with a message.
"""

from __future__ import annotations

import json

import pytest

from torchrefit.cli import main
from torchrefit.simulate import parse_mesh, preset
from torchrefit.simulate.predict import Hardware, predict, rank_times
from torchrefit.simulate.report import simulate
from torchrefit.simulate.traffic import Traffic

MB = 10**6


def _traffic(pairs: dict, local: tuple[int, ...]) -> Traffic:
    return Traffic(len(local), pairs, local, (), 0)


def test_terms_worked_out_by_hand() -> None:
    hw = Hardware(gpus_per_node=2, nvlink_gbs=450, net_gbs=50, copy_gbs=4000)
    # ranks 0, 1 on node 0; 2, 3 on node 1
    pairs = {(0, 1): 900 * MB, (0, 2): 150 * MB, (3, 2): 45 * MB}
    got = predict(_traffic(pairs, (0, 0, 0, 0)), hw)
    # rank 0 sends 150 MB over the network (3 ms) and 900 MB over NVLink (2 ms)
    assert got.slowest.rank == 0 and got.slowest.bound == "send"
    assert got.seconds == pytest.approx(3e-3)
    assert got.slowest.sent_net == 150 * MB and got.slowest.sent_nvlink == 900 * MB
    assert (got.bytes_nvlink, got.bytes_net) == (945 * MB, 150 * MB)
    r2 = rank_times(_traffic(pairs, (0, 0, 0, 0)), hw)[2]
    assert (r2.received_net, r2.received_nvlink) == (150 * MB, 45 * MB)
    assert r2.receive_seconds == pytest.approx(3e-3) and r2.link_seconds == pytest.approx(3e-3)
    # Local copies: 10 GB read and written at 4000 GB/s is 5 ms.
    got = predict(_traffic(pairs, (0, 0, 0, 10_000 * MB)), hw)
    assert (got.slowest.rank, got.slowest.bound) == (3, "copy")
    assert got.seconds == pytest.approx(5e-3)
    # One node of 4: everything on NVLink; rank 0 sends 1050 MB at 450 GB/s.
    got = predict(_traffic(pairs, (0, 0, 0, 0)), Hardware(4, 450, 50))
    assert got.bytes_net == 0 and got.seconds == pytest.approx(1050 * MB / 450e9)
    # Receiving bound: rank 1 receives from two senders over the network.
    got = predict(_traffic({(2, 1): 100 * MB, (3, 1): 100 * MB}, (0,) * 4), hw)
    assert (got.slowest.rank, got.slowest.bound) == (1, "receive")
    assert got.seconds == pytest.approx(4e-3) and got.slowest.link_seconds == pytest.approx(2e-3)


def test_bad_hardware_is_refused() -> None:
    for bad in (dict(gpus_per_node=0), dict(net_gbs=0.0), dict(nvlink_gbs=-1.0)):
        with pytest.raises(ValueError):
            Hardware(**bad)


def test_prediction_agrees_with_the_ranks_plans() -> None:
    """Each sampled rank's terms, recomputed from its own plan's bytes per peer."""
    world = 64
    shape = preset("llama-70b").with_overrides(layers=4)
    hw = Hardware(gpus_per_node=4, nvlink_gbs=300, net_gbs=25, copy_gbs=2000)
    sim = simulate(shape, parse_mesh("tp8pp2@0:32", world), parse_mesh("tp4@24:64", world), world,
                   samples=2, hardware=hw)
    times = rank_times(sim.traffic, hw)
    for r in (0, 5, 24, 31, 40, 63):
        plan = sim.plan(r)
        by = {"send": [0, 0], "recv": [0, 0]}
        for (kind, peer), n in plan.bytes_by_peer().items():
            by[kind][r // 4 != peer // 4] += n
        t = times[r]
        assert (t.sent_nvlink, t.sent_net) == tuple(by["send"]), r
        assert (t.received_nvlink, t.received_net) == tuple(by["recv"]), r
        assert t.local == plan.bytes_local
        expect = max(by["send"][0] / 300e9, by["send"][1] / 25e9, by["recv"][0] / 300e9,
                     by["recv"][1] / 25e9, 2 * plan.bytes_local / 2000e9)
        assert t.seconds == pytest.approx(expect), r
    assert sim.report.prediction.seconds == max(t.seconds for t in times)
    total = sim.report.prediction.bytes_nvlink + sim.report.prediction.bytes_net
    assert total == sim.report.bytes_remote


def test_plan_command_prints_and_writes_the_prediction(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-70b", "--layers", "4", "--src", "tp8pp2",
                 "--dst", "tp4@64:128", "--world", "128", "--samples", "2",
                 "--gpus-per-node", "4", "--net-gbs", "25", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    p = data["prediction"]
    assert p["hardware"] == {"gpus_per_node": 4, "nvlink_gbs": 450.0, "net_gbs": 25.0,
                             "copy_gbs": 4000.0}
    assert p["seconds"] > 0 and p["slowest"]["bound"] in ("send", "receive", "link", "copy")
    assert data["metadata_bytes_gathered"] < data["metadata_bytes_gathered_full"]
    text = capsys.readouterr().out
    assert "predicted" in text and "network 25 GB/s" in text
    assert main(["plan", "--layers", "4", "--src", "tp2", "--dst", "tp1", "--world", "4",
                 "--net-gbs", "0"]) == 2
    assert "net bandwidth must be positive" in capsys.readouterr().err
