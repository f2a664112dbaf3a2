"""An import-only stand-in for ``sgl_kernel`` (SGLang's compiled kernels), for the tests.

SGLang imports ``sgl_kernel`` and some of its submodules at start-up, and no CPU build of
it is on the package registry. Dense float32 models on SGLang's CPU path never call it
(its linears, norms and attention run in torch), so every name here is a function that
raises ``NotImplementedError``: a model that needs a real kernel (MoE, quantized, AMX)
fails loudly instead of computing something else. ``tests/test_sglang_engine.py`` puts
this folder on the engine's ``PYTHONPATH``; nothing outside the tests sees it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+torchrefit-test-stub"


class _Missing:
    """Any name of the stub: calling it raises; its attributes are stubs too (SGLang
    reads constants such as ``scalar_types.uint4b8`` at import)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name}: sgl_kernel is an import-only stub in "
                                  "torchrefit's tests (no CPU build of sgl_kernel exists)")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<sgl_kernel stub {self._name}>"


def _missing(name: str) -> _Missing:
    return _Missing(name)


def _module_getattr(prefix: str):
    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _missing(f"{prefix}.{attr}")
    return __getattr__


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every ``sgl_kernel.<sub>`` is a stub module too."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_StubFinder())
__getattr__ = _module_getattr(__name__)
