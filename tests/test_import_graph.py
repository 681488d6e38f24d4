"""The import graph of psworker/, read with `ast`: no cycle (module-level or in-function imports alike), and
inside launcher/ no room imports from a room above it.

Pure: no module is imported, the sources are parsed.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Optional, Set

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "psworker"

# launcher/'s rooms, bottom first: a module may import from its own room or one below, never from one above.
# A room is a folder (backends/: how a task's process starts; console/: what a person sees; elastic/: an elastic
# worker job at run time; supervise/: the run loop and its policy); the modules directly in launcher/ are the
# top (the launch skeleton, its config, metrics) except GROUND, the run's shared plumbing below every room (run
# dir layout, ports, children, cgroups, the restart policy's settings).
LAUNCHER_LAYERS = ("ground", "backends", "console", "elastic", "supervise", "top")
GROUND = frozenset({"children", "rundir", "runstate", "ports", "shaping", "netns", "cgroups", "inject", "pipe_safe",
                    "policy", "tensorboard"})


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> Dict[str, pathlib.Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _resolve(name: str, modules: Dict[str, pathlib.Path]) -> Optional[str]:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, modules: Dict[str, pathlib.Path]) -> Set[str]:
    """The psworker modules `name` imports anywhere in its source (`from a import b` counts `a.b` if a module)."""
    path = modules[name]
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, name, path.name == "__init__.py")
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            resolved = _resolve(target, modules) if target.startswith("psworker") else None
            if resolved and resolved != name:
                found.add(resolved)
    return found


def import_graph() -> Dict[str, Set[str]]:
    modules = all_modules()
    return {name: imports_of(name, modules) for name in modules}


def _is_ancestor_package(importer: str, imported: str) -> bool:
    """A module importing its own package's `__init__` (or a package its submodule) is no cycle to report."""
    return importer.startswith(imported + ".") or imported.startswith(importer + ".")


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle as a list of modules (first == last), or None. Package/submodule edges are left out."""
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if _is_ancestor_package(node, nxt):
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def launcher_room(name: str, packages: Set[str]) -> Optional[int]:
    """The layer of a launcher module's room (see LAUNCHER_LAYERS); None outside launcher/ or for launcher/ itself."""
    parts = name.split(".")
    if parts[:2] != ["psworker", "launcher"] or len(parts) < 3:
        return None
    if len(parts) > 3 or name in packages:
        room = parts[2]
    else:
        room = "ground" if parts[2] in GROUND else "top"
    return LAUNCHER_LAYERS.index(room)


def test_the_finder_sees_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_in_function_imports_are_in_the_graph():
    graph = import_graph()
    assert "psworker.task.hard_exit" in graph["psworker.cli"]      # imported inside cli.main


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_launcher_room_imports_from_a_room_above():
    modules = all_modules()
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    upward = []
    for importer, imported in import_graph().items():
        low = launcher_room(importer, packages)
        for target in imported:
            high = launcher_room(target, packages)
            if low is not None and high is not None and high > low:
                upward.append(f"{importer} -> {target}")
    assert not upward, "upward imports inside launcher/: " + ", ".join(sorted(upward))


def top_level_names(tree: ast.Module) -> Set[str]:
    """What a module defines at its top level (assignments, defs, classes, imports, names in if/try blocks)."""
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node in tree.body:
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def test_every_name_in_all_is_defined():
    """A module's `__all__` names only what it defines (a stale entry breaks `from m import *` and misleads)."""
    stale = []
    for name, path in sorted(all_modules().items()):
        tree = ast.parse(path.read_text())
        listed = [node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)]
        exported = [e.value for v in listed if isinstance(v, (ast.List, ast.Tuple)) for e in v.elts
                    if isinstance(e, ast.Constant)]
        stale += [f"{name}.{e}" for e in exported if e not in top_level_names(tree)]
    assert not stale, stale
