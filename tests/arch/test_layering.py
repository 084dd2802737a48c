"""Layers import one way: faults <- kv <- model <- engine <- transfer <- roles <- serve <-
hub / sglang_stack <- launch / lab <- cli.

The audit sits beside them and reaches engines over HTTP only
(tests/audit/test_audit_http_only.py). Every import counts, lazy ones inside a
function included: a lazy import that points up is the same cycle, only later.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvfence

SRC = Path(kvfence.__file__).parent

# What each layer must never import. Network and process libraries stay out of
# the network-free core (docs/ARCHITECTURE.md, "The layers").
# The coordinators (hub, sglang_stack) sit on serve; launch (the `kvfence serve` command) on them.
COORDINATORS = ("kvfence.hub", "kvfence.sglang_stack", "kvfence.launch")
UPWARD = ("kvfence.serve", *COORDINATORS, "kvfence.lab", "kvfence.audit", "kvfence.cli")
UPWARD += ("kvfence.watch",)
NETWORK = ("zmq", "socket", "http", "urllib", "requests", "fastapi", "uvicorn", "aiohttp", "httpx")
ENGINE_SIDE = ("kvfence.kv", "kvfence.model", "kvfence.engine", "kvfence.serve", "kvfence.lab")
ENGINE_SIDE += ("kvfence.transfer", "kvfence.roles", *COORDINATORS, "kvfence.cli", "kvfence.watch")
ENGINE_SIDE += ("torch",)
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "faults.py": ("kvfence", "torch", *NETWORK),
    "kv": ("kvfence.model", "kvfence.engine", "kvfence.transfer", *UPWARD, *NETWORK),
    "model": ("kvfence.engine", "kvfence.transfer", *UPWARD, *NETWORK),
    "engine": ("kvfence.transfer", *UPWARD, *NETWORK),
    # The transports move pages between pools: sockets yes, HTTP edge, lab and audit no.
    "transfer": UPWARD,
    # The roles drive the engines over their KV halves; coordinators (serve) drive the roles.
    "roles": UPWARD,
    # serve (the HTTP edge, the single process, the specs and the start-up sequence) sits under
    # the coordinators that use it, the lab (which drives them) and the CLI (which wires all).
    "serve": (*COORDINATORS, "kvfence.lab", "kvfence.cli"),
    # Two coordinators over the same roles: neither reaches into the other.
    "hub": ("kvfence.sglang_stack", "kvfence.launch", "kvfence.lab", "kvfence.cli"),
    "sglang_stack": ("kvfence.hub", "kvfence.launch", "kvfence.lab", "kvfence.cli"),
    "launch": ("kvfence.lab", "kvfence.cli"),
    "lab": ("kvfence.cli",),
    # The audit reaches engines over HTTP only (it may start `kvfence serve` as a process).
    "audit": ENGINE_SIDE,
    # The guard reaches engines only through the audit's adapters, over HTTP.
    "watch": tuple(m for m in ENGINE_SIDE if m != "kvfence.watch"),
    # The HTTP edge's synchronous halves: unit-testable without a server or a socket.
    "serve/admission.py": ("kvfence.serve.router", "starlette", "fastapi", *NETWORK),
    "serve/responses.py": ("kvfence.serve.router", "kvfence.engine", "starlette", *NETWORK),
    "serve/protocol.py": ("kvfence.serve.router", "kvfence.engine", "starlette", *NETWORK),
}
# faults.py is stdlib-only; these are its own module paths, not imports of the package.
SELF_OK = {"faults.py": ("kvfence.faults",)}


def imported_modules(path: Path) -> list[str]:
    """Every module name `path` imports. The project writes absolute imports only, so a
    relative one is reported as itself (it could hide an upward arrow)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(
                "." * node.level + (node.module or "") if node.level else node.module or ""
            )
    return names


def layer_violations(layer: str, root: Path = SRC) -> list[str]:
    files = [root / layer] if layer.endswith(".py") else sorted((root / layer).rglob("*.py"))
    forbidden = FORBIDDEN[layer]
    allowed = SELF_OK.get(layer, ())
    out = []
    for path in files:
        for name in imported_modules(path):
            hit = name.startswith(".") or any(
                name == f or name.startswith(f + ".") for f in forbidden
            )
            if hit and not name.startswith(allowed):
                out.append(f"{path.relative_to(root)}: imports {name}")
    return out


# Test-only libraries: only the pool harness, which users run in their own tests, uses one.
TEST_ONLY = ("hypothesis", "pytest")
TEST_ONLY_OK = {"kv/harness.py"}


def imports_of_test_libraries(root: Path = SRC) -> list[str]:
    return [
        f"{path.relative_to(root)}: imports {name}"
        for path in sorted(root.rglob("*.py"))
        if str(path.relative_to(root)) not in TEST_ONLY_OK
        for name in imported_modules(path)
        if name.split(".")[0] in TEST_ONLY
    ]


def test_test_libraries_stay_in_the_harness(tmp_path: Path) -> None:
    assert imports_of_test_libraries() == []
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "harness.py").write_text("import hypothesis\n")
    (tmp_path / "kv" / "pool.py").write_text("from hypothesis import given\n")
    assert imports_of_test_libraries(tmp_path) == ["kv/pool.py: imports hypothesis"]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_down_only(layer: str) -> None:
    files = [SRC / layer] if layer.endswith(".py") else list((SRC / layer).rglob("*.py"))
    assert files and all(f.exists() for f in files), f"layer {layer} has no modules"
    assert layer_violations(layer) == []


def test_layering_check_catches_an_upward_import(tmp_path: Path) -> None:
    """The check itself can fail: a model module that imports the engine is reported."""
    fake = tmp_path / "model"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from kvfence.engine.request import Request\n")
    (fake / "ok.py").write_text("from kvfence.kv.pool import KVPool\n")
    assert layer_violations("model", root=tmp_path) == [
        "model/bad.py: imports kvfence.engine.request"
    ]
    kv = tmp_path / "kv"
    kv.mkdir()
    (kv / "bad.py").write_text("import zmq\nfrom kvfence.model import base\n")
    assert layer_violations("kv", root=tmp_path) == [
        "kv/bad.py: imports zmq",
        "kv/bad.py: imports kvfence.model",
    ]


def _package_of(name: str, root: Path) -> str | None:
    """The top-level part of kvfence a module name lives in (`kvfence.launch.hub` -> launch,
    `kvfence.cli` -> cli); "kvfence" for the package's own `__init__`; None outside kvfence."""
    parts = name.split(".")
    if parts[0] != "kvfence":
        return None
    if len(parts) == 1:
        return "kvfence"
    top = parts[1]
    return top if (root / top).is_dir() or (root / f"{top}.py").exists() else "kvfence"


def package_graph(root: Path = SRC) -> dict[str, set[str]]:
    """Which top-level parts of kvfence import which (every import, lazy ones included)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        me = "kvfence" if rel == Path("__init__.py") else rel.parts[0].removesuffix(".py")
        out = graph.setdefault(me, set())
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                names = subs if node.module == "kvfence" else [node.module]
            out.update(p for n in names if (p := _package_of(n, root)) not in (None, me))
    return graph


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle reachable in the graph, each as the path that closes it."""
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycles.append([*path[path.index(node) :], node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for start in sorted(graph):
        visit(start, [])
    return cycles


def test_no_package_imports_itself_round_a_cycle() -> None:
    graph = package_graph()
    assert {"faults", "kv", "model", "engine", "serve", "lab", "audit", "cli"} <= set(graph)
    assert package_cycles(graph) == []


def test_the_cycle_check_catches_a_cycle(tmp_path: Path) -> None:
    """The check itself can fail: serve importing the lab, which imports serve, is a cycle."""
    for pkg, text in (
        ("serve", "def f():\n    from kvfence.lab.profiles import PROFILES\n"),
        ("lab", "from kvfence.serve.build import build_local\n"),
        ("kv", "from kvfence import faults\n"),
    ):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "m.py").write_text(text)
    (tmp_path / "faults.py").write_text("X = 1\n")
    graph = package_graph(tmp_path)
    assert graph == {"serve": {"lab"}, "lab": {"serve"}, "kv": {"faults"}, "faults": set()}
    assert package_cycles(graph) == [["lab", "serve", "lab"]]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(root: Path = SRC) -> dict[str, set[str]]:
    """Which modules of kvfence import which: `from a.b import c` points at the module a.b.c
    where there is one, else at a.b; every import counts, lazy ones and those only for the
    type checker (`if TYPE_CHECKING:`) included: a cycle moved under either still ties the
    two modules together (neither can be read, tested or moved without the other), only later."""
    paths = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for me, path in paths.items():
        out = graph.setdefault(me, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in paths)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if sub in paths or node.module in paths:
                        out.add(sub if sub in paths else node.module)
        out.discard(me)
    return graph


def module_cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The groups of modules that import each other round a cycle (the graph's strongly
    connected components of more than one module), by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: set[frozenset[str]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = {stack.pop()}
            while node not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.add(frozenset(group))

    for start in sorted(graph):
        if start not in index:
            visit(start)
    return groups


# Module cycles that remain, each one group of modules (none today: keep it so); the list
# only shrinks (a new cycle fails below, and so does an entry that is no longer a cycle).
MODULE_CYCLES_ALLOWED: set[frozenset[str]] = set()


def test_no_module_imports_itself_round_a_cycle() -> None:
    graph = module_graph()
    assert {"kvfence.audit.base", "kvfence.audit.contract", "kvfence.serve.router"} <= set(graph)
    assert module_cycles(graph) - MODULE_CYCLES_ALLOWED == set()


def test_the_module_cycle_allow_list_only_names_cycles_that_remain() -> None:
    assert MODULE_CYCLES_ALLOWED - module_cycles(module_graph()) == set()


def test_the_module_cycle_check_catches_a_cycle(tmp_path: Path) -> None:
    """The check itself can fail: a lazy import and a type-checking-only one each close a
    cycle; a module importing its sibling one way only is none."""
    pkg = tmp_path / "kvfence"
    (pkg / "audit").mkdir(parents=True)
    for name, text in (
        ("__init__.py", ""),
        ("audit/__init__.py", ""),
        ("audit/base.py", "def f():\n    from kvfence.audit.client import Client\n"),
        ("audit/client.py", "from kvfence.audit import base\n"),
        (
            "audit/a.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvfence.audit.b\n",
        ),
        ("audit/b.py", "from kvfence.audit.a import X\n"),
        ("audit/c.py", "from kvfence.audit.base import f\n"),
    ):
        (pkg / name).write_text(text)
    graph = module_graph(pkg)
    assert graph["kvfence.audit.c"] == {"kvfence.audit.base"}
    assert graph["kvfence.audit.client"] == {"kvfence.audit.base"}
    assert module_cycles(graph) == {
        frozenset({"kvfence.audit.base", "kvfence.audit.client"}),
        frozenset({"kvfence.audit.a", "kvfence.audit.b"}),
    }
