"""kvfence-watch.service passes `systemd-analyze verify`, and the command it runs, with the
example environment file's values, is a valid `kvfence watch`."""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_files import DEPLOY, envvars_of, parse_kvfence

UNIT = DEPLOY / "systemd" / "kvfence-watch.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "kvfence-watch.env.example"
INSTALLED = "/opt/kvfence/bin/kvfence"  # where deploy/container/install.sh puts it


def verify(unit_text: str, tmp_path: Path) -> str:
    """`systemd-analyze verify`'s complaints about the unit (empty: none).

    verify resolves ExecStart's binary, so the copy it reads runs this interpreter's
    kvfence instead of INSTALLED; everything else is the shipped unit. It exits 0 on
    warnings (an unknown directive, an invalid value), so any output counts as a complaint.
    """
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        reason = "systemd-analyze not installed (Debian package systemd; `make systemd`)"
        if os.environ.get("KVFENCE_REQUIRE_SYSTEMD") == "1":
            pytest.fail(reason + "; KVFENCE_REQUIRE_SYSTEMD=1 forbids skipping")
        pytest.skip(reason)
    here = Path(sys.executable).parent / "kvfence"
    assert INSTALLED in unit_text
    unit = tmp_path / UNIT.name
    unit.write_text(unit_text.replace(INSTALLED, str(here)))
    done = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=120
    )
    return (done.stdout + done.stderr).strip() + (
        "" if done.returncode == 0 else f" (exit {done.returncode})"
    )


def test_the_unit_verifies_clean(tmp_path: Path) -> None:
    assert verify(UNIT.read_text(), tmp_path) == ""


def test_verify_complains_about_a_misspelt_directive(tmp_path: Path) -> None:
    """The check above can fail: one misspelt hardening directive is reported."""
    text = UNIT.read_text().replace("NoNewPrivileges=yes", "NoNewPrivilege=yes")
    assert "NoNewPrivilege" in verify(text, tmp_path)


def example_env() -> dict[str, str]:
    env = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    return env


def exec_start_argv(env: dict[str, str]) -> list[str]:
    """ExecStart as systemd runs it: ${VAR} is one word, $VAR is split at whitespace."""
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(UNIT.read_text())
    argv: list[str] = []
    for word in shlex.split(unit["Service"]["ExecStart"]):
        if m := re.fullmatch(r"\$\{(\w+)\}", word):
            argv.append(env[m.group(1)])
        elif m := re.fullmatch(r"\$(\w+)", word):
            argv.extend(env[m.group(1)].split())
        else:
            argv.append(word)
    return argv


def test_exec_start_with_the_example_environment_is_a_valid_watch() -> None:
    env = example_env()
    parsed = parse_kvfence(exec_start_argv(env))
    assert parsed.path == ("watch",)
    assert len(parsed.params["targets"]) == 2
    assert parsed.params["listen"] == env["KVFENCE_WATCH_LISTEN"]
    # Every other variable is one `kvfence watch` reads itself: both tenants' keys and the
    # operator's, none misspelt (a misspelt one would be ignored, and watch started keyless).
    in_exec_start = {"KVFENCE_WATCH_TARGETS", "KVFENCE_WATCH_LISTEN"}
    keys = set(env) - in_exec_start
    assert keys <= envvars_of("watch") and len(keys) == 3, keys
