"""Every repository path quoted in the README, the docs, BENCHMARKS.md, ``benchmarks/`` and
the source's comments and docstrings exists; every dotted
``torchrefit.<module>`` name resolves to a module; BENCHMARKS.md and the README name
commits, not tags or branches.

A path is a token such as ``tests/test_x.py``, ``benchmarks/run_gpu.sh``,
``docs/tuning.md``, ``execute/streams.py`` (resolved against the repository root,
``src/torchrefit/`` and the quoting file's folder) or a folder ending in ``/``. Paths of
other projects are listed in ``EXTERNAL`` with the project the quoting line must name.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "torchrefit"
EXT = r"(?:py|md|sh|json|toml|txt|cu|cpp|yaml|yml|cfg|csv)"
PATH = re.compile(
    rf"(?<![\w./~$<>{{}}-])("
    rf"(?:\.ci|src|tests|benchmarks|docs|tools)/(?:[\w.-]+/)*(?:[\w-]+\.{EXT}|)"  # from the root
    rf"|[\w-]+(?:/[\w-]+)*/[\w-]+\.{EXT}"  # relative: execute/streams.py, ../BENCHMARKS.md
    rf"|(?:README|BENCHMARKS)\.md|pyproject\.toml"
    rf")(?![\w/*{{<-])")
MODULE = re.compile(r"(?<![\w./])torchrefit(?:\.[A-Za-z_]\w*)+")
#: paths of other projects: path -> what the quoting line must name
EXTERNAL = {"examples/rl/benchmark_refit.py": "Megatron-LM"}
#: dotted names that are not modules of this package (entry-point groups, loggers, ...)
NOT_MODULES = {"torchrefit_native_watch"}


def quoting_files() -> list[pathlib.Path]:
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += [p for p in sorted((ROOT / "benchmarks").glob("*")) if p.suffix in (".py", ".sh")]
    files += sorted(PACKAGE.rglob("*.py"))
    return files


def _shown(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _exists(token: str, quoted_in: pathlib.Path) -> bool:
    token = token.rstrip("/") or token
    return any((base / token).exists() for base in (ROOT, PACKAGE, quoted_in.parent))


def stale_paths(files: list[pathlib.Path]) -> list[str]:
    out = []
    for path in files:
        text = path.read_text()
        lines = text.splitlines()
        for m in PATH.finditer(text):
            token = m.group(1)
            line = text.count("\n", 0, m.start())
            if token in EXTERNAL and EXTERNAL[token] in " ".join(lines[max(0, line - 2):line + 1]):
                continue
            if not _exists(token, path):
                out.append(f"{_shown(path)}:{line + 1}: {token}")
    return out


def _module_exists(dotted: str) -> bool:
    parts = dotted.split(".")[1:]
    here = PACKAGE
    for part in parts:
        if (here / part).is_dir() and (here / part / "__init__.py").exists():
            here = here / part
            continue
        if (here / f"{part}.py").exists():
            return True  # what follows is an attribute of the module
        # an attribute of the package: it must at least be a name its __init__ mentions
        return re.search(rf"\b{re.escape(part)}\b", (here / "__init__.py").read_text()) is not None
    return True


def stale_modules(files: list[pathlib.Path]) -> list[str]:
    out = []
    for path in files:
        text = path.read_text()
        for m in MODULE.finditer(text):
            name = m.group(0).rstrip(".")
            if name.split(".")[1] in NOT_MODULES or name.endswith((".py", ".md")):
                continue
            if not _module_exists(name):
                out.append(f"{_shown(path)}:{text.count(chr(10), 0, m.start()) + 1}: {name}")
    return out


def test_every_quoted_path_exists() -> None:
    stale = stale_paths(quoting_files())
    assert not stale, ("quoted paths that do not exist (fix the quote, or add another project's "
                       "path to EXTERNAL in tests/test_quoted_paths.py):\n" + "\n".join(stale))


def test_every_dotted_module_name_resolves() -> None:
    stale = stale_modules(quoting_files())
    assert not stale, "torchrefit.<module> names that resolve to no module:\n" + "\n".join(stale)


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def test_benchmarks_name_commits() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text() + (ROOT / "README.md").read_text()
    named = re.findall(r"\b(?:at|commit|against) `?([0-9a-f]{7,40})\b", text)
    assert named, "BENCHMARKS.md names no commit"
    not_hex = re.findall(r"\bat commit `?([^\s`,.;:)]+)", text)
    assert all(re.fullmatch(r"[0-9a-f]{7,40}", c) for c in not_hex), (
        f"'at commit X' must name a commit hash, not a tag or branch: {not_hex}")
    inside = _git("rev-parse", "--is-shallow-repository")
    if inside.returncode != 0 or inside.stdout.strip() != "false":
        pytest.skip("not a full git clone: the commits cannot be looked up")
    missing = [c for c in sorted(set(named)) if _git("cat-file", "-e", f"{c}^{{commit}}").returncode]
    assert not missing, f"BENCHMARKS.md / README name commits this clone does not have: {missing}"


def test_the_checks_see_a_stale_path_and_module(tmp_path: pathlib.Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("See `tests/test_gone.py`, `docs/tuning.md`, `execute/streams.py`, "
                   "Megatron-LM's `examples/rl/benchmark_refit.py` and `torchrefit.execute.gone`, "
                   "`torchrefit.execute.streams.ordered`.\n")
    assert [s.split(": ")[1] for s in stale_paths([doc])] == ["tests/test_gone.py"]
    assert [s.split(": ")[1] for s in stale_modules([doc])] == ["torchrefit.execute.gone"]
