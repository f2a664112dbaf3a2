"""Running a benchmark configuration on real processes and summarising it.

Each rank builds its source and destination models (toy Megatron-style models
filled on the device, or megatron-core ``GPTModel``s for ``--compare
megatron-core``), then for every variant: times construction plus the first
refit, warms up, times ``iters`` refits with the device idle before each, times
the host side while the GPU is busy, records peak extra device memory, and
verifies the result. With ``--stage``, one more row times, on one Refitter, plain
refits, then stages and the commit after each (the engine's stall), and compares
the commit with the copy floor of the bytes it copies. Rows are per variant; times
are the slowest rank's per iteration.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.distributed as dist

from ..execute.kernels import fp8_blocks
from ..plan.types import itemsize
from ..testing import build_toy, run_world
from ..testing.toy import global_table
from ..transport.base import transport_class
from .config import VARIANTS, BenchConfig
from .hf_models import build_hf_destination
from .megatron_models import build_megatron_gpt, megatron_available, megatron_swap
from .timing import copy_bandwidth, device_times, host_times, link_bandwidth, summarize, time_calls

__all__ = ["run_bench", "backend_for", "rank_device", "FP8_BLOCK"]

FP8_BLOCK = (128, 128)


def backend_for(cfg: BenchConfig) -> str:
    if not torch.cuda.is_available():
        return "gloo"
    if cfg.transport == "gloo" or cfg.nproc > torch.cuda.device_count():
        return "gloo"
    if cfg.transport not in ("auto", "nccl") and transport_class(cfg.transport).backend == "gloo":
        # one-sided control messages and nvshmem's bootstrap over gloo, the link measurement over nccl
        return "cpu:gloo,cuda:nccl"
    return "nccl"


def run_bench(cfg: BenchConfig) -> list[dict]:
    """Run ``cfg`` on ``cfg.nproc`` processes; one summary row per variant (and megatron-core)."""
    if cfg.compare == "megatron-core" and not megatron_available():
        raise RuntimeError("--compare megatron-core needs megatron-core installed")
    if cfg.compare == "megatron-core" and cfg.src != cfg.dst:
        raise ValueError("--compare megatron-core runs with equal source and destination layouts")
    per_rank = run_world(_bench_rank, cfg.nproc, cfg, backend=backend_for(cfg), timeout=1800,
                         pg_timeout=600)
    return _aggregate(cfg, per_rank)


def rank_device(rank: int) -> torch.device:
    """The device a bench rank runs on: its own GPU where there are enough, else
    GPUs shared round-robin; the CPU without one."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _models(cfg: BenchConfig, rank: int, device: torch.device):
    src_mesh, dst_mesh = cfg.meshes()
    if cfg.compare == "megatron-core":
        layout = {"tp": src_mesh.tp, "pp": src_mesh.pp}
        return build_megatron_gpt(cfg.spec, seed=1, **layout), build_megatron_gpt(cfg.spec, seed=2, **layout)
    src = build_toy(cfg.spec, src_mesh, rank, seed=1, device=device, random_init=True)
    if cfg.name_map == "hf":
        return src, build_hf_destination(cfg.spec, device, fp8=cfg.fp8, block=FP8_BLOCK)
    dst = build_toy(cfg.spec, dst_mesh, rank, seed=2, device=device, random_init=True)
    return src, dst


def _bench_rank(rank: int, world: int, cfg: BenchConfig) -> dict:
    import torchrefit as tr

    if cfg.settings is not None:
        tr.settings.configure(**dataclasses.asdict(cfg.settings))
    device = rank_device(rank)
    src, dst = _models(cfg, rank, device)
    # measured once every rank is idle: processes sharing a GPU would otherwise build
    # models during the measurement and lower the floor's bandwidth (a barrier alone
    # leaves their queued initialisation running)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    bandwidth = copy_bandwidth(device) if rank == 0 else None
    dist.barrier()
    link = link_bandwidth(device) if _one_gpu_each(cfg) else None
    out = {"rows": [], "bandwidth": bandwidth, "link": link, **_model_size(cfg, src),
           "dst_bytes": sum(t.nbytes for t in dst.parameters()) if dst is not None else 0}
    order = [v for v in cfg.variants if v != "share"]
    for variant in order:
        out["rows"].append(_time_refitter(tr, src, dst, cfg, variant, device))
    if cfg.compare == "megatron-core":
        out["rows"].append(_time_megatron(src, dst, cfg, device))
    if cfg.stage:
        out["rows"].append(_time_staged(tr, src, dst, cfg, device))
    if "share" in cfg.variants:  # last: aliasing rewires the destination model
        out["rows"].append(_time_refitter(tr, src, dst, cfg, "share", device))
    if cfg.nproc == 1 and out["rows"] and out["rows"][0].get("bytes_local"):
        out["flat_copy"] = _time_flat_copy(out["rows"][0]["bytes_local"], cfg, device)
    return out


def _one_gpu_each(cfg: BenchConfig) -> bool:
    """Several processes, each on its own GPU: a link between GPUs can be measured."""
    return cfg.nproc > 1 and torch.cuda.is_available() and cfg.nproc <= torch.cuda.device_count()


def _model_size(cfg: BenchConfig, src) -> dict:
    """Parameters and bytes of the whole (global) source model."""
    if cfg.compare == "megatron-core":  # equal layouts, TP1 in practice: local is global
        params = sum(p.numel() for p in src.parameters()) if src is not None else 0
    else:
        params = sum(math.prod(d.shape) for d in global_table(cfg.spec).values() if not d.buffer)
    return {"params": params, "model_bytes": params * cfg.spec.dtype.itemsize}



def _memory(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _measure(first, again, cfg: BenchConfig, device: torch.device, host_when) -> dict:
    """The one timing protocol for every implementation: ``first()`` (construction plus
    the first refit) timed from aligned ranks to finished device work, then
    ``cfg.iters`` timed calls of ``again`` after warm-up, host time while the GPU is
    busy where ``host_when()`` says it is meaningful, and peak extra device memory."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    base = _memory(device)
    dist.barrier()
    t0 = time.perf_counter()
    first()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first_s = time.perf_counter() - t0
    times = time_calls(again, cfg.warmup, cfg.iters, device)
    hosts, cold = host_times(again, cfg.iters, device) if host_when() else ([], [])
    devices = device_times(again, cfg.iters, device) if host_when() else []
    peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else 0
    return {"times": times, "hosts": hosts, "hosts_cold": cold, "devices": devices, "first_refit_s": first_s,
            "peak_extra_bytes": peak}


def _time_flat_copy(nbytes: int, cfg: BenchConfig, device: torch.device) -> dict | None:
    """One copy of a refit's local bytes between two flat buffers, timed as refits are
    (:func:`time_calls`: device idle before each call, wall time to finished work) and
    as device time alone: the least a call that moves these bytes costs, launch and
    synchronisation included, where the copy floor (a 4 GiB copy's bandwidth) leaves
    them out. None where two more buffers of that size do not fit the device. Measured
    last on the rank (the buffers stay in the caching allocator until the process ends)."""
    if device.type != "cuda" or torch.cuda.mem_get_info(device)[0] < 2 * nbytes + (2 << 30):
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    return {"bytes": nbytes, "times": time_calls(copy, cfg.warmup, cfg.iters, device),
            "devices": device_times(copy, cfg.iters, device)}


def _time_refitter(tr, src, dst, cfg: BenchConfig, variant: str, device: torch.device) -> dict:
    made: dict = {}

    def first() -> None:
        kwargs = dict(VARIANTS[variant], watch=cfg.watch)
        if cfg.name_map == "hf":
            s = cfg.spec
            kwargs["name_map"] = tr.maps.megatron_to_hf(num_heads=s.heads, num_query_groups=s.groups)
            kwargs["fp8_block"] = FP8_BLOCK
        made["r"] = tr.Refitter(src, dst, transport=cfg.transport, **kwargs)
        made["report"] = made["r"].refit()

    def local_only() -> bool:
        return cfg.nproc == 1 and not made["r"].plan.sends and not made["r"].plan.recvs

    row = _measure(first, lambda: made["r"].refit(), cfg, device, local_only)
    refitter, report = made["r"], made["report"]
    refitter.verify()
    # which path this rank's local copies took (execute.batched's and elementwise_copies' rules)
    local = refitter._program.local if refitter._program is not None else None
    row.update({"large_local_copies": len(local.big) if local else 0,
                "large_local_copies_as_kernels": sum(w is not None for w in local.words) if local else 0,
                "batched_local_copies": len(local.batch.dst) if local and local.batch else 0})
    row.update({"impl": "torchrefit", "variant": variant, "transport": refitter.transport_name,
                "watch": refitter.watch, "settings": dataclasses.asdict(tr.settings.current()),
                "pool_bytes": report.pool_bytes, "bytes_local": report.bytes_local,
                "bytes_sent": report.bytes_sent, "bytes_received": report.bytes_received,
                "shared_tensors": report.shared_tensors, "plan_seconds": refitter.plan_seconds,
                "fp8_on_sender": report.fp8_on_sender, "fp8_on_receiver": report.fp8_on_receiver,
                "fp8_kernel": fp8_blocks.variant() if cfg.fp8 else None,
                # source bytes FP8 steps read (the local copies' are in bytes_local)
                "bytes_quantize_read": sum(q.region.numel * itemsize(q.src_dtype)
                                           for q in refitter.plan.quantize if not q.received)})
    refitter.close()
    return row


def _time_staged(tr, src, dst, cfg: BenchConfig, device: torch.device) -> dict:
    """One Refitter: ``iters`` plain refits (``times``), then ``iters`` stages each
    followed by its commit, each call timed from aligned ranks and an idle device to
    finished device work. A commit is local: ``commit_times`` are this rank's, with the
    bytes it copied (zero on a source-only rank)."""
    made: dict = {}
    kwargs = dict(VARIANTS["graph" if device.type == "cuda" else "plain"], watch=cfg.watch,
                  staging=cfg.staging)

    def first() -> None:
        made["r"] = tr.Refitter(src, dst, transport=cfg.transport, **kwargs)
        made["r"].refit()

    row = _measure(first, lambda: made["r"].refit(), cfg, device, lambda: False)
    r = made["r"]
    committed: list = []
    stage_times = time_calls(r.stage, cfg.warmup, cfg.iters, device)  # warm-up: compiles, allocates
    commit_times = []
    for i in range(cfg.warmup + cfg.iters):  # each commit right after its own stage
        r.stage()
        t = time_calls(lambda: committed.append(r.commit()), 0, 1, device)[0]
        if i >= cfg.warmup:
            commit_times.append(t)
    r.verify()  # the source did not change since: the last commit installed it whole
    row.update({"impl": "torchrefit", "variant": f"stage ({cfg.staging})", "transport": r.transport_name,
                "watch": r.watch, "staging": cfg.staging, "stage_times": stage_times,
                "commit_times": commit_times, "commit_bytes": committed[-1].bytes_committed,
                "staged_bytes": committed[-1].staging_bytes, "pool_bytes": 0,
                "bytes_local": r.plan.bytes_local,
                "bytes_sent": r.plan.bytes_sent, "bytes_received": r.plan.bytes_received,
                "plan_seconds": r.plan_seconds})
    r.close()
    return row


def _time_megatron(src, dst, cfg: BenchConfig, device: torch.device) -> dict:
    method = "gloo" if cfg.transport == "gloo" else "nccl"

    def swap() -> None:
        megatron_swap(src, dst, method)

    row = _measure(swap, swap, cfg, device, lambda: cfg.nproc == 1)
    row.update({"impl": "megatron-core", "variant": "swap_model_weights", "transport": method})
    return row


def _aggregate(cfg: BenchConfig, per_rank: list[dict]) -> list[dict]:
    bandwidth = per_rank[0]["bandwidth"]
    rows = []
    for i, row0 in enumerate(per_rank[0]["rows"]):
        ranks = [r["rows"][i] for r in per_rank]
        times = [max(t) for t in zip(*(r["times"] for r in ranks))]  # slowest rank per iteration
        row = {k: v for k, v in row0.items() if k not in ("times", "hosts", "hosts_cold", "devices",
                                                         "stage_times", "commit_times")}
        row.update(summarize(times))
        devices = [d for r in ranks for d in r.get("devices", ())]
        row["device_ms"] = summarize(devices)["median_ms"] if devices else None
        for key, samples in (("host_ms", "hosts"), ("host_cold_ms", "hosts_cold")):
            hosts = [h for r in ranks for h in r[samples]]
            row[key] = summarize(hosts)["median_ms"] if hosts else None
        row["first_refit_s"] = max(r["first_refit_s"] for r in ranks)
        row["peak_extra_bytes"] = max(r["peak_extra_bytes"] for r in ranks)
        if "stage_times" in row0:
            row.update(_staged_fields(ranks, times, bandwidth))
        if "bytes_local" in row0:  # every remote byte counted once, where it is sent
            row["bytes_local"] = sum(r["bytes_local"] for r in ranks)
            row["bytes_remote"] = sum(r["bytes_sent"] for r in ranks)
            row["pool_bytes"] = max(r["pool_bytes"] for r in ranks)
            row["per_rank_bytes"] = [(r["bytes_local"], r["bytes_sent"], r["bytes_received"]) for r in ranks]
        rows.append(row)
    base = _shape_fields(cfg, per_rank, bandwidth)
    link = per_rank[0].get("link")
    base["link_bandwidth_gbs"] = link / 1e9 if link else None
    torch_rows = [r for r in rows if r["impl"] == "torchrefit"]
    floor_ms, note = _floor_ms(cfg, torch_rows[0] if torch_rows else None, bandwidth, link)
    if cfg.name_map and floor_ms is not None and cfg.nproc == 1:
        # a mapped (and quantized) engine: read the source's bytes once, write the
        # engine's (FP8 values and scales where quantized) once
        read = torch_rows[0]["bytes_local"] + torch_rows[0].get("bytes_quantize_read", 0)
        floor_ms = (read + per_rank[0]["dst_bytes"]) / bandwidth * 1e3
        note = "HBM floor: source bytes read + engine bytes written (FP8 and scales), one GPU"
    meg = next((r for r in rows if r["impl"] == "megatron-core"), None)
    flat = _flat_copy_fields(per_rank[0].get("flat_copy"))
    for r in rows:
        r.update(base)
        r.update(flat)
        r["floor_ms"], r["floor_note"] = floor_ms, note
        r["ratio_to_floor"] = r["median_ms"] / floor_ms if floor_ms else None
        r["device_ratio_to_floor"] = r["device_ms"] / floor_ms if floor_ms and r["device_ms"] else None
        flat_ms = flat.get("flat_copy_ms")
        r["ratio_to_flat_copy"] = r["median_ms"] / flat_ms if flat_ms else None
        r["link_utilization"] = _link_utilization(torch_rows[0], link, r["median_ms"]) if torch_rows else None
        if meg is not None and r["impl"] == "torchrefit":
            r["megatron_median_ms"] = meg["median_ms"]
            r["ratio_to_megatron"] = r["median_ms"] / meg["median_ms"]
    return rows


def _staged_fields(ranks: list[dict], refit_times: list[float], bandwidth: float | None) -> dict:
    """The stage row's figures: the plain refit's, the stage's (slowest rank per
    iteration) and the commit's (slowest committing rank per iteration: the engine's
    stall), and on a GPU with device staging the commit over the copy floor of the bytes
    it copies (read once, written once, at the copy bandwidth measured in this run)."""
    stage = [max(t) for t in zip(*(r["stage_times"] for r in ranks))]
    engines = [r for r in ranks if r["commit_bytes"]] or ranks
    commit = [max(t) for t in zip(*(r["commit_times"] for r in engines))]
    out = {"refit_ms": summarize(refit_times)["median_ms"], "stage_ms": summarize(stage)["median_ms"],
           "commit_ms": summarize(commit)["median_ms"], "commit_min_ms": min(commit) * 1e3,
           "commit_bytes": max(r["commit_bytes"] for r in ranks),
           "staged_bytes": max(r["staged_bytes"] for r in ranks)}
    out["refit_over_commit"] = out["refit_ms"] / out["commit_ms"] if out["commit_ms"] else None
    floor = None
    if bandwidth and torch.cuda.is_available() and ranks[0]["staging"] == "device":
        floor = 2 * out["commit_bytes"] / bandwidth * 1e3
    out["commit_floor_ms"] = floor
    out["commit_to_floor"] = out["commit_ms"] / floor if floor else None
    return out


def _flat_copy_fields(flat: dict | None) -> dict:
    if not flat:
        return {}
    return {"flat_copy_bytes": flat["bytes"], "flat_copy_ms": summarize(flat["times"])["median_ms"],
            "flat_copy_device_ms": summarize(flat["devices"])["median_ms"] if flat["devices"] else None}


def _link_utilization(row: dict, link: float | None, median_ms: float) -> float | None:
    """Fraction of the link's measured bandwidth the busiest GPU's remote bytes achieved."""
    busiest = max((max(sent, received) for _, sent, received in row["per_rank_bytes"]), default=0)
    if not link or not busiest:
        return None
    return busiest / link / (median_ms / 1e3)


def _floor_ms(cfg: BenchConfig, row: dict | None, hbm: float | None, link: float | None):
    """The time no refit can beat, and how it was derived.

    One GPU per process: per GPU, the larger of its local bytes read and written over
    the HBM copy bandwidth and its remote bytes (the larger direction) over the link's
    per-direction bandwidth; the slowest GPU sets the floor. Several processes on one
    GPU share its memory bandwidth and have no link: all-local refits, and one-sided
    refits (ipc, nixl: every received byte is then read and written once in that
    GPU's memory too), get the HBM floor of all their bytes; over rounds, none.
    """
    if row is None or not hbm:
        return None, "no torchrefit row"
    per_rank = row["per_rank_bytes"]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.nproc == 1 or (gpus and cfg.nproc > gpus):
        moved = sum(local + received for local, _, received in per_rank)
        if transport_class(row["transport"]).protocol == "one_sided":
            return 2 * moved / hbm * 1e3, f"HBM copy floor of every byte (local and {row['transport']}), one GPU"
        if any(sent or received for _, sent, received in per_rank):
            return None, "no floor: remote bytes between processes that share one device"
        return 2 * moved / hbm * 1e3, "HBM copy floor of the local bytes"
    if link is None:
        return None, "no floor: no link bandwidth measured"
    per_gpu = [max(2 * local / hbm, max(sent, received) / link) for local, sent, received in per_rank]
    return max(per_gpu) * 1e3, "per GPU max(2 x local / HBM copy bandwidth, remote / link bandwidth)"


def _shape_fields(cfg: BenchConfig, per_rank: list[dict], bandwidth: float | None) -> dict:
    s = cfg.spec
    return {
        "label": cfg.label or f"{cfg.src}->{cfg.dst} {cfg.mode}",
        "src": cfg.src, "dst": cfg.dst, "mode": cfg.mode, "world": cfg.nproc,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "shape": {"layers": s.layers, "hidden": s.hidden, "heads": s.heads, "kv_heads": s.groups,
                  "ffn": s.ffn, "vocab": s.vocab, "experts": s.experts, "dtype": str(s.dtype).removeprefix("torch."),
                  "swiglu": s.swiglu, "tie": s.tie},
        "params": max(r["params"] for r in per_rank),
        "model_bytes": max(r["model_bytes"] for r in per_rank),
        "copy_bandwidth_gbs": bandwidth / 1e9 if bandwidth else None,
        "name_map": cfg.name_map, "fp8": cfg.fp8, "dst_bytes": per_rank[0].get("dst_bytes"),
        "warmup": cfg.warmup, "iters": cfg.iters,
    }
