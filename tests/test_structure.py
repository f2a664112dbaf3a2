"""The package's shape: its import graph has no cycles and flows one way.

Parses every module of ``src/torchrefit`` (nothing is imported), resolves relative
imports, and checks that

* module-level imports form no cycle (a cycle means a module runs half-initialized);
* no module of a lower layer imports one of a higher layer, at any depth of the
  code (function-level imports included): ``errors``, ``settings``, the private
  helpers of ``_util/`` and the native checks of ``_native/``, then ``layout``
  (describing what ranks hold), ``maps`` and ``transforms`` (what regions mean and how
  values change: name maps, FP8), ``plan`` (pure planning, including how transfers are
  cut into messages), ``transport`` (moving bytes, the metadata gathers of
  ``transport.collectives``, the protocol interfaces the executor drives, the
  one-sided protocol in ``transport/one_sided/``), ``execute`` (compiled programs,
  which drive a transport, and the device kernels of ``execute/kernels/``); the entry
  points (``refitter``, ``stage_commit``, ``connect``, ``swap``, ``engines``,
  ``verify``, ``cli``, ``bench``, ``simulate``, ``testing``, the package itself) sit
  above all of them, and none of the layers imports them.

The chain layout -> plan -> execute -> transport is the order of the calls;
imports run the other way at each step (the executor imports the transport
interfaces it drives; no transport imports the executor).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "src" / "torchrefit"

#: lower numbers may be imported by higher ones, never the other way round
LAYERS = {"errors": 0, "settings": 0, "_util": 0, "_native": 0, "layout": 1, "maps": 2, "transforms": 2,
          "plan": 3, "transport": 4, "execute": 5}
TOP = 9  # refitter, stage_commit, connect, swap, engines, verify, cli, bench, simulate, testing, ...

#: edges that break the order today, and why they are tolerated (none may be added)
KNOWN_BACKWARD: set[tuple[str, str]] = set()


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def import_edges() -> dict[str, list[tuple[str, bool]]]:
    """Module -> [(imported torchrefit module, at module level)], type-checking imports left out."""
    mods = _modules()
    edges: dict[str, list[tuple[str, bool]]] = {}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        top_level = {id(n) for n in tree.body}
        out = []
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or _type_checking_only(node, parents):
                continue
            for target in _targets(node, package, mods):
                out.append((target, id(node) in top_level))
        edges[name] = out
    return edges


def _targets(node: ast.Import | ast.ImportFrom, package: str, mods) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "torchrefit"]
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "torchrefit":
        return []
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], TOP) if len(parts) > 1 else TOP


def test_no_import_cycles() -> None:
    graph = {m: sorted({t for t, top in es if top and t != m}) for m, es in import_edges().items()}
    cycles = _strongly_connected(graph)
    assert not cycles, f"import cycles: {cycles}"


def test_imports_flow_one_way() -> None:
    edges = {(m, t) for m, es in import_edges().items() for t, _ in es}
    backward = sorted((m, t) for m, t in edges if layer(t) > layer(m) and (m, t) not in KNOWN_BACKWARD)
    assert not KNOWN_BACKWARD - edges, f"exceptions no longer needed: {sorted(KNOWN_BACKWARD - edges)}"
    assert not backward, (
        "imports against the order errors -> layout -> maps -> plan -> transport -> execute -> "
        f"entry points: {backward}")


def test_the_checks_see_a_cycle_and_a_backward_import() -> None:
    assert _strongly_connected({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert layer("torchrefit.plan.planner") > layer("torchrefit.layout._types")
    assert layer("torchrefit.refitter") > layer("torchrefit.transport.base")
    edges = import_edges()
    assert ("torchrefit.layout._types", True) in edges["torchrefit.plan.planner"]


def _strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)
