"""Compiled kernel images kept on disk (``execute.kernels.image_cache``), on CPU.

A first call compiles and files the image; a later one (same name and key) reads it back
without compiling; another key compiles again; ``TORCHREFIT_KERNEL_CACHE=0`` compiles every
time and writes nothing; an empty file is no image; a directory that cannot be written
still yields the compiled image; ``forget`` drops a filed image so the next call
compiles; no temporary file is left behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torchrefit import settings
from torchrefit.execute.kernels import image_cache


def _cache_at(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """``TORCHREFIT_KERNEL_CACHE=value`` ("": unset), read as a new process would."""
    if value:
        monkeypatch.setenv(settings.ENV["kernel_cache"], value)
    else:
        monkeypatch.delenv(settings.ENV["kernel_cache"], raising=False)
    settings.reload()


def _maker(calls: list[int], image: bytes = b"\x7fELF-image"):
    def make() -> bytes:
        calls.append(1)
        return image

    return make


def test_images_are_compiled_once_and_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _cache_at(monkeypatch, str(tmp_path / "k"))
    calls: list[int] = []
    assert image_cache.cached("copy", "key-a", _maker(calls)) == (b"\x7fELF-image", False)
    assert image_cache.cached("copy", "key-a", _maker(calls)) == (b"\x7fELF-image", True)
    assert len(calls) == 1
    assert image_cache.cached("copy", "key-b", _maker(calls, b"other")) == (b"other", False)
    assert len(calls) == 2
    files = sorted(p.name for p in (tmp_path / "k").iterdir())
    assert len(files) == 2 and all(f.startswith("copy-") and f.endswith(".bin") for f in files), files
    image_cache.forget("copy", "key-a")
    assert image_cache.cached("copy", "key-a", _maker(calls)) == (b"\x7fELF-image", False)
    assert len(calls) == 3


def test_empty_file_is_no_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _cache_at(monkeypatch, str(tmp_path))
    calls: list[int] = []
    image_cache.cached("copy", "k", _maker(calls))
    (path,) = tmp_path.iterdir()
    path.write_bytes(b"")  # a write cut short
    assert image_cache.cached("copy", "k", _maker(calls)) == (b"\x7fELF-image", False)
    assert len(calls) == 2 and path.read_bytes() == b"\x7fELF-image"


def test_off_and_unwritable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    _cache_at(monkeypatch, "0")
    assert image_cache.cache_dir() is None
    for _ in range(2):
        assert image_cache.cached("copy", "k", _maker(calls)) == (b"\x7fELF-image", False)
    assert len(calls) == 2
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    _cache_at(monkeypatch, str(blocker / "sub"))
    assert image_cache.cached("copy", "k", _maker(calls)) == (b"\x7fELF-image", False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _cache_at(monkeypatch, "")
    assert image_cache.cache_dir() == tmp_path / "xdg" / "torchrefit" / "kernels"
