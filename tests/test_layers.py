"""The house's shape, read from the code's own imports: no circles, dependencies point down.

    cluster -> router -> workers -> kernels          loadgen stands alone
    inside workers: protocol <- model, transport <- engine <- service <- actors

Every import statement counts, also one inside a function (a lazy import still ties two modules).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cluster", "router", "workers", "kernels", "loadgen")
# Higher number: higher floor. A module may import its own floor or lower ones.
FLOORS = {"kernels": 0, "workers.protocol": 1, "workers.model": 2, "workers.transport": 2,
          "workers.engine": 3, "workers.service": 4, "workers": 5, "router": 6, "cluster": 7}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from pkg import mod`` ties to the module, ``from mod import name`` to mod
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                         for a in node.names]
            else:
                continue
            targets |= {n for n in names if n in files and n != name}
        graph[name] = targets
    return graph


def floor_of(module: str) -> tuple[str, int]:
    best = max((k for k in FLOORS if module == k or module.startswith(k + ".")), key=len)
    return best, FLOORS[best]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_imports_point_down():
    upward = []
    for module, targets in import_graph().items():
        if module.startswith("loadgen"):
            upward += [(module, t) for t in targets if not t.startswith("loadgen")]
            continue
        own_name, own = floor_of(module)
        for target in targets:
            if target.startswith("loadgen"):
                if not module.startswith("cluster"):  # the CLI runs loadgen; nothing else may
                    upward.append((module, target))
                continue
            target_name, floor = floor_of(target)
            # Same floor: only within one package (model and transport are peers that never meet).
            if floor > own or (floor == own and target_name != own_name):
                upward.append((module, target))
    assert upward == []


def test_workers_is_split_by_concern():
    modules = [p for p in (ROOT / "workers").glob("*.py") if p.name != "__init__.py"]
    subpackages = [p for p in (ROOT / "workers").iterdir() if (p / "__init__.py").is_file()]
    assert len(modules) <= 8, sorted(p.name for p in modules)
    assert len(subpackages) >= 3


def test_checks_catch_a_circle_and_an_upward_import():
    """The checks above can fail: a made-up graph with both faults is caught."""
    graph = {"workers.engine.a": {"workers.service.b"}, "workers.service.b": {"workers.engine.a"}}
    assert cycles(graph) == [["workers.engine.a", "workers.service.b"]]
    assert floor_of("workers.service.b")[1] > floor_of("workers.engine.a")[1]
