"""What a kernel family's first use costs in a fresh process (CUDA lazy module loading).

With ``CUDA_MODULE_LOADING=LAZY`` (CUDA's default) a kernel's module is loaded on its
first launch, or when a graph that holds it is instantiated. The eighteenth session's
H100 profile put most of a delegate's first refit there (``capture_end`` 0.33 s as is,
0.07 s with ``EAGER``). Here each kernel family a refit graph may hold runs first in a
process of its own, CUDA already initialised: eagerly (first and second call, synchronised)
and captured into a CUDA graph (capture, ``capture_end``'s instantiation, first replay).
The family whose first use costs tenths of a second is what a first refit pays.

    python benchmarks/lazy_loading_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CASES = ("memcpy", "foreach_copy_bf16", "foreach_copy_f32", "strided_c128", "strided_bf16", "bitwise_or_i64",
         "fill_i32", "batched_kernel")
MODES = ("eager", "graph")
_EXTRA: dict = {}  # what a case's setup measured (the batched kernel: compiling or reading it)


def _op(case: str):
    import torch
    dev = torch.device("cuda")
    if case == "memcpy":
        a, b = torch.empty(1 << 20, device=dev), torch.empty(1 << 20, device=dev)
        return lambda: a.copy_(b)
    if case.startswith("foreach_copy"):
        dt = torch.bfloat16 if case.endswith("bf16") else torch.float32
        xs = [torch.empty(4096, dtype=dt, device=dev) for _ in range(64)]
        ys = [torch.empty(4096, dtype=dt, device=dev) for _ in range(64)]
        return lambda: torch._foreach_copy_(xs, ys)
    if case.startswith("strided"):
        dt = torch.complex128 if case.endswith("c128") else torch.bfloat16
        full = torch.empty(512, 1024, dtype=dt, device=dev)
        half = torch.empty(512, 512, dtype=dt, device=dev)
        return lambda: full[:, :512].copy_(half)
    if case == "bitwise_or_i64":
        a, b = torch.empty(1 << 16, dtype=torch.int64, device=dev), torch.empty(1 << 16, dtype=torch.int64, device=dev)
        return lambda: torch.bitwise_or(b, 0, out=a)
    if case == "fill_i32":
        a = torch.empty(16, dtype=torch.int32, device=dev)
        return lambda: a.fill_(1)
    if case == "batched_kernel":
        from torchrefit.execute.copy_kernel import copy_kernel
        a, b = torch.empty(1 << 20, dtype=torch.uint8, device=dev), torch.empty(1 << 20, dtype=torch.uint8, device=dev)
        t0 = time.perf_counter()
        k = copy_kernel(dev)
        table = k.tiles([(a.data_ptr(), b.data_ptr(), a.nbytes)], dev)
        torch.cuda.synchronize()
        _EXTRA.update(kernel_load_s=time.perf_counter() - t0, cached=k.cached)
        return lambda: k.launch(table, torch.cuda.current_stream())
    raise ValueError(case)


def _child(case: str, mode: str) -> dict:
    import torch
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    op = _op(case)
    torch.cuda.synchronize()
    out = {"case": case, "mode": mode, **_EXTRA}
    if mode == "eager":
        for name in ("first_s", "second_s"):
            t0 = time.perf_counter()
            op()
            torch.cuda.synchronize()
            out[name] = time.perf_counter() - t0
        return out
    from mapped_capture_lab import timed_capture  # benchmarks/ is this script's sys.path[0]
    out.update(timed_capture(op))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--child", nargs=2, metavar=("CASE", "MODE"))
    a = p.parse_args()
    if a.child:
        print(json.dumps(_child(*a.child)))
        return
    rows = []
    for case in CASES:
        for mode in MODES:
            r = subprocess.run([sys.executable, __file__, "--child", case, mode], capture_output=True, text=True,
                               timeout=120)
            lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
            row = json.loads(lines[-1]) if lines else {"case": case, "mode": mode, "error": r.stderr[-300:]}
            rows.append(row)
            print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
