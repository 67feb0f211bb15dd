"""The structure docs/architecture.md promises, checked: no import cycle among the project's modules
(imports inside functions included), and no module over 600 lines.

Both read the source with :mod:`ast` and import nothing, so they take well under a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The project's code: the runtime, the flows, the stage functions, the dashboard.
PACKAGES = ("trajflow", "flows", "stages", "dashboards")
MAX_LINES = 600


def project_modules() -> dict[str, Path]:
    """``{dotted module name: file}`` for every ``.py`` file under :data:`PACKAGES`; the top-level
    ``flows/``, ``stages/`` and ``dashboards/`` are imported as ``trajflow.flows`` and so on."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if package != "trajflow":
                parts = ("trajflow", *parts)
            out[".".join(parts)] = path
    return out


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every import statement that can run, at any depth (module level, functions, methods, ``try``);
    ``if TYPE_CHECKING:`` blocks are left out: they never run, and naming a type there is how a
    module refers to a class above it without importing it."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            stack.append(child)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: the project modules it imports}``.

    ``from a.b import c`` points at ``a.b.c`` when that is a module and at ``a.b`` otherwise;
    ``import a.b.c`` at the longest of ``a.b.c``, ``a.b``, ``a`` that is a project module. A module
    that imports a sibling does not thereby import its package's ``__init__`` here: only what the
    source names counts, which is what can make Python meet a half-initialised module.
    """
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        edges = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(set(component))
    return [_cycle_in(graph, c) for c in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(component)
    parents = {start: None}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node] & component):
            if child == start:
                path = [node]
                while parents[path[-1]] is not None:
                    path.append(parents[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
            if child not in parents:
                parents[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle in {component}")  # pragma: no cover - Tarjan said there is one


def test_no_import_cycles():
    cycles = find_cycles(import_graph(project_modules()))
    assert not cycles, "import cycles (imports inside functions count):\n" + "\n".join(
        " -> ".join(c) for c in cycles)


def test_no_module_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in project_modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"


def test_the_cycle_finder_sees_lazy_relative_and_from_imports(tmp_path):
    """The checks above can fail: a cycle closed by an import inside a function, one through a
    relative ``from . import`` and one through ``from package import submodule`` are each found,
    an ``if TYPE_CHECKING:`` import is not, and a package's modules importing each other only
    one way are no cycle."""
    files = {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": "import pkg.b\n\ndef f():\n    from pkg import c\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n",
        "pkg/c.py": "def g():\n    from .a import f\n",
        "pkg/d.py": "from pkg import e\n",
        "pkg/e.py": "import os\n\ndef h():\n    import pkg.d as d\n",
        "pkg/f.py": "from pkg.b import x\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    modules = {".".join(Path(rel).with_suffix("").parts).removesuffix(".__init__"): tmp_path / rel for rel in files}
    graph = import_graph(modules)
    assert graph["pkg.b"] == set()  # the TYPE_CHECKING import does not count
    assert graph["pkg"] == {"pkg.a"}
    assert graph["pkg.f"] == {"pkg.b"}
    cycles = find_cycles(graph)
    assert sorted(cycles) == [["pkg.a", "pkg.c", "pkg.a"], ["pkg.d", "pkg.e", "pkg.d"]]
