"""One start-up sequence, one gate exit code, and coordinators that do not reach into each other.

Every serving process ends with the same code when its live pools fail the capacity gate
(I4): scripts and supervisors tell a refused start from a crash by it. A second definition,
or a literal exit in a gate handler, lets the two drift apart unnoticed.

The hub (hub/) and SGLang-style workers (sglang_stack/) are two coordinators over the
same roles: what both need (the specs, the start-up sequence) lives beside them in serve/,
so either can change without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvfence

SRC = Path(kvfence.__file__).parent
GATE_ERROR = "CapacityGateError"
EXITS = {("sys", "exit"), ("os", "_exit")}


def _modules(root: Path = SRC) -> list[tuple[str, ast.Module]]:
    return [
        (str(p.relative_to(root)), ast.parse(p.read_text(), str(p)))
        for p in sorted(root.rglob("*.py"))
    ]


def gate_exit_definitions(root: Path = SRC) -> list[str]:
    """The modules that bind `EXIT_GATE` at module level."""
    out = []
    for name, tree in _modules(root):
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            targets += [node.target] if isinstance(node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == "EXIT_GATE" for t in targets):
                out.append(name)
    return out


def _catches_gate_error(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    names = [k.id if isinstance(k, ast.Name) else getattr(k, "attr", "") for k in kinds]
    return GATE_ERROR in names


def _literal_exit(node: ast.AST) -> bool:
    """`return 1`, `sys.exit(1)`, `os._exit(1)`, `raise SystemExit(1)`: a code spelled as a
    number where the one named code belongs."""
    if isinstance(node, ast.Return):
        return isinstance(node.value, ast.Constant) and isinstance(node.value.value, int)
    if not isinstance(node, ast.Call) or not node.args:
        return False
    f = node.func
    is_exit = isinstance(f, ast.Name) and f.id == "SystemExit"
    is_exit |= (
        isinstance(f, ast.Attribute)
        and isinstance(f.value, ast.Name)
        and (f.value.id, f.attr) in EXITS
    )
    return is_exit and isinstance(node.args[0], ast.Constant)


def literal_gate_exits(root: Path = SRC) -> list[str]:
    """Every handler of a failed gate that exits with a literal code, as `module:line`."""
    out = []
    for name, tree in _modules(root):
        for handler in ast.walk(tree):
            if isinstance(handler, ast.ExceptHandler) and _catches_gate_error(handler):
                for stmt in handler.body:
                    out += [f"{name}:{n.lineno}" for n in ast.walk(stmt) if _literal_exit(n)]
    return out


def imports_between(a: str, b: str, root: Path = SRC) -> list[str]:
    """Every import in package `a` (a path under src/kvfence) of package `b` (dotted)."""
    out = []
    for path in sorted((root / a).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [x.name for x in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            rel = path.relative_to(root)
            out += [f"{rel}: imports {n}" for n in names if n == b or n.startswith(b + ".")]
    return out


def test_the_gate_exit_code_is_defined_in_one_module() -> None:
    assert gate_exit_definitions() == ["serve/config.py"], (
        "EXIT_GATE is defined once (serve/config.py); import it there"
    )


def test_no_gate_failure_exits_with_a_literal_code() -> None:
    assert literal_gate_exits() == [], "a failed gate exits with EXIT_GATE, not a literal"


def test_the_hub_and_sglang_workers_do_not_import_each_other() -> None:
    found = imports_between("sglang_stack", "kvfence.hub")
    found += imports_between("hub", "kvfence.sglang_stack")
    assert found == [], "shared parts belong in serve/ (specs.py, serving.py):\n" + "\n".join(found)


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    # A second definition, each literal exit form, and an import across: every one is seen.
    (tmp_path / "hub").mkdir()
    (tmp_path / "sglang_stack").mkdir()
    (tmp_path / "a.py").write_text("EXIT_GATE = 1\n")
    (tmp_path / "b.py").write_text("EXIT_GATE: int = 1\n")
    (tmp_path / "c.py").write_text(
        "import os, sys\n"
        "def f():\n"
        "    try:\n        g()\n    except CapacityGateError:\n        return 1\n"
        "    try:\n        g()\n    except (ValueError, sizing.CapacityGateError):\n"
        "        sys.exit(1)\n"
        "    try:\n        g()\n    except CapacityGateError:\n        raise SystemExit(1)\n"
        "    try:\n        g()\n    except CapacityGateError:\n        os._exit(1)\n"
        "    try:\n        g()\n    except CapacityGateError:\n        sys.exit(EXIT_GATE)\n"
        "    try:\n        g()\n    except ValueError:\n        return 1\n"
    )
    (tmp_path / "sglang_stack" / "w.py").write_text("from kvfence.hub.x import y\n")
    (tmp_path / "hub" / "w.py").write_text("import kvfence.sglang_stack\n")
    assert gate_exit_definitions(tmp_path) == ["a.py", "b.py"]
    assert literal_gate_exits(tmp_path) == ["c.py:6", "c.py:10", "c.py:14", "c.py:18"]
    assert imports_between("sglang_stack", "kvfence.hub", tmp_path) == [
        "sglang_stack/w.py: imports kvfence.hub.x"
    ]
    assert imports_between("hub", "kvfence.sglang_stack", tmp_path) == [
        "hub/w.py: imports kvfence.sglang_stack"
    ]
