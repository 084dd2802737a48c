"""One loop drives each role's engine: only a role's `turn` steps one, in every topology.

The single process (serve/pipeline.py), the hub's workers and the workers behind
SGLang's router are coordinators: they hand a role what arrived and carry what it
produced, and never step an engine themselves (kvfence/roles). In one process the
prefill role's turn carries decode's rows in its forward (mixed batches), so even
there no second loop exists. A second place that steps an engine would be a second
place where the invariants of a turn (I3 reconcile before a step, I7 transfer_done
only after the KV send) must be kept by hand.

A step is a call `x.step()` with no arguments, `mixed_step(...)`, or a step's own
halves, `x.plan_step(...)` and `x.finish_step(...)`. Inside the engine package the
only callers may be the step definitions themselves (`step`, `mixed_step`), which
compose those halves.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvfence

SRC = Path(kvfence.__file__).parent

ROLE_TURNS = {"roles/prefill.py: PrefillRole.turn", "roles/decode.py: DecodeRole.turn"}
HALVES = {"plan_step", "finish_step"}
ENGINE_STEPS = {"step", "mixed_step"}  # where the engine composes its halves into a step


def is_step(node: ast.Call) -> bool:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id == "mixed_step"
    if not isinstance(func, ast.Attribute):
        return False
    return func.attr in HALVES or (func.attr == "step" and not (node.args or node.keywords))


def step_sites(path: Path, root: Path) -> set[str]:
    """`module: Qualified.function` for every function in `path` that steps an engine."""
    module = str(path.relative_to(root))
    sites: set[str] = set()

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, (*scope, child.name))
                continue
            if isinstance(child, ast.Call) and is_step(child):
                sites.add(f"{module}: {'.'.join(scope) or '<module>'}")
            visit(child, scope)

    visit(ast.parse(path.read_text(), str(path)), ())
    return sites


def engine_composes(site: str) -> bool:
    module, _, name = site.partition(": ")
    return module.startswith("engine/") and name.rsplit(".", 1)[-1] in ENGINE_STEPS


def sites_that_step(root: Path = SRC) -> set[str]:
    """Every function that steps an engine, the engine's own step definitions left out."""
    found = set().union(*(step_sites(p, root) for p in sorted(root.rglob("*.py"))))
    return {s for s in found if not engine_composes(s)}


def test_only_the_roles_turns_step_an_engine() -> None:
    assert sites_that_step() == ROLE_TURNS


def test_the_check_finds_a_second_loop(tmp_path: Path) -> None:
    """The check itself can fail: a coordinator, a role's helper or an engine-side loop that
    steps an engine (whole or by halves) is reported; the engine's own step is not."""
    for pkg in ("serve", "roles", "engine"):
        (tmp_path / pkg).mkdir()
    (tmp_path / "serve" / "loop.py").write_text(
        "class Coordinator:\n    def turn(self, side):\n        side.driver.engine.step()\n"
    )
    (tmp_path / "serve" / "mixed.py").write_text("def turn(p, d):\n    mixed_step(p, d)\n")
    (tmp_path / "serve" / "ok.py").write_text("def f(opt):\n    opt.step(1)\n    x.drain()\n")
    (tmp_path / "roles" / "prefill.py").write_text(
        "class PrefillRole:\n    def turn(self, c):\n        self.engine.step()\n"
        "    def helper(self):\n        s = self.engine.plan_step()\n"
    )
    (tmp_path / "engine" / "prefill.py").write_text(
        "class PrefillEngine:\n    def step(self):\n        self.finish_step(self.plan_step(), 0)\n"
    )
    (tmp_path / "engine" / "loop.py").write_text("def run(e):\n    while True:\n        e.step()\n")
    assert sites_that_step(tmp_path) == {
        "serve/loop.py: Coordinator.turn",
        "serve/mixed.py: turn",
        "roles/prefill.py: PrefillRole.turn",
        "roles/prefill.py: PrefillRole.helper",
        "engine/loop.py: run",
    }
