"""The structure the design promises, walked from the code's own imports.

- No import circle in the package, type-only imports included.
- Nothing points back up: every module stands on a floor (:data:`FLOORS`) and imports only
  from its own floor or below, so a reader can learn the house from the ground up.
- ``import dptrain`` loads no launcher module, and the launcher never imports torch (its
  start-up is the time to a job's first step).
- Every collective called outside ``comm`` goes through the one guarded path (inside
  ``comm.guarded`` or ``comm.wait``), or its handle is waited on through ``comm.wait``
  elsewhere, said in :data:`WAITED_ELSEWHERE`: a rank that dies there is named.
- A module past the house's length is named in a warning, not failed: split by idea, not
  by length.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "dptrain")

#: The floors of the house, lowest first. A module is on the floor of the longest name here
#: that it equals or starts (``dptrain.parallel`` holds ``dptrain.parallel.ddp.reducer``).
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("ground: no torch, shared by the launcher and the ranks",
     ("dptrain.runtime", "dptrain.runtime.errors", "dptrain.runtime.exit", "dptrain.runtime.heartbeat",
      "dptrain.runtime.proc", "dptrain.runtime.settings", "dptrain.runtime.torch_version")),
    ("who am I", ("dptrain.environments",)),
    ("joining a job and talking in it",
     ("dptrain.runtime.env", "dptrain.runtime.join", "dptrain.comm", "dptrain.runtime.diagnostics",
      "dptrain.runtime.regroup", "dptrain.runtime.interrupt", "dptrain.runtime.abandon")),
    ("shared memory among a node's ranks", ("dptrain._shm",)),
    ("the parts a training program uses",
     ("dptrain.data", "dptrain.checkpoint", "dptrain.models", "dptrain.seeding", "dptrain.runtime.tensors")),
    ("data-parallel wrappers", ("dptrain.parallel",)),
    ("the Trainer", ("dptrain.train",)),
    ("starting, watching and stopping ranks (never imports torch)", ("dptrain.launcher",)),
    ("the faces: public names, the command", ("dptrain", "dptrain.__main__", "dptrain.cli", "dptrain.envreport")),
]

#: Collectives whose handle leaves the function that issued it and is waited on through
#: ``comm.wait`` by the code that holds it (function -> where).
WAITED_ELSEWHERE = {
    "Reducer._all_reduce": "a bucket's work, waited by Reducer._wait through comm.wait",
    "allreduce_and_upcast_hook": "a comm hook's future, waited by Reducer._wait through comm.wait",
    "all_reduce_requires_sync": ("the join flag: a joined rank waits through comm.wait; a training rank "
                                 "lets it complete unwaited, as PyTorch's join does"),
    "all_gather_flat": "FSDP's all-gather handle, waited through fsdp._collectives.wait (comm.wait)",
    "FlatParamUnit._post_backward": "FSDP's gradient reduction, waited by finish_grad through comm.wait",
    "node_groups.across_nodes": ("runs inside a shared-memory all-reduce on its worker; a failure ends that "
                                 "collective's wait, which is guarded"),
    "DelayedAllReduce._on_hook_param_grad": "waited at the end of backward through comm.wait",
    "ZeroRedundancyOptimizer._broadcast_shards": "its one caller holds comm.guarded around it",
}

COLLECTIVES = {
    "all_reduce", "broadcast", "all_gather", "all_gather_object", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "barrier", "reduce", "gather", "scatter",
    "all_to_all", "all_to_all_single", "monitored_barrier", "broadcast_object_list",
    "gather_object", "scatter_object_list", "send", "recv", "isend", "irecv",
}


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


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere: late and type-only imports too."""
    tree = ast.parse(open(path).read())
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
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


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _floor(module: str) -> int:
    best, floor = -1, None
    for k, (_, names) in enumerate(FLOORS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > best:
                best, floor = len(n), k
    assert floor is not None, f"{module} stands on no floor: add it to FLOORS in {__file__}"
    return floor


def test_the_package_has_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
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
        if state.get(name) is None:
            cycle = visit(name)
            assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_nothing_points_back_up():
    up = [f"{a} (floor {_floor(a) + 1}) -> {b} (floor {_floor(b) + 1}: {FLOORS[_floor(b)][0]})"
          for a, targets in sorted(_graph().items()) for b in sorted(targets) if _floor(b) > _floor(a)]
    assert not up, "imports that run back up:\n" + "\n".join(up)


def test_import_dptrain_loads_no_launcher_module():
    code = ("import sys, dptrain\n"
            "print(sorted(m for m in sys.modules if m.startswith(('dptrain.launcher', 'dptrain.cli'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_launcher_and_the_ground_floor_need_no_torch():
    names = sorted(m for m in _modules() if _floor(m) == 0 or m.startswith("dptrain.launcher") or m == "dptrain.cli")
    assert any(m.startswith("dptrain.launcher.") for m in names), names
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {names} loaded torch"


def _raw_collectives(path: str) -> list[tuple[str, int]]:
    """(enclosing function, line) of each ``dist.<collective>(...)`` call that is neither
    inside ``with comm.guarded(...)`` nor an argument of ``comm.wait(...)``."""
    tree = ast.parse(open(path).read())
    found = []

    def walk(node: ast.AST, where: str, guarded: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            where = f"{where}.{node.name}" if where else node.name
        if isinstance(node, (ast.With, ast.AsyncWith)) and any(
                isinstance(i.context_expr, ast.Call) and ast.unparse(i.context_expr.func).split(".")[-1] == "guarded"
                for i in node.items):
            guarded = True
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func in ("comm.wait", "wait"):
                guarded = True
            elif func.startswith("dist.") and func[5:] in COLLECTIVES and not guarded:
                found.append((where, node.lineno))
        for child in ast.iter_child_nodes(node):
            walk(child, where, guarded)

    walk(tree, "", False)
    return found


def test_every_collective_goes_through_the_guarded_path():
    raw = [(name, where, line) for name, path in sorted(_modules().items()) if name != "dptrain.comm"
           for where, line in _raw_collectives(path)
           if not any(where == w or where.endswith("." + w) for w in WAITED_ELSEWHERE)]
    assert not raw, ("collectives outside comm.guarded / comm.wait (a rank that dies there is not named): "
                     + ", ".join(f"{n}:{line} in {w}" for n, w, line in raw))


def test_long_modules_are_named():
    # Length alone is no reason to split a module (that splits by length); a long one is
    # named so that a reader asks whether it holds more than one idea.
    long = {name: n for name, path in _modules().items() if (n := sum(1 for _ in open(path))) > 650}
    if long:
        warnings.warn(f"modules past 650 lines (split by idea if they hold more than one): {long}", stacklevel=1)


def test_the_package_root_holds_at_most_twelve_modules():
    # A newcomer reads the root first: the faces and the parts a program uses, each subsystem
    # a folder with one door. The life of a rank process lives in dptrain/runtime/.
    root = sorted(n for n in os.listdir(PACKAGE) if n.endswith(".py"))
    assert len(root) <= 12, f"dptrain/ holds {len(root)} modules (at most 12): {root}; put a subsystem in a folder"
    for gone in ("launch.py", "trainer.py", "env.py", "_settings.py", "_errors.py"):
        assert gone not in root, f"dptrain/{gone} came back; its code lives in a subpackage (docs/layout.md)"
