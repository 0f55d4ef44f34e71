"""The project's import graph, read with `ast` (no module is imported): every import statement counts,
function-local and TYPE_CHECKING ones included, since a cycle held apart by either is still a cycle.
docs/architecture.md, "Import rules"."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

APPS = ("config", "audit", "registry", "serving", "rollouts", "dashboard")


@dataclass(frozen=True, slots=True)
class Import:
    source: str  # the importing module
    target: str  # the imported project module
    line: int
    is_local: bool  # inside a function
    has_comment: bool  # a comment on its line or the line above: the reason it is deferred


@dataclass(slots=True)
class ImportGraph:
    modules: dict[str, Path]
    imports: list[Import] = field(default_factory=list)

    def edges(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {name: set() for name in self.modules}
        for imp in self.imports:
            out[imp.source].add(imp.target)
        return out

    def reachable(self, start: str) -> set[str]:
        edges, seen, todo = self.edges(), set(), [start]
        while todo:
            for target in edges[todo.pop()]:
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        return seen

    def cycles(self) -> list[list[str]]:
        """Strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
        edges = {name: sorted(targets) for name, targets in self.edges().items()}
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        found: list[list[str]] = []
        for root in sorted(edges):
            if root in index:
                continue
            work = [(root, iter(edges[root]))]
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
                        work.append((child, iter(edges[child])))
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
                        found.append(sorted(component))
        return found


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _python_files(root: Path) -> Iterator[Path]:
    for app in APPS:
        for path in sorted((root / app).rglob("*.py")):
            if "migrations" not in path.parts:
                yield path


def read_graph(root: Path) -> ImportGraph:
    modules = {_module_name(root, path): path for path in _python_files(root)}
    graph = ImportGraph(modules)
    for name, path in modules.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        local = {
            id(node)
            for function in ast.walk(tree)
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
            for node in ast.walk(function)
            if isinstance(node, ast.Import | ast.ImportFrom)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                candidates = [f"{node.module}.{alias.name}" for alias in node.names]
                targets = [c if c in modules else node.module for c in candidates]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            has_comment = _is_commented(lines, node.lineno)
            for target in dict.fromkeys(targets):
                if target in modules:
                    graph.imports.append(Import(name, target, node.lineno, id(node) in local, has_comment))
    return graph


def _is_commented(lines: list[str], lineno: int) -> bool:
    """A comment on the import's line, or above the run of import lines it belongs to."""
    if "#" in lines[lineno - 1]:
        return True
    above = lineno - 2
    while above >= 0 and lines[above].strip().startswith(("from ", "import ")):
        above -= 1
    return above >= 0 and lines[above].strip().startswith("#")


def is_under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)
