"""The settings in one place (``torchrefit.settings``).

* the defaults are the documented ones, and the module's table names every field, with
  its environment variable where it has one;
* the environment overrides only the deployment settings, parsed as documented
  (``0``/``1`` switches, seconds, paths), and a value that cannot be read raises naming
  the variable;
* ``configure`` validates at once, names unknown settings, and leaves the settings as
  they were when it refuses; ``overridden`` restores them after its block, also after
  an exception; ``reload`` forgets what code changed and reads the environment again;
* nothing else in the package reads a ``TORCHREFIT_*`` variable: every one named in
  ``src/`` is one of ``ENV``'s, at most eight of them.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from torchrefit import settings

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "torchrefit"


def test_defaults_and_the_table() -> None:
    s = settings.Settings()
    assert (s.transport, s.kernel_cache, s.nvrtc, s.nvshmem_shared_gpu, s.nixl_timeout, s.mailbox,
            s.native_watch) == ("", "", "", False, None, True, True)
    assert (s.branches, s.sm_copy_below, s.batched_copy, s.delegate_copies) == (8, None, "auto", True)
    table = settings.__doc__
    for f in dataclasses.fields(settings.Settings):
        row = next((line for line in table.splitlines() if line.startswith(f"``{f.name}``")), None)
        assert row is not None, f"{f.name} is not in the module's table"
        if f.name in settings.ENV:
            assert settings.ENV[f.name] in row, row


def test_environment_overrides_deployment_settings() -> None:
    env = {"TORCHREFIT_TRANSPORT": " ipc ", "TORCHREFIT_KERNEL_CACHE": "0", "TORCHREFIT_NVRTC": "/x/libnvrtc.so",
           "TORCHREFIT_NVSHMEM_SHARED_GPU": "1", "TORCHREFIT_NIXL_TIMEOUT": "2.5", "TORCHREFIT_MAILBOX": "0",
           "TORCHREFIT_NATIVE_WATCH": "0", "TORCHREFIT_BRANCHES": "2"}  # not a deployment setting: ignored
    s = settings.from_env(env)
    assert (s.transport, s.kernel_cache, s.nvrtc, s.nvshmem_shared_gpu, s.nixl_timeout, s.mailbox,
            s.native_watch) == ("ipc", "0", "/x/libnvrtc.so", True, 2.5, False, False)
    assert s.branches == 8
    assert settings.from_env({}) == settings.Settings()
    assert settings.from_env({"TORCHREFIT_MAILBOX": "1", "TORCHREFIT_NVSHMEM_SHARED_GPU": "0"}) == settings.Settings()


@pytest.mark.parametrize("value", ["soon", "-1"])
def test_unreadable_environment_names_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match="TORCHREFIT_NIXL_TIMEOUT"):
        settings.from_env({"TORCHREFIT_NIXL_TIMEOUT": value})


def test_configure_validates_and_overridden_restores() -> None:
    before = settings.current()
    with pytest.raises(TypeError, match="no setting named branchs"):
        settings.configure(branchs=2)
    for bad in ({"branches": 0}, {"branches": 9}, {"sm_copy_below": -1}, {"batched_copy": "1"},
                {"nixl_timeout": 0.0}, {"delta_dense_above": 1.5}, {"delta_dense_above": -0.1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            settings.configure(**bad)
    assert settings.current() == before
    with settings.overridden(branches=2, batched_copy="none") as s:
        assert s.branches == 2 and settings.current() is s
    assert settings.current() == before
    with pytest.raises(RuntimeError), settings.overridden(mailbox=False):
        raise RuntimeError
    assert settings.current() == before


def test_reload_reads_the_environment_again(monkeypatch: pytest.MonkeyPatch) -> None:
    settings.configure(delegate_copies=False)
    monkeypatch.setenv("TORCHREFIT_TRANSPORT", "gloo")
    assert settings.current().transport == ""  # read once: a later change is not seen
    s = settings.reload()
    assert s.transport == "gloo" and s.delegate_copies is True


def test_only_the_settings_module_reads_the_environment() -> None:
    names = set()
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        names.update(re.findall(r"TORCHREFIT_[A-Z_]+", text))
        if path.name != "settings.py":
            assert not re.search(r"environ(\.get)?\[?\(?\s*[\"']TORCHREFIT_|getenv\(\s*[\"']TORCHREFIT_", text), path
    assert names <= set(settings.ENV.values()), sorted(names - set(settings.ENV.values()))
    assert len(settings.ENV) <= 8
