"""The front door: what ``import torchrefit`` offers and what it prints.

* every name of ``torchrefit.__all__`` resolves, once (``test_api_reference.py`` checks
  that ``docs/api.md`` documents each);
* the package ships ``py.typed``;
* a fresh process that imports torchrefit and logs a warning through the
  ``torchrefit`` logger prints nothing (no NumPy warning from torch, no logging
  output unless the application configures logging), and prints it once it does.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import torchrefit as tr

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_all_names_resolve_once() -> None:
    assert len(tr.__all__) == len(set(tr.__all__))
    for name in tr.__all__:
        assert getattr(tr, name) is not None


def test_vllm_layout_and_maps_from_the_top() -> None:
    from torchrefit.layout.vllm_tp import vllm_tp_layout

    assert tr.vllm_tp_layout is vllm_tp_layout
    assert callable(tr.maps.megatron_to_hf) and tr.maps.Identity().cache_key()


def test_ships_py_typed() -> None:
    assert (pathlib.Path(tr.__file__).parent / "py.typed").is_file()


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)


def test_import_and_logging_print_nothing_unless_configured() -> None:
    quiet = _run("import torchrefit, logging; "
                 "logging.getLogger('torchrefit.refitter').warning('planned')")
    assert quiet.stdout == "" and quiet.stderr == "", quiet.stderr
    loud = _run("import torchrefit, logging; logging.basicConfig(); "
                "logging.getLogger('torchrefit.refitter').warning('planned')")
    assert "planned" in loud.stderr
