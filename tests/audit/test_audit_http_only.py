"""The audit (and the guard built on it) reach every engine over HTTP only: they import no
engine, model, serve or lab code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvfence.audit
import kvfence.watch

FORBIDDEN = ("kvfence.engine", "kvfence.model", "kvfence.transfer", "kvfence.serve", "kvfence.lab")
FORBIDDEN += ("kvfence.roles", "kvfence.hub", "kvfence.sglang_stack", "kvfence.launch")


@pytest.mark.parametrize(("package", "min_files"), [(kvfence.audit, 10), (kvfence.watch, 4)])
def test_package_imports_no_engine_internals(package: object, min_files: int) -> None:
    root = Path(str(getattr(package, "__file__", ""))).parent
    offenders = []
    files = sorted(root.rglob("*.py"))
    assert len(files) > min_files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith(FORBIDDEN)]
    assert offenders == []
