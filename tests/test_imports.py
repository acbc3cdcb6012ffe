"""The eagletree modules import one another without a circle (design.md: target <- verify <- search <-
draft <- decode <- train, export, serve, bench, viz). Every import counts: top-level, inside functions and under
TYPE_CHECKING, since each is a dependency the layering must allow."""

import ast
from pathlib import Path

import eagletree

PACKAGE = Path(eagletree.__file__).parent


def module_names(package: Path) -> dict[str, Path]:
    """{dotted module name: file} of every module in the package; a package is named by its __init__.py."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = (package.name,) + path.relative_to(package).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The eagletree modules that `name` imports anywhere in its file.

    `from X import y` depends on X.y when that is a module, else on X. Importing X.y also runs the __init__ of
    every package above it that is not above `name` (those are already being imported when `name` runs).
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    own = {package.rsplit(".", i)[0] for i in range(package.count(".") + 1)}
    deps = set()
    for target in found:
        if target not in modules:
            continue
        deps.add(target)
        parts = target.split(".")
        deps.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p not in own)
    deps.discard(name)
    return deps


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the package's modules it imports}."""
    modules = module_names(package)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """A cycle [a, b, ..., a] in each strongly connected group of modules (Tarjan's algorithm): the shortest one
    through the group's first module by name. Once it is broken, what is left of the group shows up next."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [shortest_cycle(graph, group, min(group)) for group in groups]


def shortest_cycle(graph: dict[str, set[str]], group: set[str], start: str) -> list[str]:
    """The shortest cycle from `start` back to it within a strongly connected group (breadth first)."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def test_find_cycles_names_each_circle():
    graph = {
        "a": {"b"},
        "b": {"c"},
        "c": {"a"},
        "d": {"a", "e"},
        "e": {"d"},
        "f": set(),
        "g": {"h"},
        "h": {"i", "j"},
        "i": {"g"},
        "j": {"g"},
    }
    assert sorted(find_cycles(graph)) == [["a", "b", "c", "a"], ["d", "e", "d"], ["g", "h", "i", "g"]]


def test_the_graph_sees_every_kind_of_import(tmp_path):
    (tmp_path / "eagletree" / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from .sub import b\n",
        "sub/__init__.py": "from . import b\n",
        "sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import X\n",
        "c.py": "def f():\n    import eagletree.d\n",
        "d.py": "from .sub.b import g\n",
    }
    for name, text in files.items():
        (tmp_path / "eagletree" / name).write_text(text)
    graph = import_graph(tmp_path / "eagletree")
    assert graph["eagletree.a"] == {"eagletree.sub", "eagletree.sub.b"}
    assert graph["eagletree.sub"] == {"eagletree.sub.b"}
    assert graph["eagletree.d"] == {"eagletree.sub", "eagletree.sub.b"}  # the package above b runs first
    assert find_cycles(graph) == [["eagletree.c", "eagletree.d", "eagletree.sub.b", "eagletree.c"]]


def test_no_import_cycles():
    graph = import_graph()
    assert "eagletree.packing" in graph["eagletree.draft.drafter"]  # (the graph is the package's)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles among eagletree modules:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_search_layer_does_not_import_training():
    graph = import_graph()
    found = {m: sorted(d for d in deps if d.startswith("eagletree.train")) for m, deps in graph.items()}
    assert not {m: d for m, d in found.items() if m.startswith("eagletree.search") and d}
