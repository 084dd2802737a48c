"""`kvfence --help` and `kvfence gate` answer without importing torch or the lazy commands."""

from __future__ import annotations

import os
import subprocess
import sys

import click
import pytest

from kvfence.cli import _LAZY_COMMANDS


@pytest.mark.parametrize("argv", [["--help"], ["gate"]])
def test_help_and_gate_do_not_import_torch(argv: list[str]) -> None:
    code = (
        "import sys\n"
        "from kvfence.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        "heavy = sorted(m for m in ('torch', 'kvfence.launch.cli', 'kvfence.audit.cli',"
        " 'kvfence.lab.cli') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "HEAVY []" in out, out


@pytest.mark.parametrize("name", sorted(_LAZY_COMMANDS))
def test_lazy_short_help_is_the_commands_own(name: str) -> None:
    lazy = _LAZY_COMMANDS[name]
    command = lazy.load()
    assert isinstance(command, click.Command)
    own = (command.help or "").strip().splitlines()[0]
    assert own == lazy.short_help, f"update the short help of {name!r} in kvfence/cli.py"


def test_the_supervisor_and_router_roles_do_not_import_torch() -> None:
    # `kvfence serve --disaggregated` and `--role router` load no model: every torch import
    # they skip is start-up time the workers get on a small machine.
    code = (
        "import sys\n"
        "import kvfence.launch.cli, kvfence.hub.launch\n"
        "print('TORCH', 'torch' in sys.modules)\n"
        "print('WEB', sorted(m for m in ('starlette', 'uvicorn', 'kvfence.serve.app')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "TORCH False" in out, out
    # The supervisor and the workers do not serve HTTP: the web stack is the router's alone.
    assert "WEB []" in out, out


def test_the_lab_loads_with_passive_openmp_waits_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The lab's replay and matrix run the engine in this process, and libgomp reads its wait
    # settings once, when torch loads it: they are set before the lab's modules are imported,
    # and a setting the user made is theirs. (`kvfence serve` sets them itself:
    # tests/test_cli_heap.py.)
    for chosen in ((None, None), ("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "5")):
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
        if chosen[0] is not None:
            monkeypatch.setenv(chosen[0], chosen[1])
        _LAZY_COMMANDS["lab"].load()
        expected: dict[str, str | None] = {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}
        expected.update({chosen[0]: chosen[1]} if chosen[0] else {"OMP_WAIT_POLICY": "PASSIVE"})
        assert {k: os.environ.get(k) for k in expected} == expected, chosen
