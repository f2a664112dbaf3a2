"""Mutation check: break one line of ``src/`` at a time and see a CPU test fail.

Each entry of ``tools/mutations.toml`` names a file under ``src/torchrefit``, an exact
text that occurs once in it (a whole line or part of one), its replacement, and the
tests that should catch the change (pytest node ids or options such as ``-k``). The
script copies ``src/``, ``tests/`` and ``pyproject.toml`` to a temporary directory
once, and for each entry writes the mutated file there, runs the selection with
``PYTHONPATH`` at the copy and a timeout, then restores the file: the working tree is
never edited. A mutation is *caught* when its selection fails (or times out: a hang
is noticed too); the first failing test is reported.

Run from the repository root (the whole catalogue: about 13 minutes on 2 CPU cores)::

    python tools/mutations.py                   # every entry; exit 1 unless all caught
    python tools/mutations.py --write           # ... and write tools/mutations_result.md
    python tools/mutations.py --only planner    # entries whose id contains "planner"
    python tools/mutations.py --baseline        # first check each selection passes unmutated

Exits 2 before running anything where an entry's original text is missing from its
file or occurs more than once, so that the catalogue cannot rot silently. Entries
with a ``gpu`` field give the reason only a GPU can catch them; they are run and
reported, and not counted against the CPU target.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CATALOGUE = Path(__file__).with_name("mutations.toml")
RESULT = Path(__file__).with_name("mutations_result.md")
PACKAGE = Path("src/torchrefit")


@dataclass(frozen=True)
class Mutation:
    id: str
    file: str  # relative to src/torchrefit
    original: str
    replacement: str
    tests: tuple[str, ...]
    timeout: float = 180.0
    gpu: str = ""  # why only a GPU can catch it ("" where a CPU test does)


@dataclass(frozen=True)
class Outcome:
    mutation: Mutation
    status: str  # "caught", "timeout", "missed", "error"
    test: str
    seconds: float


def load(path: Path = CATALOGUE) -> list[Mutation]:
    """The catalogue's entries, in file order."""
    with path.open("rb") as f:
        raw = tomllib.load(f)
    out = []
    for entry in raw["mutation"]:
        entry = dict(entry)
        entry["tests"] = tuple(entry["tests"])
        out.append(Mutation(**entry))
    ids = [m.id for m in out]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise SystemExit(f"duplicate mutation ids: {dup}")
    return out


def problems(mutations: list[Mutation], root: Path = ROOT) -> list[str]:
    """Entries whose original text is not in their file exactly once, or that change nothing."""
    out = []
    for m in mutations:
        path = root / PACKAGE / m.file
        if not path.is_file():
            out.append(f"{m.id}: no file {PACKAGE / m.file}")
            continue
        n = path.read_text().count(m.original)
        if n != 1:
            out.append(f"{m.id}: {m.original!r} occurs {n} times in {PACKAGE / m.file} (want 1)")
        if m.original == m.replacement:
            out.append(f"{m.id}: the replacement equals the original")
    return out


def _copy_tree(dest: Path) -> None:
    for name in ("src", "tests"):
        shutil.copytree(ROOT / name, dest / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def _pytest(tree: Path, tests: tuple[str, ...], timeout: float) -> tuple[int | None, str]:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out
    return done.returncode, done.stdout + done.stderr


def _first_failed(output: str) -> str:
    found = re.search(r"^(?:FAILED|ERROR) (.+?)(?: - |$)", output, re.M)  # ids may hold spaces
    return found.group(1) if found else ""


def run_one(tree: Path, m: Mutation) -> Outcome:
    """Apply ``m`` in ``tree``, run its selection, restore the file."""
    path = tree / PACKAGE / m.file
    original = path.read_text()
    path.write_text(original.replace(m.original, m.replacement, 1))
    t0 = time.perf_counter()
    try:
        code, output = _pytest(tree, m.tests, m.timeout)
    finally:
        path.write_text(original)
    seconds = time.perf_counter() - t0
    if code is None:
        return Outcome(m, "timeout", f"(no result within {m.timeout:.0f} s)", seconds)
    if code == 1:
        return Outcome(m, "caught", _first_failed(output), seconds)
    if code == 0:
        return Outcome(m, "missed", "", seconds)
    # 2: interrupted (an import error at collection), 4/5: bad selection or no tests
    tail = output.strip().splitlines()[-1:] or [""]
    status = "caught" if code == 2 and "Error" in output else "error"
    return Outcome(m, status, _first_failed(output) or f"(exit {code}: {tail[0][:80]})", seconds)


def _baseline(tree: Path, mutations: list[Mutation]) -> list[str]:
    bad = []
    for m in mutations:
        code, output = _pytest(tree, m.tests, m.timeout)
        if code != 0:
            bad.append(f"{m.id}: its selection fails unmutated (exit {code}): {_first_failed(output)}")
    return bad


def report(outcomes: list[Outcome], seconds: float) -> str:
    cpu = [o for o in outcomes if not o.mutation.gpu]
    caught = sum(o.status in ("caught", "timeout") for o in cpu)
    lines = [
        "# Mutation check",
        "",
        "One-line mutations of `src/torchrefit` from `tools/mutations.toml`, each run against",
        "its test selection on CPU by `python tools/mutations.py --write`.",
        "",
        f"**{caught}/{len(cpu)} caught on CPU** ({len(outcomes) - len(cpu)} marked GPU-only), "
        f"{seconds:.0f} s in all on {os.cpu_count()} CPU core(s).",
        "",
        "| id | file | result | caught by | s |",
        "|---|---|---|---|---|",
    ]
    for o in outcomes:
        result = o.status + (f" (GPU only: {o.mutation.gpu})" if o.mutation.gpu else "")
        lines.append(f"| {o.mutation.id} | {o.mutation.file} | {result} | {o.test or '-'} | "
                     f"{o.seconds:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run entries whose id contains this text")
    ap.add_argument("--write", action="store_true", help=f"write {RESULT.relative_to(ROOT)}")
    ap.add_argument("--baseline", action="store_true",
                    help="check each selection passes unmutated first")
    args = ap.parse_args(argv)
    mutations = load()
    bad = problems(mutations)
    if bad:
        print("catalogue out of date:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 2
    chosen = [m for m in mutations if args.only in m.id]
    t0 = time.perf_counter()
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="torchrefit-mutations-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        if args.baseline:
            bad = _baseline(tree, chosen)
            if bad:
                print("\n".join(bad), file=sys.stderr)
                return 2
        for m in chosen:
            o = run_one(tree, m)
            outcomes.append(o)
            note = f" [GPU only: {m.gpu}]" if m.gpu else ""
            print(f"{o.status:8s} {o.seconds:6.1f}s  {m.id}: {o.test}{note}", flush=True)
    seconds = time.perf_counter() - t0
    text = report(outcomes, seconds)
    print(text.splitlines()[5])
    if args.write:
        RESULT.write_text(text)
    missed = [o for o in outcomes if not o.mutation.gpu and o.status not in ("caught", "timeout")]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
