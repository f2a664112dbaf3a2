"""The mutation catalogue (``tools/mutations.toml``) still matches the code, without running it.

Every entry's original text occurs exactly once in its file (a rename or a rewrite of
the line elsewhere breaks this test loudly, not the mutation run silently), its
replacement differs, its ids are unique, its test selection names test files that
exist, and the catalogue spreads over every area of the library.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AREAS = ("planner", "layouts", "maps", "transforms", "executor", "transports", "verify", "connect",
         "versions", "sink", "errors")


def _tool():
    spec = importlib.util.spec_from_file_location("mutations", ROOT / "tools" / "mutations.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutations"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_original_text_is_in_its_file_once() -> None:
    tool = _tool()
    entries = tool.load()
    assert tool.problems(entries) == []
    assert len(entries) >= 30


def test_selections_name_existing_tests_and_areas_are_covered() -> None:
    entries = _tool().load()
    for m in entries:
        files = [t.split("::")[0] for t in m.tests if t.startswith("tests/")]
        assert files, f"{m.id}: no test file in {m.tests}"
        for f in files:
            assert (ROOT / f).is_file(), f"{m.id}: {f} does not exist"
    for area in AREAS:
        assert any(m.id.startswith(area + "-") for m in entries), f"no mutation of {area}"


def test_problems_names_a_stale_entry(tmp_path) -> None:
    tool = _tool()
    (tmp_path / "src/torchrefit").mkdir(parents=True)
    (tmp_path / "src/torchrefit/a.py").write_text("x = 1\nx = 1\n")
    stale = [tool.Mutation("gone", "a.py", "y = 2", "y = 3", ("tests",)),
             tool.Mutation("twice", "a.py", "x = 1", "x = 2", ("tests",)),
             tool.Mutation("nofile", "b.py", "x", "y", ("tests",))]
    found = tool.problems(stale, tmp_path)
    assert [p.split(":")[0] for p in found] == ["gone", "twice", "nofile"]
