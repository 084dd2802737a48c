"""Lab-only hooks reach production only through the fault registry, never the environment.

A lab hook switched by an environment variable is invisible: nothing on the command
line shows it and `/server_info` does not list it, so an audit could take a lab server
for production. Every lab switch is a `--lab-fault` (kvfence/faults.py), listed in
`/server_info`. So no module outside `kvfence/lab` may name a `KVFENCE_LAB_*` or
`KVFENCE_FAULT*` variable, nor read an environment variable with LAB or FAULT in its name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kvfence

SRC = Path(kvfence.__file__).parent
LAB_VARIABLE = re.compile(r"KVFENCE_(LAB|FAULT)\w*")
ENV_READERS = {("os", "getenv"), ("environ", "get"), ("environ", "setdefault")}


def _dotted(node: ast.expr) -> tuple[str, str] | None:
    """(`a`, `b`) for `a.b` or `x.a.b`; None for anything else."""
    if not isinstance(node, ast.Attribute):
        return None
    owner = node.value
    name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
    return (name, node.attr) if name else None


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _env_keys(tree: ast.AST) -> list[tuple[int, str]]:
    """Literal keys of environment reads: os.getenv(K), os.environ.get(K), os.environ[K],
    K in os.environ."""
    keys: list[tuple[int, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _dotted(node.func) in ENV_READERS and node.args:
            key = node.args[0]
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            key = node.slice
        elif (
            isinstance(node, ast.Compare)
            and isinstance(node.ops[0], ast.In | ast.NotIn)
            and _is_environ(node.comparators[0])
        ):
            key = node.left
        else:
            continue
        value = key.value if isinstance(key, ast.Constant) else None
        keys.append((node.lineno, value if isinstance(value, str) else None))
    return [(line, k) for line, k in keys if k is not None]


def lab_env_hooks(root: Path = SRC) -> list[str]:
    """Every production module that names a lab variable or reads one from the environment."""
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "lab":
            continue  # the lab's own launchers may use what they like
        tree = ast.parse(path.read_text(), str(path))
        found: list[tuple[int, str]] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                named = LAB_VARIABLE.search(node.value)
                if named:
                    found.append((node.lineno, f"names {named.group(0)}"))
        for line, key in _env_keys(tree):
            if "LAB" in key.upper() or "FAULT" in key.upper():
                found.append((line, f"reads {key} from the environment"))
        out += [f"{rel}:{line}: {what}" for line, what in sorted(found)]
    return out


def test_no_production_module_takes_a_lab_hook_from_the_environment() -> None:
    assert lab_env_hooks() == []


def test_the_check_catches_each_way_in(tmp_path: Path) -> None:
    """The check itself can fail: a named variable, each read form, and not the lab."""
    serve = tmp_path / "serve"
    serve.mkdir()
    (serve / "named.py").write_text('HOLD_ENV = "KVFENCE_LAB_HOLD_GRANTED"\n')
    (serve / "reads.py").write_text(
        "import os\n"
        'a = os.getenv("MY_LAB_SWITCH")\n'
        'b = os.environ.get("FAULTY", "")\n'
        'c = os.environ["KV_LAB"]\n'
        'd = "SKIP_FAULT" in os.environ\n'
        'e = os.environ.get("KVFENCE_CACHE")\n'  # not a lab hook: no finding
    )
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "launch.py").write_text('import os\nHOLD = os.environ.get("KVFENCE_LAB_X")\n')
    assert lab_env_hooks(tmp_path) == [
        "serve/named.py:1: names KVFENCE_LAB_HOLD_GRANTED",
        "serve/reads.py:2: reads MY_LAB_SWITCH from the environment",
        "serve/reads.py:3: reads FAULTY from the environment",
        "serve/reads.py:4: reads KV_LAB from the environment",
        "serve/reads.py:5: reads SKIP_FAULT from the environment",
    ]
