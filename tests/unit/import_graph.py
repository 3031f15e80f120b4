"""The import graph of the project's own packages, read with ``ast`` (nothing is imported).

Every import is an edge, marked by where it stands: ``module`` (run at import), ``typing`` (under
``if TYPE_CHECKING:``) or ``function`` (inside a function body, run when called). A typing-only
edge is still a dependency in the design, so circles are looked for over all three kinds.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

KINDS = ("module", "typing", "function")


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``line``; ``kind`` is one of ``KINDS``."""

    source: str
    target: str
    line: int
    kind: str


def modules_under(root: Path) -> dict[str, Path]:
    """Every module below a source root, by dotted name (a package by its ``__init__``)."""
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Each import statement with its kind; a function body outranks TYPE_CHECKING."""

    def walk(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, kind
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from walk(child, "function")
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                inner = "function" if kind == "function" else "typing"
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), inner)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), kind)
            else:
                yield from walk(child, kind)

    yield from walk(tree, "module")


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    package = parts if is_package else parts[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


def edges_of(module: str, path: Path, known: set[str]) -> list[Edge]:
    """The imports of one module that name a module in ``known`` (the project's own)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[Edge] = []
    for node, kind in _imports(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = _base(module, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in known else base)
        for name in targets:
            target = _owner(name, known)
            if target and target != module:
                found.append(Edge(module, target, node.lineno, kind))
    return found


def _owner(name: str, known: set[str]) -> str:
    """The project module a dotted name lies in (``a.b.C`` -> ``a.b``); empty when none."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def import_graph(roots: list[Path]) -> dict[str, list[Edge]]:
    """Each project module's edges to other project modules, over every source root."""
    paths: dict[str, Path] = {}
    for root in roots:
        paths.update(modules_under(root))
    known = set(paths)
    return {name: edges_of(name, path, known) for name, path in sorted(paths.items())}


def circles(graph: dict[str, list[Edge]]) -> list[list[Edge]]:
    """One circle through each strongly connected group of modules (Tarjan), as its edges."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in graph.get(node, []):
            if edge.target not in index:
                connect(edge.target)
                low[node] = min(low[node], low[edge.target])
            elif edge.target in on_stack:
                low[node] = min(low[node], index[edge.target])
        if low[node] == index[node]:
            group: set[str] = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_circle_in(graph, group) for group in groups]


def _circle_in(graph: dict[str, list[Edge]], group: set[str]) -> list[Edge]:
    """A shortest path from the group's first module back to itself (breadth first)."""
    start = min(group)
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        nxt: list[str] = []
        for node in frontier:
            for edge in graph[node]:
                if edge.target not in group:
                    continue
                if edge.target == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, came[path[0].source])
                    return path
                if edge.target not in came:
                    came[edge.target] = edge
                    nxt.append(edge.target)
        frontier = nxt
    raise AssertionError(f"no circle through {start}")  # a strongly connected group has one


def describe(circle: list[Edge]) -> str:
    """``a -[typing @12]-> b -[module @3]-> a``."""
    text = circle[0].source
    for edge in circle:
        text += f" -[{edge.kind} @{edge.line}]-> {edge.target}"
    return text


# A path's methods that read or write files (``open`` is left out: other objects have one).
PATH_IO = frozenset(
    {"read_text", "read_bytes", "write_text", "write_bytes", "iterdir", "unlink", "mkdir", "glob"}
    | {"rglob", "rmdir", "touch", "symlink_to", "hardlink_to"}
)


@dataclass(frozen=True)
class Use:
    """A library name a module uses (``grpc.StatusCode``, ``kr8s``) at ``line``; ``kind``: where
    the import it came through stands (``KINDS``)."""

    name: str
    line: int
    kind: str


def library_uses(path: Path) -> list[Use]:
    """What a module imports from outside the project, as dotted names, by line; a module
    imported whole and used only through its attributes counts as those attributes
    (``grpc.StatusCode``); a call to the builtin ``open`` counts as ``open``, a call of a
    path's file method (``PATH_IO``) as ``pathlib.Path.<method>``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    attributes: dict[str, list[tuple[str, int]]] = {}
    bare: set[str] = set()
    wrapped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            attributes.setdefault(node.value.id, []).append((node.attr, node.lineno))
            wrapped.add(id(node.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and id(node) not in wrapped:
            bare.add(node.id)
    uses: list[Use] = []
    for node, kind in _imports(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                uses += [Use(f"{node.module}.{a.name}", node.lineno, kind) for a in node.names]
            continue
        for alias in node.names:
            local = alias.asname or alias.name.split(".")[0]
            named = alias.name if alias.asname else local
            through = attributes.get(local, [])
            if local in bare or not through:
                uses.append(Use(alias.name, node.lineno, kind))
            uses += [Use(f"{named}.{attr}", line, kind) for attr, line in through]
    for node in ast.walk(tree):
        func = node.func if isinstance(node, ast.Call) else None
        if isinstance(func, ast.Name) and func.id == "open":
            uses.append(Use("open", func.lineno, "module"))
        elif isinstance(func, ast.Attribute) and func.attr in PATH_IO:
            uses.append(Use(f"pathlib.Path.{func.attr}", func.lineno, "module"))
    return sorted(uses, key=lambda u: (u.line, u.name))


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``name`` is one of ``prefixes`` or lies below one (``a.b`` is within ``a``)."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)
