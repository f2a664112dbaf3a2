"""Delta refits measured (``torchrefit bench --delta``, ``benchmarks/delta.py``).

Three parts, each printing JSON rows (keys ``delta_density``, ``wire_bytes``,
``full_bytes``, ``delta_ms``, ``full_ms`` where they apply):

* ``densities``: how many bf16 elements an RL step changes. A Hugging Face ``transformers``
  Qwen2 model (random init) keeps float32 master weights trained by AdamW on real gradients
  (random token batches, the causal LM loss); after each step its bfloat16 copy (what an
  engine holds) is compared with the previous one bit for bit: the fraction changed, for
  the model and per tensor kind.
* ``wire``: 2 processes over gloo, non-collocated (a trainer rank, an engine rank), a
  bfloat16 model; at each density a random set of elements changes, then a delta refit and
  a full refit of the same source run in the same run: bytes on the wire and times. At
  each density the sender also measures the diff's physical floor on CPU: one read pass
  over the source and a reference of it (``floor_read_ms``, the native kernels' pass with
  nothing to find) and a memcpy of the bytes (``floor_memcpy_ms``); ``best_speedup`` =
  ``full_ms / floor_read_ms`` is the most any exact diff can gain here.
* ``ipc`` (CUDA only): the ``wire`` part between 2 processes sharing one GPU over CUDA
  IPC (``transport="ipc"``): the receiver applies patches straight out of the sender's
  registered slots (``execute.delta_one_sided``), the full refit copies every byte.
* ``gpu`` (CUDA only): on one GPU, the sender's diff and encode plus the receiver's apply
  against the copy floor of the full bytes (one device-to-device copy of them).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

__all__ = ["densities", "wire", "gpu", "KINDS"]

#: tensor kinds of a Qwen2 model, by a part of their names, first match wins
KINDS = (("mlp", "mlp."), ("o", "o_proj"), ("q/k/v", "q_proj"), ("q/k/v", "k_proj"), ("q/k/v", "v_proj"),
         ("norm", "norm"), ("embed", "embed_tokens"), ("lm_head", "lm_head"))


def _kind(name: str) -> str:
    return next((kind for kind, part in KINDS if part in name), "other")


def _qwen2(layers: int, vocab: int | None, full: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                      num_hidden_layers=24 if full else layers, vocab_size=151936 if full else (vocab or 151936),
                      max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg), cfg


def densities(layers: int = 2, vocab: int | None = 32768, lrs=(1e-6, 1e-5), steps: int = 20, batch: int = 2,
              seq: int = 128, full: bool = False, device: str = "cpu") -> list[dict]:
    """Fraction of bf16 elements changed per AdamW step, per learning rate (rows per step
    and a summary row per lr with the mean over steps, per kind)."""
    rows = []
    for lr in lrs:
        model, cfg = _qwen2(layers, vocab, full)
        model = model.to(device=device, dtype=torch.float32).train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
        g = torch.Generator().manual_seed(1)
        params = dict(model.named_parameters())
        prev = {n: p.detach().to(torch.bfloat16) for n, p in params.items()}
        per_kind = defaultdict(list)
        overall = []
        for step in range(steps):
            tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            changed = defaultdict(lambda: [0, 0])
            for n, p in params.items():
                now = p.detach().to(torch.bfloat16)
                diff = int((now.view(torch.int16) != prev[n].view(torch.int16)).sum())
                for key in ("model", _kind(n)):
                    changed[key][0] += diff
                    changed[key][1] += now.numel()
                prev[n] = now
            row = {"part": "densities", "lr": lr, "step": step + 1, "loss": float(loss.detach()),
                   "delta_density": changed["model"][0] / changed["model"][1],
                   "per_kind": {k: c / t for k, (c, t) in changed.items() if k != "model"}}
            rows.append(row)
            overall.append(row["delta_density"])
            for k, v in row["per_kind"].items():
                per_kind[k].append(v)
        rows.append({"part": "densities", "lr": lr, "step": "mean", "delta_density": statistics.mean(overall),
                     "first_step": overall[0], "last_steps_mean": statistics.mean(overall[-5:]),
                     "per_kind": {k: statistics.mean(v) for k, v in per_kind.items()},
                     "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size,
                     "params": sum(p.numel() for p in params.values())})
        del model, opt
    return rows


# --------------------------------------------------------- 2 processes, gloo or nccl
def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _mutate(src: dict, density: float, g: torch.Generator) -> None:
    for t in src.values():
        flat = t.view(-1)
        k = int(round(density * flat.numel()))
        idx = torch.randperm(flat.numel(), generator=g)[:k].to(t.device)
        flat[idx] = (flat[idx].float() + 0.01).to(t.dtype)


def _timed(fn, group) -> float:
    _sync()
    dist.barrier(group)
    t0 = time.perf_counter()
    fn()
    _sync()
    dist.barrier(group)  # the refit done on both ranks: the receiver applied every byte
    return (time.perf_counter() - t0) * 1e3


def _floors(src: dict, copies: dict, iters: int, threads: int) -> dict:
    """The diff's floor on CPU, timed here: one read pass over the source and ``copies``
    (the native kernels' own pass, nothing to find), and a memcpy of the source."""
    from .. import settings
    from .._native import delta as native
    with settings.overridden(native_delta=True):  # the floor, whichever path the refits take
        kern = native.wait()
    out = {"floor_memcpy_ms": statistics.median(
        _clock(lambda: [copies[k].copy_(v) for k, v in src.items()]) for _ in range(iters))}
    if kern is not None and all(v.device.type == "cpu" for v in src.values()):
        def read() -> None:
            for k, v in src.items():
                kern.read_floor(v.data_ptr(), copies[k].data_ptr(), v.nbytes, threads)
        out["floor_read_ms"] = statistics.median(_clock(read) for _ in range(iters))
    return out


def _clock(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _wire_world(rank: int, world: int, tensors: int, rows: int, cols: int, dens: list[float], iters: int,
                delta: str, transport: str, cuda: bool, threads: int = 0, native_on: bool = True) -> list[dict]:
    import torchrefit as tr

    from .._native import delta as native
    from ..execute import delta_native
    if not threads:  # the trainer and the engine are processes of their own: torch's default threads
        torch.set_num_threads(os.cpu_count() or 1)  # (the spawning harness gives its ranks one)
    tr.settings.configure(delta_threads=threads, native_delta=native_on)
    threads = delta_native.threads()  # what 0 (the default) came to here
    native_used = native.wait() is not None  # built now: the run measures one path throughout
    dev = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    g = torch.Generator().manual_seed(3)
    shapes = {f"layer{i}.weight": (rows, cols) for i in range(tensors)}
    src = {k: torch.randn(s, generator=g).to(dev, torch.bfloat16) for k, s in shapes.items()} if rank == 0 else None
    copies = {k: v.clone() for k, v in src.items()} if rank == 0 and not cuda else None
    dst_d = {k: torch.zeros(s, dtype=torch.bfloat16, device=dev) for k, s in shapes.items()} if rank == 1 else None
    dst_f = {k: torch.zeros(s, dtype=torch.bfloat16, device=dev) for k, s in shapes.items()} if rank == 1 else None
    r_d = tr.Refitter(src, dst_d, transport=transport, delta=delta)
    r_f = tr.Refitter(src, dst_f, transport=transport)
    group = dist.group.WORLD
    r_d.refit(), r_f.refit()  # compiled, and the references filled
    out = []
    for p in dens:
        d_ms, f_ms, wire = [], [], []
        for _ in range(iters):
            if rank == 0:
                _mutate(src, p, g)
            reports: list = []
            d_ms.append(_timed(lambda out=reports: out.append(r_d.refit()), group))
            f_ms.append(_timed(r_f.refit, group))
            wire.append(reports[0].wire_bytes_sent + reports[0].wire_bytes_received)
        exact = all(torch.equal(dst_d[k].view(torch.int16), dst_f[k].view(torch.int16)) for k in shapes) \
            if rank == 1 else True
        row = {"part": transport + ("-cuda" if cuda and transport == "gloo" else ""), "delta_density": p,
               "wire_bytes": max(wire), "full_bytes": r_f.plan.bytes_sent + r_f.plan.bytes_received,
               "delta_ms": statistics.median(d_ms), "full_ms": statistics.median(f_ms),
               "exact": exact, "iters": iters, "reference_bytes": reports[0].delta_reference_bytes,
               "native": native_used, "delta_threads": threads}
        if copies is not None:
            row.update(_floors(src, copies, iters, threads))
        out.append(row)
    r_d.close(), r_f.close()
    return out


def wire(tensors: int = 8, rows: int = 4096, cols: int = 2048, dens=(0.001, 0.01, 0.05, 0.2, 0.5),
         iters: int = 5, delta: str = "device", transport: str = "gloo", cuda: bool = False,
         threads: int = 0, native: bool = True) -> list[dict]:
    """Delta against full refits, 2 processes, non-collocated, in one run: over gloo with
    CPU tensors (or ``cuda``: both processes' tensors on GPUs, messages through host
    memory), over nccl with one GPU per process, or over ipc with both processes on one
    GPU (``rank % device_count``). ``threads``: ``delta_threads`` (0: the default);
    ``native``: the native CPU kernels (built now where missing), else torch ops."""
    cuda = cuda or transport in ("nccl", "ipc")
    from ..testing import run_world
    backend = "cpu:gloo,cuda:nccl" if transport == "nccl" else "gloo"
    per_rank = run_world(_wire_world, 2, tensors, rows, cols, list(dens), iters, delta, transport, cuda, threads, native,
                         backend=backend, timeout=1800, pg_timeout=600)
    rows_out = []
    for a, b in zip(*per_rank):  # the engine's wire bytes and exactness; the slower rank's times
        row = dict(b)
        row.update(delta_ms=max(a["delta_ms"], b["delta_ms"]), full_ms=max(a["full_ms"], b["full_ms"]),
                   reference_bytes=a["reference_bytes"], native=a["native"] and b["native"])
        row["wire_fraction"] = row["wire_bytes"] / row["full_bytes"]
        row["speedup"] = row["full_ms"] / row["delta_ms"]
        for key in ("floor_read_ms", "floor_memcpy_ms"):
            if key in a:
                row[key] = a[key]
        if "floor_read_ms" in a:
            row["delta_to_floor"] = row["delta_ms"] / a["floor_read_ms"]
            row["best_speedup"] = row["full_ms"] / a["floor_read_ms"]
        rows_out.append(row)
    return rows_out


# --------------------------------------------------------------------------- GPU
def gpu(numel: int = 1 << 28, dens=(0.001, 0.01, 0.05, 0.2, 0.5), iters: int = 10, device: str = "cuda",
        kernels=("triton", "torch"), cast: bool = False) -> list[dict]:
    """One GPU: encode (diff against the reference, sparse payload, reference update) and
    apply (scatter into the destination) against the copy floor (one device copy of the
    full bytes, timed in the same run), one message of ``numel`` bfloat16 elements, for
    each of ``kernels``: the Triton kernels (``settings.triton_delta``) and the torch ops.
    ``cast``: the source is float32 master weights cast to the bfloat16 wire (the floor
    then copies the float32 source into bfloat16). Every row checks the destination
    against the source, bit for bit."""
    from .. import settings
    from ..execute import delta as d
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    master = torch.randn(numel, device=dev, generator=g)
    src = master if cast else master.to(torch.bfloat16)
    floor_dst = torch.empty(numel, dtype=torch.bfloat16, device=dev)

    def clock(fn) -> float:
        times = []
        for _ in range(iters):
            _sync()
            t0 = time.perf_counter()
            fn()
            _sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    floor = clock(lambda: floor_dst.copy_(src))
    rows = []
    for kind in kernels:
        dst = src.to(torch.bfloat16)
        ref = dst.clone().view(torch.uint8)
        msg_s = d._Message(1, (d._Part(src, torch.bfloat16, 0, numel),), dst.nbytes, ref)
        msg_r = d._Message(0, (d._Part(dst, torch.bfloat16, 0, numel),), dst.nbytes, None)
        sent, got = d._Scratch(), d._Scratch()  # kept across calls, as a program keeps them
        with settings.overridden(triton_delta=kind == "triton"):
            for p in dens:
                times, wires = [], []
                for _ in range(iters):
                    k = int(p * numel)  # the trainer's step, not timed
                    idx = torch.randint(0, numel, (k,), device=dev, generator=g)
                    src[idx] = (src[idx].float() + 0.01).to(src.dtype)
                    _sync()
                    t0 = time.perf_counter()
                    enc, counts, payload = d._encode(msg_s, (0, 0), sent)
                    if enc == d.SPARSE:
                        d._apply(msg_r, counts, payload, got)
                    else:
                        d._unpack(msg_r, payload)
                    _sync()
                    times.append((time.perf_counter() - t0) * 1e3)
                    wires.append(payload.numel())
                exact = torch.equal(dst.view(torch.int16), src.to(torch.bfloat16).view(torch.int16)) and \
                    torch.equal(ref.view(torch.int16), dst.view(torch.int16))
                assert exact, f"{kind} at {p}: the destination or the reference differs from the source"
                ms = statistics.median(times)
                rows.append({"part": "gpu", "kernels": kind, "cast": cast, "delta_density": p,
                             "wire_bytes": max(wires), "full_bytes": dst.nbytes, "delta_ms": ms,
                             "full_ms": floor, "floor_ms": floor, "to_floor": ms / floor, "exact": exact,
                             "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"})
    return rows
