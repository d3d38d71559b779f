"""The import graph: layers import one way, and the few modules that may touch a library do.

Every import counts, including those under ``TYPE_CHECKING`` and inside functions: a
cycle hidden in a function is still a cycle a reader has to untangle.
"""

from __future__ import annotations

import ast
import collections
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("noderuntime", "protocol", "relay", "kernels_patch", "benchmarks")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports: project modules by name, others by their top package."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for target in targets:
            project = target
            while project and project not in MODULES:
                project = project.rpartition(".")[0]
            if project:
                if project != name:
                    out.add(project)
            else:
                out.add(target.split(".")[0])
    return out


@functools.cache
def _graph() -> dict[str, set[str]]:
    """Each module's imports, parsed at first use: not again in every worker that collects the suite (1 s)."""
    return {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    graph = _graph()
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start] & graph.keys())))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child] & graph.keys()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_import_cycle_among_the_projects_modules() -> None:
    assert _cycles() == []


def test_packages_import_one_way() -> None:
    packages: dict[str, set[str]] = collections.defaultdict(set)
    for name, imported in _graph().items():
        packages[name.split(".")[0]] |= {i.split(".")[0] for i in imported}
    assert packages["protocol"].isdisjoint({"noderuntime", "benchmarks", "trio", "grpclib", "llama_cpp", "asyncio"})
    assert "benchmarks" not in packages["noderuntime"] and "tests" not in packages["noderuntime"]
    assert "tests" not in packages["benchmarks"]


def test_the_relay_imports_protocol_and_transport_pieces_never_the_engine_node_or_gateway() -> None:
    """A public relay runs from the light install: what it imports, and all they import, stay below the node."""
    allowed = ("protocol", "noderuntime.access", "noderuntime.transport", "noderuntime.operations", "relay")
    reached, todo = set(), [name for name in MODULES if name.startswith("relay")]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        todo += [i for i in _graph()[name] if i in MODULES]
    project = {name for name in reached if name in MODULES}
    assert all(name.startswith(allowed) for name in project), sorted(n for n in project if not n.startswith(allowed))
    foreign = {i for name in project for i in _graph()[name] if i not in MODULES}
    assert foreign.isdisjoint({"llama_cpp", "torch", "transformers", "noderuntime"}), sorted(foreign)
    # and nothing grpc: the relay speaks websockets only
    assert not any(name.startswith("noderuntime.transport.grpc") for name in project)


GRPC = "noderuntime.transport.grpc"


@pytest.mark.parametrize(
    ("library", "owner"),
    [
        ("llama_cpp", "noderuntime.engine.llama.binding"),
        ("grpclib", GRPC),
        ("asyncio", GRPC),
    ],
)
def test_one_module_or_package_imports_each_foreign_runtime(library: str, owner: str) -> None:
    """Only ``owner``, a module or the modules of a package, imports ``library`` in noderuntime."""
    importers = {name for name, imported in _graph().items() if library in imported and name.startswith("noderuntime")}
    owned = {name for name in MODULES if name == owner or name.startswith(owner + ".")}
    assert importers and importers <= owned, sorted(importers - owned)


def _package(module: str) -> str:
    """``noderuntime.node.core`` -> ``noderuntime.node``; top-level packages as they are."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "noderuntime" and len(parts) > 1 else parts[0]


def test_packages_of_the_runtime_import_one_way() -> None:
    """No two of noderuntime's packages import each other, at any distance: a layer cake."""
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for name, imported in _graph().items():
        edges[_package(name)] |= {_package(i) for i in imported if i in MODULES and _package(i) != _package(name)}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo += edges.get(node, ())
        return False

    both_ways = sorted((a, b) for a in edges for b in edges[a] if a < b and reaches(b, a))
    assert both_ways == []


def test_the_public_api_resolves_and_import_noderuntime_loads_no_engine() -> None:
    import subprocess
    import sys

    probe = (
        "import sys, noderuntime\n"
        "assert 'llama_cpp' not in sys.modules and 'torch' not in sys.modules\n"
        "for name in noderuntime.__all__: getattr(noderuntime, name)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_modules_that_name_the_checkout_find_it() -> None:
    """Paths computed from a module's own place, which a move into a package changes."""
    from noderuntime.services import cluster
    from noderuntime.verify import contract

    assert (cluster.ROOT / "pyproject.toml").exists() and (cluster.ROOT / "tests").is_dir()
    assert (contract._ROOT / "benchmarks").is_dir()
