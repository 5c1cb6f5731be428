"""The import graph of vllm_lite/: no cycles, and dependencies point the way DESIGN.md draws them.

Every module is parsed with `ast` (nothing is imported), so the test sees imports inside
functions as well as at module level. Module-level imports (run when the module is first
imported; `if TYPE_CHECKING:` and `if __name__ == "__main__":` blocks excepted) must form no cycle. The layering rules hold for
every import, wherever it sits:

    entrypoints -> client -> core (messages) ; core -> worker ; top-level modules import none of them
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import pytest

import vllm_lite

PACKAGE_DIR = os.path.dirname(os.path.abspath(vllm_lite.__file__))

LAYERS = ("client", "core", "worker", "entrypoints")
# Top-level modules (every .py beside __init__.py): configuration and plumbing every layer may use; they
# import no layer. Found, not listed, so a new top-level module is held to the rule from its first commit.
TOP_LEVEL = tuple(sorted(f[:-3] for f in os.listdir(PACKAGE_DIR) if f.endswith(".py") and f != "__init__.py"))
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "client": ("worker",),
    "core": ("client", "entrypoints"),
    "worker": ("core", "client", "entrypoints"),
    **{name: LAYERS for name in TOP_LEVEL},
}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    module_level: bool  # runs at import time (not in a function, not under TYPE_CHECKING)
    type_only: bool = False  # under `if TYPE_CHECKING:`: never runs


def module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[: -len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def all_modules() -> dict[str, str]:
    """Dotted module name -> file path, for every .py file under vllm_lite/."""
    out = {}
    for root, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(root, f)
                out[module_name(path)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _not_on_import(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` and `if __name__ == "__main__":` bodies do not run when the module is imported."""
    if _is_type_checking(test):
        return True
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "__main__"
    )


def _imports(tree: ast.AST) -> Iterator[tuple[ast.stmt, bool, bool]]:
    """(import statement, runs at module import time, type-checking only) for every import in the tree."""

    def walk(node: ast.AST, module_level: bool, type_only: bool) -> Iterator[tuple[ast.stmt, bool, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, module_level, type_only
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, False, type_only)
            elif isinstance(child, ast.If) and _not_on_import(child.test):
                for stmt in child.body:
                    yield from walk(
                        ast.Module(body=[stmt], type_ignores=[]), False, type_only or _is_type_checking(child.test)
                    )
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), module_level, type_only)
            else:
                yield from walk(child, module_level, type_only)

    yield from walk(tree, True, False)


def _resolve(name: str, modules: dict[str, str]) -> Optional[str]:
    """The vllm_lite module `name` refers to (its nearest existing ancestor), or None if not ours."""
    if name != "vllm_lite" and not name.startswith("vllm_lite."):
        return None
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in modules else None


def edges_of(source: str, path: str, modules: dict[str, str]) -> list[Edge]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    is_package = path.endswith("__init__.py")
    out = []
    for node, module_level, type_only in _imports(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = source.split(".")
                anchor = parts if is_package else parts[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in modules else base)
        for t in targets:
            resolved = _resolve(t, modules)
            if resolved is not None and resolved != source:
                out.append(Edge(source, resolved, node.lineno, module_level, type_only))
    return out


@pytest.fixture(scope="module")
def graph() -> list[Edge]:
    modules = all_modules()
    return [e for name, path in modules.items() for e in edges_of(name, path, modules)]


def find_cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    adj: dict[str, set[str]] = {}
    for e in edges:
        adj.setdefault(e.source, set()).add(e.target)
        adj.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(adj[v]):
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
                out.append(sorted(comp))

    for v in sorted(adj):
        if v not in index:
            visit(v)
    return out


def describe_cycles(cycles: list[list[str]], edges: list[Edge]) -> str:
    """Each cycle's modules and the import lines that close it."""
    lines = ["import cycles:"]
    for c in cycles:
        lines.append(" <-> ".join(c))
        lines += [f"    {e.source}:{e.line} imports {e.target}" for e in edges if e.source in c and e.target in c]
    return "\n".join(lines)


def layer_of(module: str) -> Optional[str]:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


# ---------------------------------------------------------------------------- the checker itself


def test_parser_sees_function_level_relative_and_type_checking_imports(tmp_path):
    modules = {
        "vllm_lite": "",
        "vllm_lite.core": "",
        "vllm_lite.core.a": "",
        "vllm_lite.core.b": "",
        "vllm_lite.client": "",
        "vllm_lite.client.c": "",
    }
    src = tmp_path / "a.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "if TYPE_CHECKING:\n    from vllm_lite.client import c\n"
        "def f():\n    import vllm_lite.client.c\n"
        "if __name__ == '__main__':\n    import vllm_lite.core\n"
    )
    edges = {(e.target, e.module_level, e.type_only) for e in edges_of("vllm_lite.core.a", str(src), modules)}
    assert edges == {
        ("vllm_lite.core.b", True, False),
        ("vllm_lite.client.c", False, True),
        ("vllm_lite.client.c", False, False),
        ("vllm_lite.core", False, False),
    }


def test_cycle_finder_finds_a_cycle_and_nothing_in_a_chain():
    chain = [Edge("a", "b", 1, True), Edge("b", "c", 1, True)]
    assert find_cycles(chain) == []
    assert find_cycles(chain + [Edge("c", "a", 1, True)]) == [["a", "b", "c"]]


# ---------------------------------------------------------------------------- the package


def test_every_module_parses_and_the_graph_is_not_empty(graph):
    assert len(all_modules()) > 50
    assert any(e.source == "vllm_lite.entrypoints.llm" and e.target == "vllm_lite.client.llm_engine" for e in graph)


def test_no_cycles_among_module_level_imports(graph):
    edges = [e for e in graph if e.module_level]
    cycles = find_cycles(edges)
    assert not cycles, describe_cycles(cycles, edges)


def test_no_cycles_even_through_imports_inside_functions(graph):
    """A lazy import hides a cycle from start-up but not from the reader: none through any import that runs."""
    edges = [e for e in graph if not e.type_only]
    cycles = find_cycles(edges)
    assert not cycles, describe_cycles(cycles, edges)


def test_dependencies_point_down_the_layers(graph):
    bad = []
    for e in graph:
        src, dst = layer_of(e.source), layer_of(e.target)
        if src in FORBIDDEN and dst in FORBIDDEN[src]:
            bad.append(f"{e.source}:{e.line} imports {e.target} ({src} must not import {dst})")
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_the_top_level_list_names_real_modules():
    modules = all_modules()
    missing = [m for m in TOP_LEVEL if f"vllm_lite.{m}" not in modules and m not in ("launcher", "endpoints")]
    assert not missing, f"TOP_LEVEL names modules that do not exist: {missing}"
