"""``watch="every"`` at a host cost that does not grow with the model: the native checks
built in the background (``torchrefit._native.build``).

A Refitter watching many tensors with no build for its environment starts one build per
machine and environment, keeps refitting with the Python checks meanwhile, and switches
to the native checks at the first refit after the build landed. After the switch, a
refit whose model did not change does no per-tensor work at the Python level (counted,
not timed: the checks' Python-visible calls are the same for 600 tensors as for 3000),
and a replaced or moved tensor is still followed (oracle: the source's tensors, read
directly). A failed build is recorded and not retried; a held lock means another process
builds; small models start nothing. The "build" here copies the module compiled once
per test run (``conftest.native_cache``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import torchrefit as tr
from torchrefit import settings
from torchrefit._native import build as background
from torchrefit._native import watch as native
from torchrefit.cli import main
from torchrefit.layout.binding import Binding
from torchrefit.refitter import _native_build
from torchrefit.testing import run_world


@pytest.fixture(scope="module")
def compiled(native_cache: str) -> Path:
    """The file of the native module compiled once per test run."""
    with settings.overridden(kernel_cache=native_cache):
        return native.built_path() / "torchrefit_native_watch.so"


@pytest.fixture
def empty_cache(monkeypatch: pytest.MonkeyPatch, tmp_path) -> Path:
    """A cache with nothing built, this process's record of builds forgotten."""
    monkeypatch.setenv("TORCHREFIT_KERNEL_CACHE", str(tmp_path / "kernels"))  # spawned ranks too
    monkeypatch.delenv(settings.ENV["native_watch"], raising=False)
    settings.reload()
    monkeypatch.setattr(background, "_started", {})
    where = native.built_path()
    assert native.module(fresh=True) is None
    return where


class _Wide(nn.Module):
    """``n`` small linear layers: 2n tensors a side, the shape of a MoE rank's many."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))


def _copying_builder(module_file: str, delay: float):
    """A stand-in for the compiler process: lands ``module_file`` where the build goes."""

    def spawn(where: Path) -> subprocess.Popen:
        target = where / module_file.rsplit("/", 1)[-1]
        code = (f"import time, shutil; time.sleep({delay}); "
                f"shutil.copy({module_file!r}, {str(target) + '.tmp'!r}); "
                f"import os; os.replace({str(target) + '.tmp'!r}, {str(target)!r}); "
                f"os.unlink({str(where / 'building.lock')!r})")
        return subprocess.Popen([sys.executable, "-c", code])

    return spawn


def _python_calls(fn) -> int:
    """Python-level calls and C calls made from Python while ``fn`` runs, with the
    per-tensor operations of the Python checks made Python functions (so that each
    tensor they visit counts, even inside ``map``)."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    data_ptr, is_set_to = torch.Tensor.data_ptr, torch.Tensor.is_set_to
    torch.Tensor.data_ptr = lambda t: data_ptr(t)
    torch.Tensor.is_set_to = lambda t, other: is_set_to(t, other)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        torch.Tensor.data_ptr, torch.Tensor.is_set_to = data_ptr, is_set_to
    return count


def _checks(r: tr.Refitter) -> None:
    """What ``refit()`` checks before its copies under ``watch="every"``."""
    r._rebind()
    for program in r._programs():
        assert not program.storage_moved()


def _switch_world(rank: int, world: int, module_file: str, cache: str) -> dict:
    os.environ["TORCHREFIT_KERNEL_CACHE"] = cache  # and for the builder it starts
    settings.reload()
    background._LOOK_EVERY_S = 0.0
    background._spawn = _copying_builder(module_file, delay=1.0)
    out: dict = {"wrong": []}
    counts = {}
    for n in (300, 1500):
        src, dst = _Wide(n), _Wide(n)
        r = tr.Refitter(src, dst)  # watch="every", the default
        out[f"waits {n}"] = r._native_build is not None
        r.refit()
        out[f"native at first {n}"] = r._program.compiled.native is not None
        deadline = time.monotonic() + 60
        while r._native_build is not None and time.monotonic() < deadline:
            time.sleep(0.05)
            r.refit()
        out[f"switched {n}"] = r._native_build is None
        out[f"native {n}"] = (r._program.compiled.native is not None
                              and all(b.native for b in r._bindings.values()))
        counts[n] = _python_calls(lambda r=r: _checks(r))
        out[f"python checks {n}"] = _python_calls(lambda r=r: _python_checks(r))
        _follow_changes(src, dst, r, out["wrong"])
    out["counts"] = counts
    return out


def _python_checks(r: tr.Refitter) -> None:
    """The same checks with the native ones set aside (the reference the count of the
    native path is compared with)."""
    held = [(b, b._native) for b in r._bindings.values()]
    compiled = r._program.compiled
    try:
        for b, _ in held:
            b._native = None
        r._program.compiled = replace(compiled, native=None)
        _checks(r)
    finally:
        for b, was in held:
            b._native = was
        r._program.compiled = compiled


def _follow_changes(src: _Wide, dst: _Wide, r: tr.Refitter, wrong: list[str]) -> None:
    def refit_and_compare(step: str) -> None:
        with torch.no_grad():
            for p in src.parameters():
                p.add_(1.0)
        r.refit()
        for (k, want), got in zip(src.state_dict().items(), dst.state_dict().values()):
            if not torch.equal(want, got):
                wrong.append(f"{k} after {step}")

    with torch.no_grad():
        dst.layers[-1].weight.data = torch.zeros(4, 4)  # the engine re-allocated its last weight
    refit_and_compare("the last destination weight moved")
    dst.layers[0].weight = nn.Parameter(torch.zeros(4, 4))  # replaced in its module
    refit_and_compare("the first destination weight replaced")
    with torch.no_grad():
        src.layers[-1].bias.data = src.layers[-1].bias.data.clone()  # the trainer's storage moved
    refit_and_compare("the last source bias moved")


def test_a_big_refitter_builds_in_the_background_then_checks_in_constant_python_work(
        compiled: Path, empty_cache: Path) -> None:
    (got,) = run_world(_switch_world, 1, str(compiled), str(empty_cache.parent.parent / "kernels"),
                       timeout=240)
    assert got["waits 300"] and not got["native at first 300"], got
    assert got["switched 300"] and got["native 300"], got
    # the second Refitter of the process finds the module built: nothing to wait for
    assert not got["waits 1500"] and got["native 1500"], got
    counts = got["counts"]
    assert counts[300] == counts[1500], f"the checks' Python-level work grew with the tensors: {counts}"
    # the reference: the Python checks visit each tensor (so the count above can fail)
    assert got["python checks 1500"] > got["python checks 300"] + 4000, got
    assert got["wrong"] == [], got["wrong"]


def test_small_models_and_the_off_switch_start_no_build(empty_cache: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    started = []
    monkeypatch.setattr(background, "_spawn", lambda where: started.append(where))
    few = _Wide(8)
    bindings = {"dst": Binding(few, dict(few.state_dict(keep_vars=True)), "dst")}
    assert _native_build("every", bindings) is None and not started
    many = _Wide(background.BUILD_MIN_TENSORS)
    bindings = {"dst": Binding(many, dict(many.state_dict(keep_vars=True)), "dst")}
    assert _native_build("manual", bindings) is None and not started
    settings.configure(native_watch=False)
    assert _native_build("every", bindings) is None and not started
    settings.configure(native_watch=True)
    assert _native_build("every", bindings) is not None and started == [empty_cache]


def test_one_build_per_environment_and_a_dead_builder_is_replaced(empty_cache: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    spawned = []
    monkeypatch.setattr(background, "_spawn", lambda where: spawned.append(where) or None)
    first = background.start_background_build()
    assert spawned == [empty_cache] and (empty_cache / "building.lock").exists()
    assert background.start_background_build() is first  # this process: the same one
    monkeypatch.setattr(background, "_started", {})  # as another process would see it
    other = background.start_background_build()
    assert other is not None and other.proc is None and spawned == [empty_cache]  # it waits, builds nothing
    old = time.time() - 2 * background._STALE_LOCK_S
    os.utime(empty_cache / "building.lock", (old, old))  # the builder died long ago
    monkeypatch.setattr(background, "_started", {})
    background.start_background_build()
    assert spawned == [empty_cache, empty_cache]


def test_a_failed_build_is_recorded_said_and_not_retried(empty_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    def no_compiler(verbose: bool = False):
        raise RuntimeError("c++ exited with 1: no such header")

    monkeypatch.setattr(native, "build", no_compiler)
    empty_cache.mkdir(parents=True)
    (empty_cache / "building.lock").touch()
    assert background.run_background_build() == 1
    assert not (empty_cache / "building.lock").exists()  # the lock is freed either way
    assert "no such header" in background.failure_marker(empty_cache).read_text()
    spawned = []
    monkeypatch.setattr(background, "_spawn", lambda where: spawned.append(where))
    assert background.start_background_build() is None and not spawned
    assert main(["native", "status"]) == 0
    assert "the last background build failed: RuntimeError: c++ exited with 1" in capsys.readouterr().out


def test_a_waiting_rank_gives_up_when_the_builder_left_nothing(empty_cache: Path) -> None:
    empty_cache.mkdir(parents=True)
    build = background.BackgroundBuild(empty_cache, None)  # another process held the lock; it is gone
    assert not build.ready() and build._gave_up


def test_without_a_compiler_nothing_starts(empty_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert background.start_background_build() is None


def test_the_build_goes_where_this_process_was_configured_to_keep_it(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache set by ``settings.configure`` (not the environment) reaches the child."""
    got = {}

    class Child:
        pid = 1

        def __init__(self, command, env, **kwargs) -> None:
            got.update(command=command, env=env)

    monkeypatch.setattr(background.subprocess, "Popen", Child)
    monkeypatch.delenv("TORCHREFIT_KERNEL_CACHE", raising=False)
    with tr.settings.overridden(kernel_cache=str(tmp_path / "configured")):
        background._spawn(native.built_path())
    assert got["env"]["TORCHREFIT_KERNEL_CACHE"] == str(tmp_path / "configured")
    assert got["command"][-3:] == ["native", "build", "--background"]
