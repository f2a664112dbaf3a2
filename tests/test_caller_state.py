"""A caller's torch function modes and inference mode (``torchrefit._util.caller_state``).

One world of two gloo processes, a TP2 trainer into a TP1 engine (local copies and
messages both), with the models built first and then, on every rank:

* ``torch.set_default_device("meta")`` around construction, two refits, ``verify()`` and
  ``rebind()``, for every transport usable on CPU here (gloo, and nixl where installed):
  a tensor torchrefit made without naming its device would be a meta tensor (its
  one-sided control messages were: one rank failed, its peer waited forever). The
  engine must hold the oracle's values (``expected_local``) afterwards;
* a counting ``TorchFunctionMode`` around the same calls sees none of torchrefit's own
  torch calls (each would cost a Python call: with ``torch.set_default_device`` a
  qwen3-shaped toy's first refit took twice as long, and each refit 9 ms more);
* the caller's code that torchrefit calls back, a custom layout adapter and a
  ``load_weights`` sink's ``load_weights``, runs with the caller's modes in place (its
  factory calls land on the caller's default device) and in the caller's inference
  mode, and the sink still receives the source's values (the oracle: ``global_value``);
* ``torch.inference_mode()`` around construction, the first refit and ``verify()``, then
  refits and ``verify()`` outside it, then inside again, and the other way round, for
  every transport: what torchrefit keeps (staging, attached peer tables) was made as
  inference tensors, which a later refit outside inference mode could not write
  ("Inplace update to inference tensor outside InferenceMode");
* an engine built inside inference mode (inference-tensor weights, which only inference
  mode may write), built into a Refitter and refitted inside it: copies into it, and
  capturing them in a CUDA graph while compiling, run in the caller's mode;
* ``torch.use_deterministic_algorithms(True)`` around construction, refits and
  ``verify()`` (reproducible RL runs set it; an op without a deterministic
  implementation would raise), for every transport;
* weights that require grad on both sides, refitted with grad mode on (and once under
  ``torch.no_grad()``): the caller's grad mode is as it was after every call.

On a GPU (marked ``gpu``): the default-device, inference-mode, inference-engine and
deterministic cases
again with both models on GPU 0 (where the batched copy kernel builds its tables), for
every transport usable on CUDA tensors here (ipc twice: taking turns and with one
delegate copying for both).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import torchrefit as tr
from torchrefit import settings
from torchrefit.layout import megatron
from torchrefit.testing import (
    Mesh,
    ModelSpec,
    build_toy,
    expected_local,
    run_world,
    usable_transports,
)
from torchrefit.testing.toy import global_table, global_value

SPEC = ModelSpec(layers=2, experts=4)
SRC, DST = Mesh(2, ranks=2), Mesh(1, ranks=2)


class Counting(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _pair(rank: int, device: str) -> tuple[nn.Module, nn.Module]:
    return (build_toy(SPEC, SRC, rank, seed=1).to(device), build_toy(SPEC, DST, rank, seed=2).to(device))


def _wrong(dst, rank: int) -> list[str]:
    want = expected_local(SPEC, DST, rank, 1)
    return sorted(k for k, v in dst.state_dict().items() if not torch.equal(v.cpu(), want[k]))


def _all_calls(r: tr.Refitter) -> None:
    r.refit()
    r.refit()
    r.verify()
    r.rebind()


@contextmanager
def _meta_default():
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


@contextmanager
def _deterministic_algorithms():
    """As reproducible RL runs set it: an op torchrefit ran without a deterministic
    implementation would raise."""
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _refitted_under(state, rank: int, transport: str, device: str = "cpu") -> list[str]:
    """Build, refit twice, verify and rebind inside ``state()``; what the engine got wrong."""
    src, dst = _pair(rank, device)
    with state():
        r = tr.Refitter(src, dst, transport=transport, timeout=30)
        _all_calls(r)
        r.close()
    return _wrong(dst, rank)


def _inference_engine(rank: int, transport: str, device: str = "cpu") -> list[str]:
    """An engine built inside inference mode (its weights are inference tensors, which
    only inference mode may write), refitted inside it: its copies, and capturing them in
    a CUDA graph while compiling, must run in the caller's mode (a failed capture warns
    and falls back to eager copies: that warning fails the case too)."""
    src = build_toy(SPEC, SRC, rank, seed=1).to(device)
    with torch.inference_mode():
        dst = build_toy(SPEC, DST, rank, seed=2).to(device)
    with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
        warnings.simplefilter("always")
        r = tr.Refitter(src, dst, transport=transport, timeout=30)
        _all_calls(r)
        r.close()
    return _wrong(dst, rank) + [str(w.message) for w in caught if "capture" in str(w.message)]


def _grad_mode(rank: int, transport: str) -> list[str]:
    """Weights that require grad on both sides (a trainer's, an engine built for training):
    the engine gets the source's values, and after each call the caller's grad mode is
    as it was (``Program.run`` switches it off around the copies and back by hand)."""
    src, dst = _pair(rank, "cpu")
    for p in (*src.parameters(), *dst.parameters()):
        p.requires_grad_(True)
    r = tr.Refitter(src, dst, transport=transport, timeout=30)
    seen = []
    for call in (r.refit, r.refit, r.verify, r.rebind):
        call()
        seen.append(torch.is_grad_enabled())
    with torch.no_grad():
        r.refit()
        seen.append(torch.is_grad_enabled())
    r.close()
    kept = seen == [True, True, True, True, False]
    return ([] if kept else [f"grad mode after refit, refit, verify, rebind, refit under no_grad: {seen}"]) \
        + _wrong(dst, rank)


def _counted(rank: int) -> tuple[int, list[str]]:
    mode = Counting()
    wrong = _refitted_under(lambda: mode, rank, "auto")
    return mode.calls, wrong


def _where() -> tuple[int, str, bool]:
    """What the caller's code sees: modes on the stack, where a new tensor goes, and
    whether it runs in inference mode."""
    return torch._C._len_torch_function_stack(), torch.empty(0).device.type, torch.is_inference_mode_enabled()


def _inference(rank: int, transport: str, first_inside: bool, device: str = "cpu") -> list[str]:
    src, dst = _pair(rank, device)
    with torch.inference_mode(first_inside):
        r = tr.Refitter(src, dst, transport=transport, timeout=30)
        r.refit()
        r.verify()
    with torch.inference_mode(not first_inside):
        _all_calls(r)
    with torch.inference_mode(first_inside):  # and back: what the other mode made, used here
        r.refit()
        r.verify()
    r.close()
    return _wrong(dst, rank)


def _callbacks(rank: int) -> dict:
    src = build_toy(SPEC, SRC, rank, seed=1)
    seen, got = [], {}

    def adapter(model):
        seen.append(("adapter", *_where()))
        return megatron(model)

    def load_weights(weights) -> None:
        seen.append(("load_weights", *_where()))
        got.update((name, t.clone()) for name, t in weights)

    table = {n: d for n, d in global_table(SPEC).items() if d.persistent}
    sink = tr.load_weights_sink(load_weights, [(n, d.shape, torch.float32) for n, d in table.items()],
                                bucket_bytes=1 << 14, device="cpu")
    torch.set_default_device("meta")
    try:
        with torch.inference_mode():
            r = tr.Refitter(src, nn.Module(), src_layout=adapter, dst_layout=sink, timeout=30)
            r.refit()
        inside, seen[:] = sorted(set(seen)), []
        got.clear()
        r.refit()  # outside inference mode: into the sink buffer made at construction
        r.close()
    finally:
        torch.set_default_device(None)
    wrong = sorted(n for n, d in table.items()
                   if n not in got or not torch.equal(got[n], global_value(n, d.shape, 1, SPEC)))
    return {"inside": inside, "outside": sorted(set(seen)), "wrong": wrong, "delivered": len(got),
            "wanted": len(table)}


def _world(rank: int, world: int, transports: list[str]) -> dict:
    return {"meta": {t: _refitted_under(_meta_default, rank, t) for t in transports}, "counted": _counted(rank),
            "callbacks": _callbacks(rank),
            "inference": {(t, first): _inference(rank, t, first) for t in transports for first in (True, False)},
            "deterministic": {t: _refitted_under(_deterministic_algorithms, rank, t) for t in transports},
            "grad mode": {t: _grad_mode(rank, t) for t in transports},
            "inference engine": {t: _inference_engine(rank, t) for t in transports}}


def test_caller_function_modes() -> None:
    transports = usable_transports(False)
    for rank, out in enumerate(run_world(_world, 2, transports, timeout=240, pg_timeout=60)):
        for transport, wrong in out["meta"].items():
            assert not wrong, f"rank {rank}, {transport}, default device meta: wrong {wrong[:5]}"
        calls, wrong = out["counted"]
        assert not wrong, f"rank {rank}: wrong under a counting mode: {wrong[:5]}"
        assert calls < 10, f"rank {rank}: the caller's mode saw {calls} of torchrefit's torch calls"
        cb = out["callbacks"]
        assert not cb["wrong"] and cb["delivered"] == cb["wanted"], (rank, cb)
        # each callback ran with the caller's one mode, its default device, in inference mode
        assert cb["inside"] == [("adapter", 1, "meta", True), ("load_weights", 1, "meta", True)], (rank, cb)
        assert cb["outside"] == [("load_weights", 1, "meta", False)], (rank, cb)
        for (transport, first), wrong in out["inference"].items():
            assert not wrong, f"rank {rank}, {transport}, inference mode first {first}: wrong {wrong[:5]}"
        for case in ("deterministic", "inference engine", "grad mode"):
            for transport, wrong in out[case].items():
                assert not wrong, f"rank {rank}, {transport}, {case}: wrong {wrong[:5]}"


def _gpu_world(rank: int, world: int, transport: str) -> dict:
    """``"ipc:delegate"``: ipc with one copier for both ranks, plain ``"ipc"`` taking turns."""
    transport, _, order = transport.partition(":")
    settings.configure(delegate_copies=order == "delegate")
    torch.cuda.set_device(0)
    return {"meta": _refitted_under(_meta_default, rank, transport, "cuda"),
            "deterministic": _refitted_under(_deterministic_algorithms, rank, transport, "cuda"),
            "inference engine": _inference_engine(rank, transport, "cuda"),
            **{f"inference first {first}": _inference(rank, transport, first, "cuda") for first in (True, False)}}


GPU_TRANSPORTS = usable_transports(cuda=True) if torch.cuda.is_available() else ["ipc"]
GPU_TRANSPORTS += ["ipc:delegate"] if "ipc" in GPU_TRANSPORTS else []


@pytest.mark.gpu
@pytest.mark.parametrize("transport", GPU_TRANSPORTS)
def test_caller_state_two_processes_one_gpu(transport: str) -> None:
    """The same on one GPU shared by two processes, where what is kept also holds CUDA
    graphs, the batched copy kernel's tables and (ipc) a peer's mapped memory."""
    for rank, cases in enumerate(run_world(_gpu_world, 2, transport, timeout=240, pg_timeout=60)):
        for name, wrong in cases.items():
            assert not wrong, f"rank {rank}, {transport}, {name}: wrong {wrong[:5]}"
