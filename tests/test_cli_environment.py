"""The environment variables the CLI reads are shown in its --help."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import click
from click.testing import CliRunner

import kvfence
from kvfence.cli import main

SRC = Path(kvfence.__file__).parent


def _commands(group: click.Group, ctx: click.Context) -> Iterator[tuple[str, click.Command]]:
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, name
        yield f"{ctx.command_path} {name}", command
        if isinstance(command, click.Group):
            yield from _commands(command, click.Context(command, info_name=name, parent=ctx))


def test_every_option_read_from_the_environment_shows_its_variable() -> None:
    ctx = click.Context(main, info_name="kvfence")
    hidden = [
        f"{path} {'/'.join(p.opts)}"
        for path, command in _commands(main, ctx)
        for p in command.params
        if isinstance(p, click.Option) and p.envvar and not p.show_envvar
    ]
    assert hidden == []


def test_the_top_level_help_names_the_variables_read_outside_options() -> None:
    # The variables kvfence's code reads by name (those one kvfence process hands another it
    # starts are passed as a mapping, not read this way; options show their own).
    read = set(re.findall(r"environ\.get\(\s*\"(KVFENCE_[A-Z_]+)\"", _source()))
    assert {"KVFENCE_CACHE", "KVFENCE_EXT_DIR"} <= read
    shown = CliRunner().invoke(main, ["--help"]).output
    assert [v for v in sorted(read) if v not in shown] == []
    for option_var in ("KVFENCE_AUDIT_KEY_A", "KVFENCE_AUDIT_OPERATOR_KEY"):
        assert option_var in CliRunner().invoke(main, ["audit", "--help"]).output
        assert option_var in CliRunner().invoke(main, ["watch", "--help"]).output


def _source() -> str:
    return "\n".join(p.read_text() for p in sorted(SRC.rglob("*.py")))
