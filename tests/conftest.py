"""Shared pytest setup: the ``gpu`` marker skips with a reason where no CUDA GPU is
present; the native watch checks compiled once per test run for the tests that need them;
every test starts and ends with the settings its environment gives (``torchrefit.settings``)."""

import pytest
import torch

from torchrefit import settings


@pytest.fixture(autouse=True)
def _settings_from_env():
    settings.reload()
    yield
    settings.reload()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def native_cache(tmp_path_factory) -> str:
    """A kernel cache (``TORCHREFIT_KERNEL_CACHE``) holding the native watch checks,
    compiled once per test run; skips where no C++ compiler builds them."""
    from torchrefit._native import watch as native

    cache = str(tmp_path_factory.mktemp("native") / "kernels")
    patch = pytest.MonkeyPatch()
    patch.setenv("TORCHREFIT_KERNEL_CACHE", cache)
    patch.delenv(settings.ENV["native_watch"], raising=False)
    settings.reload()
    try:
        native.build()
    except Exception as e:  # noqa: BLE001 (no C++ compiler here)
        pytest.skip(f"the native watch check could not be built here: {type(e).__name__}: {e}")
    finally:
        patch.undo()
        settings.reload()
    return cache
