"""One loop drives each role's engine: only the roles (and the in-process pipeline) step one.

The hub's workers and the workers behind SGLang's router are coordinators: they
hand a role what arrived and carry what it produced, and never step an engine
themselves (kvfence/roles). A second loop that steps an engine would be a
second place where the invariants of a turn (I3 reconcile before a step, I7
transfer_done only after the KV send) must be kept by hand. A step is any
call `x.step()` with no arguments, or `mixed_step(...)`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvfence

SRC = Path(kvfence.__file__).parent

# The prefill and decode roles; the in-process pipeline, whose one thread runs both engines
# in one forward (mixed batches) and so keeps its own turn.
STEPPERS = {"roles/prefill.py", "roles/decode.py", "engine/pipeline.py"}


def steps_an_engine(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "mixed_step":
            return True
        bare = not (node.args or node.keywords)
        if bare and isinstance(func, ast.Attribute) and func.attr == "step":
            return True
    return False


def modules_that_step(root: Path = SRC) -> set[str]:
    return {
        str(path.relative_to(root))
        for path in sorted(root.rglob("*.py"))
        if steps_an_engine(ast.parse(path.read_text(), str(path)))
    }


def test_only_the_roles_step_an_engine() -> None:
    assert modules_that_step() == STEPPERS


def test_the_check_finds_a_second_loop(tmp_path: Path) -> None:
    """The check itself can fail: a coordinator that steps its role's engine is reported."""
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "loop.py").write_text(
        "def turn(side):\n    if side.driver.engine.has_work:\n        side.driver.engine.step()\n"
    )
    (tmp_path / "serve" / "mixed.py").write_text("def turn(p, d):\n    mixed_step(p, d)\n")
    (tmp_path / "serve" / "ok.py").write_text("def f(opt):\n    opt.step(1)\n    x.drain()\n")
    assert modules_that_step(tmp_path) == {"serve/loop.py", "serve/mixed.py"}
