"""Delta refits (``Refitter(delta=...)``) on 2 real CPU processes over gloo, non-collocated
(every byte crosses the wire) and collocated across a TP change.

The oracle is a full refit of the same source into a second destination, compared bit for
bit after every call (never ``verify()``). Covers: every dtype torchrefit moves (float32,
bfloat16, float16, float64, float8, int64/32/16/8, uint8, bool), a cast on the way
(float32 master weights into bfloat16) and block-FP8 targets with their scales; densities 0,
one element (the last one included), 1%, 30% and 100%; random bit patterns (NaN payloads,
infinities, subnormals) and the bits a float compare cannot see (0.0 into -0.0, one NaN
payload into another); both forms of the CPU diff and apply, the native kernels
(``_native.delta``, built here into a temporary cache) and the torch ops, each against the
full refit and against each other (a native sender, a torch-op receiver and the reverse); the wire bytes (only headers at density 0, a small part at low
density, never much above a full refit at 100%: the dense fallback); the version chain
(stage / commit / refit in every order, a committed stage the refit's references never
saw, a destination tensor the engine replaced, a refit that drops a staged version: full
bytes wherever the receiver does not hold the reference's version); references in
device or host memory; arguments refused up front.
"""

from __future__ import annotations

import pytest
import shm_transport  # noqa: F401  (registers the CPU one-sided test transports)
import torch

import torchrefit as tr
from torchrefit import settings
from torchrefit.testing import Mesh, ModelSpec, build_toy, run_world

FP8 = torch.float8_e4m3fn
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64,
          "e4m3": FP8, "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8,
          "u8": torch.uint8, "flag": torch.bool}
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


def _same(a: dict, b: dict) -> list[str]:
    """Keys whose bits differ."""
    return [k for k in a if not torch.equal(_bits(a[k]), _bits(b[k]))]


def _source(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, dtype in DTYPES.items():
        shape = (300, 257) if name in ("bf16", "f32") else (37, 29)
        t = torch.empty(shape, dtype=dtype)
        _bits(t).copy_(torch.randint(-128, 128, shape, generator=g).to(_INT[t.element_size()]))
        out[name] = t
    out["flag"] = out["flag"].view(torch.uint8).bitwise_and_(1).view(torch.bool)  # bools are 0 or 1
    out["master"] = torch.randn(130, 70, generator=g)  # float32 into a bfloat16 destination
    out["q"] = torch.randn(256, 192, generator=g).to(torch.bfloat16)  # into block FP8 with scales
    out["scalar"] = torch.tensor(1.5)
    return out


def _destination(seed: int) -> dict[str, torch.Tensor]:
    d = {k: torch.zeros_like(v) for k, v in _source(seed).items()}
    d["master"] = torch.zeros(130, 70, dtype=torch.bfloat16)
    d["q"] = torch.zeros(256, 192, dtype=FP8)
    d["q_scale_inv"] = torch.zeros(2, 2)
    return d


def _mutate(src: dict, step: int, density: float) -> None:
    """Random bits (any pattern: NaN payloads, subnormals, infinities) at ``density``."""
    g = torch.Generator().manual_seed(100 + step)
    for name, t in src.items():
        bits = _bits(t).reshape(-1)
        if density >= 1:
            mask = torch.ones(bits.numel(), dtype=torch.bool)
        else:
            mask = torch.rand(bits.numel(), generator=g) < density
        new = torch.randint(-(1 << 15), 1 << 15, (bits.numel(),), generator=g).to(bits.dtype)
        if name == "flag":
            new = 1 - bits
        elif name in ("master", "q"):  # values a model holds: finite, so FP8 scales are too
            new = _bits(torch.randn(bits.numel(), generator=g).to(t.dtype))
        bits[mask] = new[mask]


def _subtle(src: dict) -> None:
    """Changes only bits can see: 0.0 <-> -0.0, one NaN payload into another, subnormals,
    and the last element of every tensor."""
    for name in ("f32", "bf16", "f16", "f64"):
        t = src[name]
        b = _bits(t).reshape(-1)
        sign = torch.tensor(1, dtype=b.dtype) << (8 * t.element_size() - 1)
        t.reshape(-1)[:3] = 0.0
        b[1] = sign  # -0.0 where 0.0 was
        t.reshape(-1)[5] = float("nan")
        b[5] = b[5] ^ 1  # another NaN payload
        b[7] = 1  # the smallest subnormal
    for t in src.values():
        b = _bits(t).reshape(-1)
        b[-1] = 1 - b[-1] if t.dtype == torch.bool else b[-1] ^ 1
    src["flag"].view(torch.uint8).bitwise_and_(1)


STEPS = [("first", None), ("unchanged", 0.0), ("one element", "one"), ("1%", 0.01), ("subtle", "subtle"),
         ("30%", 0.3), ("all", 1.0), ("unchanged again", 0.0)]


def _step(src: dict, step: int, density) -> None:
    if density == "one":
        src["bf16"][150, 200] = -src["bf16"][150, 200] + 1
    elif density == "subtle":
        _subtle(src)
    else:
        _mutate(src, step, density)


def _on(tensors: dict | None, device: str) -> dict | None:
    if tensors is None or device == "cpu":
        return tensors
    return {k: v.to(device) for k, v in tensors.items()}


@pytest.fixture(scope="module")
def delta_cache(tmp_path_factory) -> str:
    """A kernel cache holding the native delta kernels, built once (about a second)."""
    from torchrefit._native import delta as native
    cache = str(tmp_path_factory.mktemp("delta") / "kernels")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(settings.ENV["kernel_cache"], cache)
        settings.reload()
        try:
            native.build()
        except Exception as e:  # noqa: BLE001 (no C++ compiler here)
            pytest.skip(f"the native delta kernels could not be built here: {type(e).__name__}: {e}")
    settings.reload()
    return cache


@pytest.fixture
def kernels(request, monkeypatch) -> str:
    """``"native"`` or ``"torch ops"`` (the test's parameter): the CPU diff and apply this
    process uses (ranks it spawns: pass ``native=`` to their world function)."""
    if request.param == "native":
        monkeypatch.setenv(settings.ENV["kernel_cache"], request.getfixturevalue("delta_cache"))
    settings.reload()
    settings.configure(native_delta=request.param == "native")
    return request.param


def _native_used() -> bool:
    from torchrefit.execute import delta_native
    return delta_native.kernels() is not None


def _dtypes_world(rank: int, world: int, delta: str, device: str = "cpu", transport: str = "auto",
                  native: bool = True, triton: bool = True, piece: int | None = None,
                  apart: int | None = None) -> dict:
    """Also run on GPUs by tests/test_gpu_delta.py (``device="cuda"``). ``native``: the
    native CPU kernels where built (the test's cache), else the torch ops; ``triton``: the
    Triton kernels for CUDA tensors (``settings.triton_delta``); ``piece``: the most bytes
    of a delta message (many rounds, each carrying the next message's headers);
    ``apart``: the dense parts that travel (and land) on their own, from this many bytes."""
    from torchrefit.execute import delta as d
    settings.configure(native_delta=native, triton_delta=triton)
    if piece is not None:
        d.PIECE = piece
    if apart is not None:
        d.LAND_APART = apart
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    src = _on(_source(1), device) if rank == 0 else None
    dst_d = _on(_destination(2), device) if rank == 1 else None
    dst_f = _on(_destination(3), device) if rank == 1 else None
    kw = dict(cast=True, fp8_block=(128, 128), transport=transport)
    r_delta = tr.Refitter(src, dst_d, delta=delta, **kw)
    r_full = tr.Refitter(src, dst_f, **kw)
    out = {"steps": []}
    for step, (what, density) in enumerate(STEPS):
        if rank == 0 and density is not None:
            host = {k: v.cpu() for k, v in src.items()}  # the same bits on every device
            _step(host, step, density)
            for k, v in host.items():
                src[k].copy_(v)
        rep = r_delta.refit()
        full = r_full.refit()
        out["steps"].append({"what": what, "wrong": _same(dst_d, dst_f) if rank == 1 else [],
                             "rounds": max(map(len, r_delta._program.compiled.delta.recvs.values()), default=0),
                             "wire": rep.wire_bytes_received + rep.wire_bytes_sent,
                             "full": full.bytes_received + full.bytes_sent,
                             "reference": rep.delta_reference_bytes})
    out["native"] = _native_used()
    return out


def check_dtypes(results: list[dict], rounds: int = 1) -> None:
    """``rounds``: delta messages per pair (each carries a header of the next's)."""
    engine = results[1]["steps"]
    for row in engine:
        assert row["wrong"] == [], row
        assert row["rounds"] == rounds
    by = {row["what"]: row for row in engine}
    full = by["first"]["full"]
    assert full > 0 and by["first"]["wire"] >= full  # nothing to diff against: every byte
    assert by["unchanged"]["wire"] < 200 * rounds and by["unchanged again"]["wire"] < 200 * rounds  # headers alone
    assert by["one element"]["wire"] < 100 + 200 * rounds
    assert by["1%"]["wire"] < 0.1 * full
    # the dense fallback: never much more than a full refit (a few header words)
    assert by["all"]["wire"] <= 1.01 * full
    assert by["30%"]["wire"] <= 1.01 * full
    # the sender's reference: the bytes it sends (messages pad regions to 16 bytes)
    assert full <= results[0]["steps"][-1]["reference"] <= 1.01 * full


@pytest.mark.parametrize("delta, kernels", [("device", "native"), ("host", "torch ops")], indirect=["kernels"])
def test_every_dtype_bit_exact_at_every_density(delta: str, kernels: str) -> None:
    results = run_world(_dtypes_world, 2, delta, "cpu", "auto", kernels == "native", timeout=240)
    assert [r["native"] for r in results] == [kernels == "native"] * 2
    check_dtypes(results)


def test_many_rounds_each_carrying_the_next_headers() -> None:
    """Messages of at most 64 KiB: a call of 10 rounds, each carrying message m and the
    headers of message m + 1 and posted before round m - 1 lands (receive pools by round
    parity); dense parts of 4 KiB or more travel apart, landing in their views where those
    take the wire's bytes as they are. Every dtype bit exact at every density."""
    check_dtypes(run_world(_dtypes_world, 2, "device", "cpu", "auto", True, True, 64 << 10, 4 << 10, timeout=240), 10)


# ---------------------------------------------------------------- the version chain
def _chain_world(rank: int, world: int, transport: str = "auto", device: str = "cpu",
                 staging: str = "device") -> dict:
    """Also run on a GPU by tests/test_gpu_delta.py (``device="cuda"``; ``staging="host"``:
    the staged twins of CUDA tensors in host memory)."""
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    g = torch.Generator().manual_seed(7)
    src = {"x": torch.randn(512, 256, generator=g).to(device, torch.bfloat16),
           "y": torch.randn(64, 64, generator=g).to(device, torch.bfloat16)} if rank == 0 else None
    dst_d = {k: torch.zeros(s, dtype=torch.bfloat16, device=device) for k, s in (("x", (512, 256)), ("y", (64, 64)))} \
        if rank == 1 else None
    dst_f = {k: v.clone() for k, v in dst_d.items()} if rank == 1 else None
    r_d = tr.Refitter(src, dst_d, delta="device", transport=transport, staging=staging)
    r_f = tr.Refitter(src, dst_f, transport=transport, staging=staging)
    base: dict = {}
    rows = []

    def both(op: str) -> None:
        rep = getattr(r_d, op)()
        getattr(r_f, op)()
        if op == "stage":
            rep = rep.wait()
        rows.append({"op": op, "wrong": _same(dst_d, dst_f) if rank == 1 else [],
                     "wire": getattr(rep, "wire_bytes_received", None)})

    def change(cells: list[tuple[int, int]], value: float) -> None:
        if rank == 0:
            for i, j in cells:
                src["x"][i, j] = value

    both("stage"), both("commit")  # stage 1, committed: live holds it
    change([(0, 0)], 2.0)
    both("refit")  # the refit's references never sent anything: full
    change([(1, 1)], 3.0)
    both("refit")  # a patch onto the previous refit
    if rank == 0:
        base = {k: v.clone() for k, v in src.items()}
    change([(i, 5) for i in range(0, 512, 3)], 4.0)  # set A
    both("stage")  # a patch against stage 1, which the twins still hold
    both("commit")  # live now holds stage 4; the refit's references hold refit 3
    if rank == 0:
        for k, v in base.items():
            src[k].copy_(v)  # set A back as it was at refit 3
    change([(9, 9)], 5.0)
    both("refit")  # references of refit 3, live holds stage 4: full bytes
    if rank == 1:  # the engine replaces a tensor with other contents (a reload)
        dst_d["x"] = torch.full((512, 256), 7.0, dtype=torch.bfloat16, device=device)
        dst_f["x"] = torch.full((512, 256), 7.0, dtype=torch.bfloat16, device=device)
    change([(10, 10)], 6.0)
    both("refit")  # the replaced tensor holds nothing the references know: full
    change([(11, 11)], 7.0)
    both("stage")  # twins hold stage 4, references stage 4: a patch
    change([(12, 12)], 8.0)
    both("refit")  # drops the staged version; live holds refit 6: patch
    change([(13, 13)], 9.0)
    both("stage")  # twins hold stage 7 (never committed), references stage 7: patch
    both("commit")
    change([(14, 14)], 1.0)
    both("refit")  # live holds stage 9 (committed), references refit 8: full
    return {"rows": rows}


def check_chain(rows: list[dict]) -> None:
    for row in rows:
        assert row["wrong"] == [], rows
    wires = [r["wire"] for r in rows if r["op"] != "commit"]
    full = 512 * 256 * 2 + 64 * 64 * 2
    kinds = ["full" if w >= full else ("patch" if w < full / 10 else "?") for w in wires]
    assert kinds == ["full", "full", "patch", "patch", "full", "full", "patch", "patch", "patch", "full"], \
        (kinds, wires)


def test_version_chain_never_patches_the_wrong_base() -> None:
    check_chain(run_world(_chain_world, 2, timeout=180)[1]["rows"])


# ------------------------------------------------------ collocated, across a TP change
SPEC = ModelSpec(layers=2)


def _toy_world(rank: int, world: int, piece: int | None = None) -> dict:
    from torchrefit.execute import delta as d
    if piece is not None:
        d.PIECE = piece
    src = build_toy(SPEC, Mesh(2, ranks=2), rank, 1)
    dst_d, dst_f = build_toy(SPEC, Mesh(1, ranks=2), rank, 2), build_toy(SPEC, Mesh(1, ranks=2), rank, 3)
    r_d = tr.Refitter(src, dst_d, delta="host", staging="host")
    r_f = tr.Refitter(src, dst_f)
    wrong, wires = [], []
    g = torch.Generator().manual_seed(rank)
    for step in range(4):
        with torch.no_grad():
            for p in src.parameters():
                mask = torch.rand(p.shape, generator=g) < 0.02
                p[mask] += 1.0
        if step % 2:
            r_d.stage(), r_d.commit()
            r_f.stage(), r_f.commit()
        else:
            wires.append(r_d.refit().wire_bytes_received)
            r_f.refit()
        wrong += _same(dst_d.state_dict(), dst_f.state_dict())
    return {"wrong": wrong, "wires": wires}


@pytest.mark.parametrize("piece", [None, 16 << 10])
def test_tp_change_collocated_with_stage_and_commit(piece: int | None) -> None:
    """Every rank sends and receives; with 16 KiB messages, in rounds where one direction
    has a message and the other none."""
    for got in run_world(_toy_world, 2, piece, timeout=180):
        assert got["wrong"] == []


# ---------------------------------------------------------- refused up front (or not)
def _refused(rank: int, world: int) -> dict:
    src = {"x": torch.ones(8, 8)} if rank == 0 else None
    dst = {"x": torch.zeros(8, 8)} if rank == 1 else None
    out = {}
    for kw in ({"delta": "gpu"}, {"delta": "device", "transport": "shm-pull"}):
        try:
            tr.Refitter(src, dst, **kw)
            out[str(kw)] = "built"
        except (ValueError, tr.RefitError) as e:
            out[str(kw)] = str(e)
    return out


def test_bad_arguments_refused_on_every_rank() -> None:
    for got in run_world(_refused, 2, timeout=120):
        assert "delta must be one of" in got["{'delta': 'gpu'}"]
        assert got["{'delta': 'device', 'transport': 'shm-pull'}"] == "built"  # test_delta_one_sided.py


# ------------------------------------------------- trainer and engine as separate jobs
ONE = Mesh(1, ranks=1)


def _poke(state: dict, step: int) -> None:
    """The same small change on both sides' views of the weights: element ``step`` of
    every tensor of two dims or more."""
    for t in state.values():
        if t.dim() >= 2:
            t.view(-1)[step] = float(step) + 0.5


def _job_trainer(rank: int, world: int, port: int) -> dict:
    from torchrefit.testing import expected_local
    from torchrefit.testing.toy import load_seed
    conn = tr.connect(role="trainer", rank=rank, world_size=world, peer_world_size=1,
                      address="127.0.0.1", port=port, backend="gloo", timeout=60.0)
    src = build_toy(SPEC, ONE, 0, 99)
    r = tr.Refitter(src, None, group=conn, delta="device")
    load_seed(src, SPEC, ONE, 0, 1)
    assert set(expected_local(SPEC, ONE, 0, 1)) == set(src.state_dict())
    sent = [r.refit().wire_bytes_sent]
    for step in (1, 2):
        with torch.no_grad():
            _poke(src.state_dict(), step)
        sent.append(r.refit().wire_bytes_sent)
    conn.close()
    return {"sent": sent, "full": r.plan.bytes_sent}


def _job_engine(rank: int, world: int, port: int) -> dict:
    from torchrefit.testing import expected_local
    conn = tr.connect(role="engine", rank=rank, world_size=world, peer_world_size=1,
                      address="127.0.0.1", port=port, backend="gloo", timeout=60.0)
    dst = build_toy(SPEC, ONE, 0, 7)
    r = tr.Refitter(None, dst, group=conn, delta="device")
    want = expected_local(SPEC, ONE, 0, 1)  # the toy's own oracle, cut with plain torch ops
    ok = []
    r.refit()
    ok.append(not _same(dst.state_dict(), want))
    for step in (1, 2):
        _poke(want, step)
        r.refit()
        ok.append(not _same(dst.state_dict(), want))
    conn.close()
    return {"ok": ok}


def test_separate_jobs_through_connect() -> None:
    from torchrefit.testing.jobs import run_jobs
    trainers, engines = run_jobs(_job_trainer, 1, _job_engine, 1, timeout=180)
    assert engines[0]["ok"] == [True, True, True]
    sent, full = trainers[0]["sent"], trainers[0]["full"]
    assert sent[0] == full and max(sent[1:]) < full / 10, (sent, full)


# ------------------------------------------------------------------ a failed refit
def _failed_world(rank: int, world: int, transport: str = "auto") -> dict:
    """A transfer that fails mid-refit on every rank, delta and full alike: the same
    outcome (version kept, every later refit refused: docs/reliability.md). Tensors in
    shared memory, so one-sided transports over it take them too
    (tests/test_delta_one_sided.py)."""
    src = {"x": torch.ones(64, 64, dtype=torch.bfloat16).share_memory_()} if rank == 0 else None
    out = {}
    for delta in (None, "device"):
        dst = {"x": torch.zeros(64, 64, dtype=torch.bfloat16).share_memory_()} if rank == 1 else None
        r = tr.Refitter(src, dst, delta=delta, transport=transport)
        r.refit()

        def broken(*_args, **_kwargs):
            raise tr.TransportError("injected failure")
        r._program.run = broken
        seen = []
        for _ in range(2):
            try:
                r.refit()
                seen.append("ok")
            except tr.TransportError as e:
                seen.append("unusable" if "unusable" in str(e) else "raised")
        out[str(delta)] = (seen, r.version)
    return out


def test_a_failed_delta_refit_leaves_what_a_failed_full_refit_leaves() -> None:
    for got in run_world(_failed_world, 2, timeout=120):
        assert got["None"] == got["device"] == (["raised", "unusable"], 1), got


# ------------------------------------------------------------ the encoding per message
def _one_message(density: float, parts: int = 2, n: int = 1 << 17) -> tuple:
    """A sender's message of ``parts`` bf16 regions of ``n`` elements whose reference
    differs from the source at ``density``, and the receiver's copy of the reference."""
    from torchrefit.execute import delta as d
    g = torch.Generator().manual_seed(5)
    src = [torch.randn(n, generator=g).to(torch.bfloat16) for _ in range(parts)]
    ref = torch.cat([s.view(torch.uint8) for s in src])
    dst = [s.clone() for s in src]
    for s in src:
        idx = torch.randperm(n, generator=g)[: int(density * n)]
        _bits(s)[idx] ^= 1
    send = d._Message(1, tuple(d._Part(s, torch.bfloat16, i * 2 * n, n) for i, s in enumerate(src)), ref.numel(), ref)
    recv = d._Message(0, tuple(d._Part(t, torch.bfloat16, i * 2 * n, n) for i, t in enumerate(dst)), ref.numel(), None)
    return src, dst, send, recv


@pytest.mark.parametrize("kernels", ["native", "torch ops"], indirect=True)
@pytest.mark.parametrize("density, above, want, n", [
    (0.05, 0.1, "sparse", 1 << 17), (0.2, 0.1, "dense", 1 << 17), (0.05, 0.02, "dense", 1 << 17),
    (0.6, 1.0, "dense", 1 << 17), (0.0005, 0.1, "sparse", 1 << 17),
    (0.2, 0.1, "dense", 1 << 12), (0.6, 1.0, "dense", 1 << 12)])  # parts too small to sample
def test_encoding_chosen_by_density_and_bytes(density: float, above: float, want: str, n: int, kernels: str) -> None:
    """Sparse only where it is fewer bytes and at most ``delta_dense_above`` changed (a
    sparse message past that costs more time than a dense one), judged from a sample of
    large parts before the diff and from the diff itself; the receiver ends equal either
    way, and a second encode of the same source finds nothing."""
    from torchrefit.execute import delta as d
    assert _native_used() == (kernels == "native")
    src, dst, send, recv = _one_message(density, n=n)
    with tr.settings.overridden(delta_dense_above=above):
        enc, counts, payload = d._encode(send)
    assert enc == (d.SPARSE if want == "sparse" else d.DENSE), (enc, counts)
    if enc == d.SPARSE:
        assert sum(counts) == sum(int((a != b).sum()) for a, b in zip(map(_bits, src), map(_bits, dst)))
        d._apply(recv, counts, payload)
    else:
        d._unpack(recv, payload)
    assert _same(dict(enumerate(src)), dict(enumerate(dst))) == []
    assert d._encode(send)[1] == [0, 0]  # the reference took every change


@pytest.mark.parametrize("kernels", ["native", "torch ops"], indirect=True)
def test_the_sample_alone_makes_a_message_dense(kernels: str) -> None:
    """Changes only where the sample looks (half of its runs' elements: 6.25% of the part,
    under ``delta_dense_above``) send the message dense, by the sample's verdict alone:
    the diff would have found it sparse."""
    from torchrefit.execute import delta as d
    assert _native_used() == (kernels == "native")
    n = 1 << 17
    src = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    dst = src.clone()
    send = d._Message(1, (d._Part(src, torch.bfloat16, 0, n),), src.nbytes, src.clone().view(torch.uint8))
    recv = d._Message(0, (d._Part(dst, torch.bfloat16, 0, n),), src.nbytes, None)
    sampled = d._sample_at(n, src.device)
    _bits(src)[sampled[::2]] ^= 1
    enc, counts, payload = d._encode(send)
    assert enc == d.DENSE, counts
    d._unpack(recv, payload)
    assert torch.equal(_bits(src), _bits(dst))
    _bits(src)[sampled] ^= 1  # against the reference the fill left: every sampled element
    assert d._sampled_density(send) == 1.0


@pytest.mark.parametrize("sender", ["native", "torch ops"])
def test_native_and_torch_ops_read_each_other(delta_cache: str, sender: str, monkeypatch) -> None:
    """The two forms write one format: a native sender's payload applied with torch ops,
    and the reverse, rebuild the source exactly (parts of every element size, lengths
    that end mid-word and mid-block, changes in the last element; the native diff
    spread over threads)."""
    from torchrefit.execute import delta as d
    monkeypatch.setenv(settings.ENV["kernel_cache"], delta_cache)
    settings.reload()  # the cache just set, and nothing an earlier test configured
    g = torch.Generator().manual_seed(11)
    shapes = {torch.bfloat16: 70001, torch.float32: 65537, torch.uint8: 131075, torch.float64: 33, torch.bool: 9}
    src = [torch.randint(0, 2, (n,), generator=g).to(t) if t == torch.bool else
           torch.randint(-9, 9, (n,), generator=g).to(t) for t, n in shapes.items()]
    offsets = [0]
    for t in src[:-1]:
        offsets.append(d._align(offsets[-1] + t.nbytes))
    nbytes = offsets[-1] + src[-1].nbytes
    ref = torch.zeros(nbytes, dtype=torch.uint8)
    dst = [torch.zeros_like(t) for t in src]
    send = d._Message(1, tuple(d._Part(t, t.dtype, o, t.numel()) for t, o in zip(src, offsets)), nbytes, ref)
    recv = d._Message(0, tuple(d._Part(t, t.dtype, o, t.numel()) for t, o in zip(dst, offsets)), nbytes, None)
    for step in range(3):
        if step:
            for t in src:
                bits = _bits(t).reshape(-1)
                mask = torch.rand(bits.numel(), generator=g) < 0.01
                mask[-1] = True
                bits[mask] = (1 - bits[mask]) if t.dtype == torch.bool else bits[mask] ^ 1
        # three threads split each part of several blocks (the dtype test covers one)
        with settings.overridden(native_delta=sender == "native", delta_dense_above=0.5, delta_threads=3):
            assert _native_used() == (sender == "native")
            enc, counts, payload = d._encode(send)
        with settings.overridden(native_delta=sender != "native"):
            assert _native_used() == (sender != "native")
            (d._apply(recv, counts, payload) if enc == d.SPARSE else d._unpack(recv, payload))
        assert enc == (d.DENSE if step == 0 else d.SPARSE)
        assert _same(dict(enumerate(src)), dict(enumerate(dst))) == [], step


@pytest.mark.parametrize("threads", [1, 3])
def test_native_apply_spread_over_threads(delta_cache: str, threads: int, monkeypatch) -> None:
    """The native apply splits a part's blocks among threads, each starting at its first
    block's prefix of changes: a payload the torch ops encoded (an independent writer)
    rebuilds the source exactly, with blocks that hold no change between changed ones and
    a change in the last element."""
    from torchrefit.execute import delta as d
    monkeypatch.setenv(settings.ENV["kernel_cache"], delta_cache)
    settings.reload()
    g = torch.Generator().manual_seed(5)
    n = 16 * d.BLOCK + 123
    src = torch.randint(-9, 9, (n,), generator=g).to(torch.bfloat16)
    dst = src.clone()
    ref = src.clone().view(torch.uint8)
    bits = _bits(src)
    mask = torch.rand(n, generator=g) < 0.45
    for blk in (0, 5, 6, 11):  # blocks with nothing to write, at a thread's edges and inside
        mask[blk * d.BLOCK: (blk + 1) * d.BLOCK] = False
    mask[-1] = True
    bits[mask] = bits[mask] ^ 1
    send = d._Message(1, (d._Part(src, torch.bfloat16, 0, n),), src.nbytes, ref)
    recv = d._Message(0, (d._Part(dst, torch.bfloat16, 0, n),), src.nbytes, None)
    with settings.overridden(native_delta=False, delta_dense_above=0.5):
        enc, counts, payload = d._encode(send)
    assert enc == d.SPARSE and counts[0] >= 3 * 65536  # enough changes for three threads
    with settings.overridden(delta_threads=threads):
        assert _native_used()
        d._apply(recv, counts, payload)
    assert torch.equal(_bits(dst), bits)


@pytest.mark.parametrize("kernels", ["native", "torch ops"], indirect=True)
def test_a_tiny_message_unchanged_sends_nothing(kernels: str) -> None:
    """A message too small for ``delta_dense_above`` to allow a single change still
    goes sparse, with no bytes, where nothing changed, and dense where anything did."""
    from torchrefit.execute import delta as d
    src = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    ref = src.clone().view(torch.uint8)
    send = d._Message(1, (d._Part(src, torch.bfloat16, 0, 3),), 6, ref)
    enc, counts, payload = d._encode(send)
    assert (enc, counts, payload.numel()) == (d.SPARSE, [0], 0)
    src[2] = 4.0
    enc, counts, payload = d._encode(send)
    assert enc == d.DENSE and torch.equal(payload.view(torch.int16), src.view(torch.int16))
