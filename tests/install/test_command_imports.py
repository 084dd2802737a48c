"""The base install's commands reach no engine module; an engine command without the extra
names it. Subprocesses: each starts with nothing imported (or with the engine hidden)."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import click
import pytest

from kvfence.extras import EXTRA_MODULES, MissingExtra, missing_extra
from kvfence.lab.cli import _ENGINE_COMMANDS

ROOT = Path(__file__).resolve().parents[2]
ENGINE = EXTRA_MODULES["serve"] + EXTRA_MODULES["pd"]
HINT = "pip install 'kvfence[serve]'"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )


def _engine_loaded_after(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {ENGINE!r} if m in sys.modules)))\n"
    done = _run(probe)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return loaded


def test_every_audit_and_watch_module_imports_without_the_engine() -> None:
    # Every module, the checks the runbook loads lazily included: a check that reached torch
    # would come back INCONCLUSIVE on the base install ("could not load"), never a verdict.
    code = (
        "import importlib, pkgutil, kvfence.audit, kvfence.watch\n"
        "for pkg in (kvfence.audit, kvfence.watch):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
    )
    assert _engine_loaded_after(code) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["gate"],
        ["audit", "--help"],
        ["audit", "latency", "--help"],
        ["watch", "--help"],
        ["lab", "--help"],
        ["lab", "list"],
    ],
    ids=" ".join,
)
def test_base_commands_load_no_engine_module(argv: list[str]) -> None:
    code = (
        "from kvfence.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
    )
    assert _engine_loaded_after(code) == []


# Hides modules the way the base install lacks them: no finder finds them, so importing one
# raises ModuleNotFoundError and importlib.util.find_spec answers None.
_HIDE = """
import sys
from importlib.machinery import PathFinder

class _Hidden(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return PathFinder.find_spec(name, path, target)

sys.meta_path[:] = [_Hidden if f is PathFinder else f for f in sys.meta_path]
"""


def _without(hidden: tuple[str, ...], code: str) -> subprocess.CompletedProcess[str]:
    return _run(f"HIDDEN = {set(hidden)!r}\n{_HIDE}\n{code}")


def _without_engine(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """`kvfence ARGV` in a process where the serve extra's modules cannot be found."""
    code = f"from kvfence.cli import main\nmain({argv!r}, prog_name='kvfence')\n"
    return _without(EXTRA_MODULES["serve"], code)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["serve"], "kvfence serve needs"),
        (["serve", "--help"], "kvfence serve needs"),
        (["lab", "matrix"], "kvfence lab matrix needs"),
        (["lab", "replay"], "kvfence lab replay needs"),
        (["make-model", "/nonexistent/kvfence-model"], "kvfence make-model needs"),
        (["audit"], "kvfence audit without --target (the embedded demo) needs"),
        ([], "the demo (kvfence with no command) needs"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_an_engine_command_without_the_extra_names_it(argv: list[str], named: str) -> None:
    done = _without_engine(argv)
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    hint = [ln for ln in done.stderr.splitlines() if HINT in ln]
    assert len(hint) == 1 and hint[0].startswith(named), done.stderr
    assert re.search(r"\(\w+ is not installed\)", hint[0]), hint[0]


@pytest.mark.parametrize("argv", [["lab", "list"], ["gate"], ["audit", "--help"]], ids=" ".join)
def test_base_commands_run_without_the_engine(argv: list[str]) -> None:
    done = _without_engine(argv)
    assert done.returncode == 0, done.stderr[-3000:]
    assert HINT not in done.stdout + done.stderr


def test_a_module_that_is_installed_but_fails_is_not_called_missing() -> None:
    # No false hint: torch is installed here, so an import error naming it is a real error.
    assert missing_extra(ModuleNotFoundError("boom", name="torch")) is None
    assert missing_extra(ModuleNotFoundError("boom", name="no_such_module_anywhere")) is None
    # ... and one the engine needs that is absent is named with its extra.
    code = (
        "from kvfence.extras import missing_extra\n"
        "try:\n    import zmq.asyncio\n"
        "except ModuleNotFoundError as e:\n    print(missing_extra(e))\n"
    )
    blocked = _without(("zmq",), code)
    assert blocked.stdout.strip() == repr(MissingExtra("zmq", "serve")), blocked.stderr


def _distributions(requirements: list[str]) -> set[str]:
    names = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}
    return {n.replace("_", "-") for n in names} - {"kvfence"}


def test_the_extras_modules_are_the_extras_distributions() -> None:
    """kvfence.extras names the serve extra's modules; pyproject.toml its distributions: the
    two lists must describe the same install, and the base install shares none of them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    serve = _distributions(project["optional-dependencies"]["serve"])
    by_module = importlib.metadata.packages_distributions()
    provided = {
        dist.lower().replace("_", "-")
        for module in EXTRA_MODULES["serve"]
        for dist in by_module.get(module, [])
    }
    assert provided == serve
    assert not serve & _distributions(project["dependencies"])


@pytest.mark.parametrize("name", sorted(_ENGINE_COMMANDS))
def test_lab_lazy_short_help_is_the_commands_own(name: str) -> None:
    lazy = _ENGINE_COMMANDS[name]
    command = lazy.load()
    assert isinstance(command, click.Command)
    own = (command.help or "").strip().splitlines()[0]
    assert own == lazy.short_help, f"update the short help of {name!r} in kvfence/lab/cli.py"
