"""What a megatron-core GPTModel of the seed's shape adds over the toy model, and how fast
each of its local copies runs (one GPU): buffers, non-contiguous or casting copies, and the
slowest copies by achieved bandwidth."""

import os

import torch
import torch.distributed as dist

import torchrefit as tr
from torchrefit.bench.config import spec_from_preset
from torchrefit.bench.megatron_models import build_megatron_gpt

if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    spec = spec_from_preset("gpt-4b")
    src, dst = build_megatron_gpt(spec, seed=1), build_megatron_gpt(spec, seed=2)
    for name, b in src.named_buffers():
        print(f"buffer {name} {tuple(b.shape)} {b.dtype} contiguous={b.is_contiguous()}")
    odd = [(n, tuple(p.shape), p.stride()) for n, p in src.named_parameters() if not p.is_contiguous()]
    print("non-contiguous params:", odd[:5])
    r = tr.Refitter(src, dst)
    r.refit()
    prog = r._program
    print(f"{len(r.plan.local)} local copies, {len(prog._big)} large, {len(prog._small_dst)} small, "
          f"{r.plan.bytes_local / 1e9:.3f} GB")
    rates = []
    for d, s, name in prog._big:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        d.copy_(s)
        start.record()
        for _ in range(5):
            d.copy_(s)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / 5
        nbytes = d.numel() * d.element_size()
        rates.append((2 * nbytes / ms / 1e6, ms, nbytes, name, d.is_contiguous(), s.is_contiguous(), d.dtype, s.dtype))
    rates.sort()
    for rate, ms, nbytes, name, dc, sc, dd, sd in rates[:6] + rates[-2:]:
        print(f"{rate:8.0f} GB/s {ms:7.3f} ms {nbytes / 1e6:9.1f} MB {name} contiguous={dc}/{sc} {dd}/{sd}")
    print("total of single copies ms", sum(r[1] for r in rates))
