"""``docs/design.md`` covers the package as it is, and the guarantees live in one place.

* its ``## Files`` table lists every module of ``src/torchrefit`` exactly once, and
  nothing that no longer exists;
* its layer table names every top-level package and module of ``src/torchrefit``;
* its call sequence covers stage and commit and the engine backends;
* the guarantees are stated in ``docs/reliability.md`` (section ``## Guarantees``); the
  README and the design doc link there instead of listing them.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "torchrefit"
DESIGN = ROOT / "docs" / "design.md"


def section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def modules() -> set[str]:
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}


def file_table(text: str) -> list[str]:
    return re.findall(r"^\| `([^`]+\.py)` \|", section(text, "Files"), re.M)


def test_every_module_has_one_line_in_the_file_table() -> None:
    listed = file_table(DESIGN.read_text())
    have = modules()
    lacking = sorted(have - set(listed))
    assert not lacking, ("docs/design.md's '## Files' table lacks " + ", ".join(lacking) +
                         ": add a row '| `path/under/src/torchrefit.py` | what it holds |' for each, "
                         "in path order")
    gone = sorted(set(listed) - have)
    assert not gone, f"docs/design.md's '## Files' table lists modules that no longer exist: {gone}"
    twice = sorted({m for m in listed if listed.count(m) > 1})
    assert not twice, f"listed more than once in docs/design.md's '## Files': {twice}"


def test_the_layer_table_names_every_top_level_part() -> None:
    layers = section(DESIGN.read_text(), "Layers and their rules")
    parts = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
             and p.name not in ("__init__.py", "__main__.py")}
    lacking = sorted(p for p in parts if not re.search(rf"`{re.escape(p)}/?`", layers))
    assert not lacking, ("docs/design.md's layer table ('## Layers and their rules') does not name "
                         f"{lacking}: add each, in backticks, to the row of its layer "
                         "(tests/test_structure.py's LAYERS says which)")


def test_the_call_sequence_covers_stage_commit_and_engines() -> None:
    sequence = section(DESIGN.read_text(), "The call sequence")
    for needed in ("stage()", "commit()", "engines/", "execute/staged", "stage_commit"):
        assert needed in sequence, f"docs/design.md's call sequence does not mention {needed}"


def test_guarantees_live_in_reliability_only() -> None:
    reliability = (ROOT / "docs" / "reliability.md").read_text()
    assert "\n## Guarantees\n" in reliability
    readme, design = (ROOT / "README.md").read_text(), DESIGN.read_text()
    assert "reliability.md#guarantees" in readme and "reliability.md#guarantees" in design
    stated = ("**Never stale, never torn.**", "**All or nothing.**", "**Nothing silently skipped.**")
    for doc, text in (("README.md", readme), ("docs/design.md", design)):
        restated = [s for s in stated if s in text]
        assert not restated, f"{doc} restates {restated}: link to docs/reliability.md#guarantees instead"
    assert "## Invariants" not in design


def test_the_check_sees_a_missing_module() -> None:
    text = "# D\n\n## Files\n\n| file | role |\n|---|---|\n| `a.py` | a |\n| `b/c.py` | c |\n\n## Next\n"
    assert file_table(text) == ["a.py", "b/c.py"]
