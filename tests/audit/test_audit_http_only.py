"""The audit reaches every engine over HTTP only: it imports no engine, model, serve or lab code."""

from __future__ import annotations

import ast
from pathlib import Path

import kvfence.audit

FORBIDDEN = ("kvfence.engine", "kvfence.model", "kvfence.serve", "kvfence.lab")


def test_audit_package_imports_no_engine_internals() -> None:
    root = Path(kvfence.audit.__file__).parent
    offenders = []
    files = sorted(root.rglob("*.py"))
    assert len(files) > 10
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith(FORBIDDEN)]
    assert offenders == []
