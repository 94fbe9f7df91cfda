"""The package's layout, read from its source: which modules import which.

The engine (``cf_ray/_engine``) is built from rooms, each with one job; the public modules are the
front that users import. The rules below keep that shape, so that a room can be read, changed and
tested on its own:

(a) nothing under ``cf_ray/_engine`` imports a public module, except the declarations a user hands
    in (:data:`USER_DECLARATIONS`): the engine is what the public modules are built on, never the
    other way round;
(b) no import cycle among cf_ray's modules: a module can be understood from those below it;
(c) the rooms that run in different processes (``worker/`` in the training process, ``node/`` in the
    holders, ``driver/`` in the controller) do not import each other: they share only the protocol
    and the format. One module, ``_engine/wiring.py``, starts the actors and imports more than one of
    them (no other module of cf_ray, public or not, does); ``observe/`` (what a run reports) imports
    none of them.

Every import counts, at module level and inside a function (a lazy import is still a dependency),
except those under ``if TYPE_CHECKING:``, which never run. The source is read with :mod:`ast`, not
imported, so a rule holds whatever a test imported first.
"""

from __future__ import annotations

import ast
import pathlib

import cf_ray

ROOT = pathlib.Path(cf_ray.__file__).parent

#: Public modules the engine may import: what a user declares and hands to cf_ray (the config, the
#: policy, the errors cf_ray raises, the version checked at import).
USER_DECLARATIONS = ("cf_ray.errors", "cf_ray._version", "cf_ray.config", "cf_ray.policy")

#: The rooms of separate processes (rule c).
PROCESS_ROOMS = ("cf_ray._engine.worker", "cf_ray._engine.node", "cf_ray._engine.driver")
WIRING = "cf_ray._engine.wiring"
OBSERVE = "cf_ray._engine.observe"


def _module_name(path: pathlib.Path) -> str:
    return ".".join(("cf_ray", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _type_checking_only(tree: ast.Module) -> set[int]:
    """``id`` of every import node under an ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> dict[str, int]:
    """The cf_ray modules ``name`` imports (module level and in functions), each with the line of its
    first import. ``from P import X`` imports the module ``P.X`` when there is one, else ``P``."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            if t in modules and t != name:
                found.setdefault(t, node.lineno)
    return found


def _graph() -> dict[str, dict[str, int]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _edge(graph: dict[str, dict[str, int]], a: str, b: str) -> str:
    return f"{a} -> {b} (line {graph[a][b]})"


def test_the_walk_sees_module_level_and_function_level_imports_and_skips_type_checking(tmp_path):
    """The reader itself: a function-level import counts, a TYPE_CHECKING one does not, and relative
    imports resolve to the module they name."""
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "from cf_ray import errors\n"
        "if TYPE_CHECKING:\n"
        "    from cf_ray.run import Run\n"
        "def f():\n"
        "    from . import config\n"
        "    import cf_ray.load\n"
    )
    modules = _modules()
    found = _imports("cf_ray.m", src, modules)
    assert set(found) == {"cf_ray.errors", "cf_ray.config", "cf_ray.load"}


def test_the_engine_imports_no_public_module_but_the_users_declarations():
    graph = _graph()
    bad = [
        _edge(graph, a, b)
        for a in sorted(graph)
        if _under(a, "cf_ray._engine")
        for b in sorted(graph[a])
        if not _under(b, "cf_ray._engine") and not any(_under(b, d) for d in USER_DECLARATIONS)
    ]
    assert bad == [], "modules of cf_ray/_engine import public modules:\n  " + "\n  ".join(bad)


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _a_cycle(graph: dict[str, dict[str, int]], comp: list[str]) -> list[str]:
    """One import cycle through the component's first module, as edges with their lines."""
    members = set(comp)
    start = comp[0]
    paths = {start: [start]}
    queue = [start]
    while queue:  # breadth first: the shortest way back to start
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w == start:
                path = paths[v] + [start]
                return [_edge(graph, a, b) for a, b in zip(path, path[1:])]
            if w in members and w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return comp


def test_no_import_cycle_among_cf_rays_modules():
    import sys

    graph = _graph()
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    cycles = _cycles(graph)
    said = "\n".join(f"  {' ; '.join(_a_cycle(graph, c))}\n    (all of: {', '.join(c)})" for c in cycles)
    assert cycles == [], f"import cycles among cf_ray's modules (function-level imports count):\n{said}"


def test_the_process_rooms_import_each_other_only_through_the_wiring_and_observe_imports_none():
    graph = _graph()
    bad = []
    for a in sorted(graph):
        if a == WIRING:
            continue
        own = next((r for r in PROCESS_ROOMS if _under(a, r)), None)
        for b in sorted(graph[a]):
            other = next((r for r in PROCESS_ROOMS if _under(b, r)), None)
            if other is None or other == own:
                continue
            if own is not None:
                bad.append(f"{_edge(graph, a, b)}: {own.rsplit('.', 1)[1]}/ imports {other.rsplit('.', 1)[1]}/")
            elif _under(a, OBSERVE):
                bad.append(f"{_edge(graph, a, b)}: observe/ imports {other.rsplit('.', 1)[1]}/")
        rooms = {r for b in graph[a] for r in PROCESS_ROOMS if _under(b, r)}
        if own is None and len(rooms) > 1:
            bad.append(f"{a} imports {', '.join(sorted(r.rsplit('.', 1)[1] + '/' for r in rooms))}: only wiring.py may")
    assert bad == [], "the process rooms' boundaries are crossed:\n  " + "\n  ".join(bad)
