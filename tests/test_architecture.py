"""The structure the design promises: no import circle in the package, `import dptrain` does
not load the launcher, and no module past the size the house style allows."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "dptrain")


def _modules() -> dict[str, str]:
    """dotted name -> file, for every module of the package."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in ast.walk(node):
                if hasattr(child, "lineno"):
                    lines.add(child.lineno)
    return lines


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere (late imports included, type-only ones not)."""
    tree = ast.parse(open(path).read())
    skip = _type_checking_lines(tree)
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
    return {m for m in found if m in modules and m != name}


def test_the_package_has_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # A package's __init__ only re-exports; an edge into one is an edge into what it re-exports.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt == "dptrain" or nxt.endswith(".__init__"):
                continue  # importing the top-level package's names is how users import; not a layer edge
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if state.get(nxt) is None:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if state.get(name) is None and name != "dptrain":
            cycle = visit(name)
            assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_import_dptrain_does_not_load_the_launcher():
    code = "import sys, dptrain; print(sorted(m for m in sys.modules if m.startswith('dptrain.') and m.split('.')[1] in ('launch', 'launcher', 'cli')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_bottom_of_the_import_graph_needs_no_torch():
    code = ("import sys, importlib.util\n"
            "for name in ('_errors', '_heartbeat'):\n"
            "    spec = importlib.util.spec_from_file_location(name, f'dptrain/{name}.py')\n"
            "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_no_module_grows_past_the_house_limit():
    too_long = {name: n for name, path in _modules().items() if (n := sum(1 for _ in open(path))) > 650}
    assert not too_long, f"split these by idea: {too_long}"
