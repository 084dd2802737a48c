"""Click groups whose commands are imported only when invoked.

The base install has no engine: a group lists and describes every command without importing
it (`--help` stays fast and works everywhere), and a command that reaches a module of an extra
this install lacks answers with the install hint (`kvfence.extras`), exit 2, no traceback.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import click

from kvfence.extras import exit_if_missing_extra


def _nothing() -> None:
    return None


@dataclass(frozen=True, slots=True)
class LazyCommand:
    target: str  # "module:attribute"
    short_help: str  # shown by the group's --help without importing the module
    prepare: Callable[[], None] = _nothing  # runs before the import (process-wide settings)

    def load(self) -> click.Command:
        self.prepare()
        module, _, attr = self.target.partition(":")
        command = getattr(importlib.import_module(module), attr)
        assert isinstance(command, click.Command)
        return command


_NO_LAZY: Mapping[str, LazyCommand] = MappingProxyType({})


class LazyGroup(click.Group):
    """A group with commands named in `lazy` beside its own. An extra's missing module is
    caught by the innermost such group, so the hint names the whole command (`kvfence lab
    matrix`, not `kvfence lab`, whose `list` runs on the base install)."""

    def __init__(self, *args: Any, lazy: Mapping[str, LazyCommand] = _NO_LAZY, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        lazy = self.lazy.get(cmd_name)
        return super().get_command(ctx, cmd_name) if lazy is None else lazy.load()

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except ModuleNotFoundError as e:  # importing the command; click has no name for it yet
            exit_if_missing_extra(ctx, e, f"{ctx.command_path} {args[0]}")

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as e:  # running the command, or the group's own body
            sub = ctx.invoked_subcommand
            exit_if_missing_extra(ctx, e, f"{ctx.command_path} {sub}" if sub else ctx.command_path)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names), default=0)
        rows = []
        for name in names:
            lazy = self.lazy.get(name)
            if lazy is not None:
                # Shortened the way click shortens a loaded command's help.
                stand_in = click.Command(name, help=lazy.short_help)
                rows.append((name, stand_in.get_short_help_str(limit)))
                continue
            command = super().get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)
