"""``Refitter.verify()`` as an independent witness (``torchrefit.verify``).

In process: the checksum's partial sums add up exactly however a tensor is cut, every
single flipped bit of every element changes it (fp32, bf16, fp8, int64, bool), and
moving values to other places changes it. On 4 real processes (gloo, TP2 x DP2 trainer
into TP1 x DP4 and TP4 engines): after a correct refit verify passes (cast bf16 included);
then refits made wrong in ways the plan cannot see (the last chunk of every pair's last
message dropped; a received region written to the wrong half of its tensor; a local copy corrupted; a flipped
bit on a destination replica that is not the lowest rank) each differ from an oracle and
each make verify raise on every rank naming the tensor, the region and the rank.
``verify="every"`` raises from ``refit()`` itself.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import torchrefit as tr
from torchrefit.layout import Box
from torchrefit.testing import Mesh, ModelSpec, build_toy, expected_local, run_world
from torchrefit.verify import region_sum

SPEC = ModelSpec(layers=2)
MOD = 1 << 32


def _sum(x: torch.Tensor, offset: tuple[int, ...]) -> int:
    return int(region_sum(x, Box(offset, tuple(x.shape))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.bool])
def test_every_single_bit_flip_changes_the_checksum(dtype) -> None:
    g = torch.randn(3, 5).mul(4).to(dtype)
    whole = _sum(g, (0, 0))
    raw = g.reshape(-1).view(torch.uint8)
    missed = []
    for byte in range(raw.numel()):
        for bit in range(8):
            flipped = raw.clone()
            flipped[byte] ^= 1 << bit
            if _sum(flipped.view(dtype).view(3, 5), (0, 0)) == whole:
                missed.append((byte, bit))
    assert not missed, f"{dtype}: flips not caught {missed[:5]}"


def test_partial_sums_add_up_and_positions_count() -> None:
    g = torch.randn(6, 8, dtype=torch.float64)
    whole = _sum(g, (0, 0))
    cut = _sum(g[:2], (0, 0)) + _sum(g[2:, :3], (2, 0)) + _sum(g[2:, 3:], (2, 3))
    assert cut % MOD == whole
    assert _sum(g[[1, 0, 2, 3, 4, 5]], (0, 0)) != whole  # two rows swapped
    assert _sum(g, (0, 1)) != whole  # the same values one column off
    assert _sum(g.t().contiguous().t(), (0, 0)) == whole  # strides do not matter, values do
    assert _sum(torch.tensor(2.5), ()) == _sum(torch.tensor([2.5]), (0,))


# ------------------------------------------------------------------ on 4 ranks
def _oracle_wrong(dst, mesh, rank) -> list[str]:
    want = expected_local(SPEC, mesh, rank, 1)
    return sorted(k for k, v in dst.state_dict().items() if not torch.equal(v, want[k]))


def _verify(r) -> str | None:
    try:
        r.verify()
        return None
    except tr.VerificationError as e:
        return str(e)


def _drop_last_chunk(monkeypatch_target):
    from torchrefit.plan import messages

    real = messages.cut_messages

    def cut(peer, transfers, limit):
        msgs = real(peer, transfers, limit)
        last = msgs[-1]
        if len(last.chunks) > 1:
            msgs[-1] = replace(last, chunks=last.chunks[:-1])
        return msgs
    monkeypatch_target.cut_messages = cut
    return real


def _world(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from torchrefit.execute import rounds

    out: dict = {}
    tp2 = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    src = build_toy(SPEC, Mesh(2, ranks=4), rank, 1, tp_group=tp2)
    tp1 = Mesh(1, ranks=4)
    # correct: verify passes, the oracle agrees
    dst = build_toy(SPEC, tp1, rank, 2)
    r = tr.Refitter(src, dst)
    r.refit()
    out["correct"] = (_oracle_wrong(dst, tp1, rank), _verify(r))
    # a cast: fp32 trainer into a bf16 engine
    bf16 = replace(SPEC, dtype=torch.bfloat16)
    dst16 = build_toy(bf16, Mesh(4, ranks=4), rank, 2)
    r16 = tr.Refitter(src, dst16, cast=True)
    r16.refit()
    out["cast"] = _verify(r16)
    # the last chunk of every pair's last message dropped (sender and receiver agree)
    dst = build_toy(SPEC, Mesh(4, ranks=4), rank, 2)
    real = _drop_last_chunk(rounds)
    try:
        r = tr.Refitter(src, dst, pool_bytes=64 << 10)
        r.refit()
    finally:
        rounds.cut_messages = real
    out["dropped"] = (_oracle_wrong(dst, Mesh(4, ranks=4), rank), _verify(r))
    # a received region written to the other half of its tensor (the plan entry moved on
    # rank 1; same size, so the exchange itself is undisturbed)
    dst = build_toy(SPEC, tp1, rank, 2)
    r = tr.Refitter(src, dst)
    if rank == 1:
        recvs = list(r.plan.recvs)
        for i, t in enumerate(recvs):
            shape = r._dst.tensors[t.key].shape
            d = next((d for d in range(len(shape)) if t.local_box.size[d] * 2 == shape[d]
                      and t.local_box.offset[d] == 0), None)
            if d is not None:
                off = list(t.local_box.offset)
                off[d] = t.local_box.size[d]
                recvs[i] = replace(t, local_box=Box(tuple(off), t.local_box.size))
                out["shifted_name"] = t.name
                break
        r.plan = replace(r.plan, recvs=tuple(recvs))
    r.refit()
    out["shifted"] = (_oracle_wrong(dst, tp1, rank), _verify(r))
    # a corrupted local copy: one bit of the first region rank 2 copied locally
    dst = build_toy(SPEC, tp1, rank, 2)
    r = tr.Refitter(src, dst)
    r.refit()
    if rank == 2:
        c = r.plan.local[0]
        x = r._dst.tensors[c.dst_key]
        with torch.no_grad():
            x.view(-1)[0:1].view(torch.int32).bitwise_xor_(1 << 7)  # first element of a whole tensor
        out["local_name"] = c.name
    out["local"] = (_oracle_wrong(dst, tp1, rank), _verify(r))
    # a flipped bit on rank 3, a destination replica (rank 0 holds the same)
    with torch.no_grad():
        x.view(-1)[0:1].view(torch.int32).bitwise_xor_(1 << 7) if rank == 2 else None
        if rank == 3:
            w = dst.decoder.final_layernorm.weight
            w.view(-1)[3:4].view(torch.int32).bitwise_xor_(1)
    out["replica"] = (_oracle_wrong(dst, tp1, rank), _verify(r))
    # verify="every": refit() raises
    dst = build_toy(SPEC, tp1, rank, 2)
    r = tr.Refitter(src, dst, verify="every")
    r.refit()
    real = _drop_last_chunk(rounds)
    try:
        r._program = None  # recompile with the dropping cutter
        with torch.no_grad():
            for p in dst.parameters():
                p.zero_()  # so that what the refit leaves out shows
        r.refit()
        out["every"] = None
    except tr.VerificationError as e:
        out["every"] = str(e)
    finally:
        rounds.cut_messages = real
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(_world, 4, timeout=400, pg_timeout=120)


def test_correct_refits_pass(results) -> None:
    for rank, got in enumerate(results):
        assert got["correct"] == ([], None), (rank, got["correct"])
        assert got["cast"] is None, (rank, got["cast"])


def _caught(results, case: str, text: str = "") -> None:
    wrong = [w for got in results for w in got[case][0]]
    assert wrong, f"{case}: the fault did not change the destination (oracle)"
    for rank, got in enumerate(results):
        msg = got[case][1]
        assert msg is not None, f"{case}: verify passed on rank {rank} while {wrong[:3]} differ"
        assert "destination differs from source" in msg and text in msg, (rank, msg)
    assert len({got[case][1] for got in results}) == 1, "ranks raised different errors"


def test_dropped_last_message_chunk_is_caught(results) -> None:
    _caught(results, "dropped", "on destination rank")


def test_region_written_to_the_wrong_place_is_caught(results) -> None:
    _caught(results, "shifted", results[1]["shifted_name"])


def test_corrupted_local_copy_is_caught(results) -> None:
    _caught(results, "local", f"{results[2]['local_name']}")
    assert "on destination rank 2" in results[0]["local"][1]


def test_flipped_bit_on_a_replica_is_caught(results) -> None:
    _caught(results, "replica", "decoder.final_layernorm.weight[0:")
    assert "on destination rank 3" in results[0]["replica"][1]


def test_verify_every_raises_from_refit(results) -> None:
    for rank, got in enumerate(results):
        assert got["every"] is not None and "destination differs" in got["every"], (rank, got["every"])
