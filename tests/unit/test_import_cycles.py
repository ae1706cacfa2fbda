"""The package's import graph has no cycles, and its modules stay short.

Every ``import`` in every module under ``src/xronos`` is an edge, wherever it stands: at
the top, inside a function (a lazy import only hides a cycle until the function runs) or
under ``if TYPE_CHECKING:`` (a cycle a type checker walks all the same). Resolution:

* ``from . import x`` / ``from .. import x`` / ``from .mod import x``: relative to the
  importing module's package;
* ``from pkg import name``: the submodule ``pkg.name`` if there is one; else, if
  ``pkg/__init__.py`` re-exports ``name`` from one of its submodules, that submodule
  (the module the name really comes from); else ``pkg`` itself;
* an import of something outside the package is not an edge.

Two edges are left out because they are how a package is built, not dependencies: a
package's ``__init__`` importing its own submodules, and a submodule importing its own
package's ``__init__`` for a name the latter does not re-export.

At the package level every ``xronos.<pkg>.*`` module counts as ``xronos.<pkg>``
(top-level modules such as ``xronos.config`` stand for themselves).
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "xronos"
MAX_LINES = 400

Graph = dict[str, set[str]]


# -- the graph --------------------------------------------------------------------------
def module_files(src: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package`` under ``src``."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_package(files: dict[str, Path], module: str) -> bool:
    return module in files and files[module].name == "__init__.py"


def _absolute(files: dict[str, Path], importer: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (``node.module`` may be None)."""
    if node.level == 0:
        return node.module or ""
    parts = importer.split(".")
    if not _is_package(files, importer):
        parts = parts[:-1]  # a module's siblings live in its package
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


def _reexports(files: dict[str, Path], trees: dict[str, ast.Module]) -> dict[str, dict[str, str]]:
    """Package -> {name: the submodule its ``__init__`` imports that name from}."""
    out: dict[str, dict[str, str]] = {}
    for module, tree in trees.items():
        if not _is_package(files, module):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(files, module, node)
                if source in files:
                    for alias in node.names:
                        out.setdefault(module, {})[alias.asname or alias.name] = source
    return out


def _named(node: ast.AST, importer: str, files: dict[str, Path], reexp: dict) -> list[str]:
    """The modules one import statement names (before trimming to known modules)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = _absolute(files, importer, node)
    out = []
    for alias in node.names:
        if f"{base}.{alias.name}" in files:
            out.append(f"{base}.{alias.name}")
        else:
            out.append(reexp.get(base, {}).get(alias.name, base))
    return out


def import_graph(src: Path, package: str) -> Graph:
    """Module -> the modules of ``package`` it imports (top-level, lazy, TYPE_CHECKING)."""
    files = module_files(src, package)
    trees = {m: ast.parse(p.read_text(), filename=str(p)) for m, p in files.items()}
    reexp = _reexports(files, trees)
    graph: Graph = {m: set() for m in files}
    for importer, tree in trees.items():
        for node in ast.walk(tree):  # every statement, nested ones included
            for target in _named(node, importer, files, reexp):
                while target and target not in files:  # `a.b.Name` -> module `a.b`
                    target = target.rpartition(".")[0]
                if not target or target == importer:
                    continue
                if _is_package(files, importer) and target.startswith(importer + "."):
                    continue  # a package's face importing its own parts
                if _is_package(files, target) and importer.startswith(target + "."):
                    continue  # a part importing its own package's face
                graph[importer].add(target)
    return graph


def package_graph(graph: Graph) -> Graph:
    """The graph with every ``root.<pkg>.*`` module merged into ``root.<pkg>``."""

    def top(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: Graph = {top(m): set() for m in graph}
    for a, targets in graph.items():
        out[top(a)] |= {top(b) for b in targets if top(b) != top(a)}
    return out


# -- cycles -----------------------------------------------------------------------------
def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's components with more than one node (each sorted), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def one_cycle(graph: Graph, component: list[str]) -> list[str]:
    """A shortest cycle through the first node of ``component``, as a closed path."""
    start, inside = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & inside):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"{component} is not strongly connected")


def describe(graph: Graph) -> list[str]:
    """One line per cycle: a concrete cycle, and the whole component if it is larger."""
    lines = []
    for component in strongly_connected(graph):
        cycle = one_cycle(graph, component)
        line = " -> ".join(cycle)
        if len(component) > len(cycle) - 1:
            line += f"   (all of: {', '.join(component)})"
        lines.append(line)
    return lines


# -- the package ------------------------------------------------------------------------
def test_no_import_cycle_between_modules() -> None:
    cycles = describe(import_graph(SRC, PACKAGE))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_import_cycle_between_packages() -> None:
    cycles = describe(package_graph(import_graph(SRC, PACKAGE)))
    assert not cycles, "package import cycles:\n" + "\n".join(cycles)


def test_modules_are_short() -> None:
    long = {
        str(p.relative_to(SRC)): n
        for p in module_files(SRC, PACKAGE).values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


# -- the checker on a package made for it ------------------------------------------------
TOY = {
    "__init__.py": "",
    # a <-> b: a lazy import (`from pkg import <submodule>`) against a relative one
    "a.py": "def f():\n    from toy import b\n    return b\n",
    "b.py": "from . import a\n",
    # c <-> d: one side only under TYPE_CHECKING
    "c.py": (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from toy.d import D\n"
        "class C: ...\n"
    ),
    "d.py": "from .c import C\nclass D(C): ...\n",
    # p1.x <-> p2.y through the packages' re-exports (so p1 <-> p2 as packages)
    "p1/__init__.py": "from toy.p1.x import X\n",
    "p1/x.py": "X = 1\ndef g():\n    from ..p2 import Y\n    return Y\n",
    "p2/__init__.py": "from .y import Y\n",
    "p2/y.py": "import os\nfrom toy.p1 import X\nY = X\n",
    # e imports into the cycles but is on none of them; p1's face imports its own part
    "e.py": "import toy.a\nfrom toy.p2.y import Y\n",
}


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "toy" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_resolves_every_import_form(tmp_path: Path) -> None:
    graph = import_graph(_write(tmp_path, TOY), "toy")
    assert graph == {
        "toy": set(),
        "toy.a": {"toy.b"},
        "toy.b": {"toy.a"},
        "toy.c": {"toy.d"},
        "toy.d": {"toy.c"},
        "toy.e": {"toy.a", "toy.p2.y"},
        "toy.p1": set(),  # its own part: not an edge
        "toy.p1.x": {"toy.p2.y"},  # `from ..p2 import Y`: p2 re-exports Y from p2.y
        "toy.p2": set(),
        "toy.p2.y": {"toy.p1.x"},  # `os` is not an edge
    }


def test_checker_finds_lazy_and_type_checking_cycles(tmp_path: Path) -> None:
    # Must-fail control: the cycles planted above are all reported, and nothing else.
    graph = import_graph(_write(tmp_path, TOY), "toy")
    assert strongly_connected(graph) == [
        ["toy.a", "toy.b"],
        ["toy.c", "toy.d"],
        ["toy.p1.x", "toy.p2.y"],
    ]
    assert describe(graph)[0] == "toy.a -> toy.b -> toy.a"
    assert strongly_connected(package_graph(graph)) == [
        ["toy.a", "toy.b"],
        ["toy.c", "toy.d"],
        ["toy.p1", "toy.p2"],
    ]


def test_checker_reports_no_cycle_once_one_edge_is_cut(tmp_path: Path) -> None:
    acyclic = {**TOY, "b.py": "", "d.py": "class D: ...\n", "p2/y.py": "Y = 2\n"}
    graph = import_graph(_write(tmp_path, acyclic), "toy")
    assert describe(graph) == [] and describe(package_graph(graph)) == []


def test_one_cycle_names_a_whole_loop() -> None:
    # a -> b -> c -> a, plus a shortcut b -> a: the shortest loop through a is a -> b -> a,
    # and the line still names the whole component.
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"a"}}
    assert describe(graph) == ["a -> b -> a   (all of: a, b, c)"]
