"""The front door: what ``import torchrefit`` offers and what it prints.

* the README's API table names exactly ``torchrefit.__all__``, and every name resolves;
* the package ships ``py.typed``;
* a fresh process that imports torchrefit and logs a warning through the
  ``torchrefit`` logger prints nothing (no NumPy warning from torch, no logging
  output unless the application configures logging), and prints it once it does.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import torchrefit as tr

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_api_names() -> set[str]:
    """Names in the first column of the table in the README's ``## API`` section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for row in re.findall(r"^\| ([^|]+) \|", section, re.M):
        names.update(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", row))
    return names


def test_readme_api_table_is_all() -> None:
    documented = readme_api_names()
    assert documented == set(tr.__all__), (
        f"in the README, not in __all__: {sorted(documented - set(tr.__all__))}; "
        f"in __all__, not in the README: {sorted(set(tr.__all__) - documented)}")
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
