"""Layers import one way: faults <- kv <- model <- engine <- serve / lab <- cli.

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
# the network-free core (DESIGN.md, Conventions).
UPWARD = ("kvfence.serve", "kvfence.lab", "kvfence.audit", "kvfence.cli", "kvfence.watch")
NETWORK = ("zmq", "socket", "http", "urllib", "requests", "fastapi", "uvicorn", "aiohttp", "httpx")
ENGINE_SIDE = ("kvfence.kv", "kvfence.model", "kvfence.engine", "kvfence.serve", "kvfence.lab")
ENGINE_SIDE += ("kvfence.cli", "kvfence.watch", "torch")
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "faults.py": ("kvfence", "torch", *NETWORK),
    "kv": ("kvfence.model", "kvfence.engine", *UPWARD, *NETWORK),
    "model": ("kvfence.engine", *UPWARD, *NETWORK),
    "engine": (*UPWARD, *NETWORK),
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
