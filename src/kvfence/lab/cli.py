"""`kvfence lab`: list the switches, replay the incident, run the defence matrix. Verdicts are exit codes."""

from __future__ import annotations

from types import MappingProxyType

import click
from rich.console import Console
from rich.table import Table

from kvfence.faults import FAULT_INFO, HOLD, HOLD_INFO, Fault
from kvfence.lab.profiles import PROFILES
from kvfence.lazy_cli import LazyCommand, LazyGroup

# tests/test_cli_lazy.py checks that each short help is the command's own.
_ENGINE_COMMANDS = MappingProxyType(
    {
        "replay": LazyCommand(
            "kvfence.lab.engine_cli:replay",
            "Replay the incident, then the same traffic hardened; exit 0 iff the leak reproduced as expected.",
        ),
        "matrix": LazyCommand(
            "kvfence.lab.engine_cli:matrix",
            "The incident under every subset of its four defences; exit 0 iff it leaks only with all four off.",
        ),
    }
)


@click.group(cls=LazyGroup, lazy=_ENGINE_COMMANDS)
def lab() -> None:
    """The incident lab: fault switches that re-create published isolation bugs."""


@lab.command("list")
def list_switches() -> None:
    """Every fault switch, the bug it re-creates and the defence it removes; and the profiles."""
    console = Console()
    table = Table(title="fault switches (all off by default)")
    for col in ("switch", "re-creates", "defence removed"):
        table.add_column(col, overflow="fold")
    for fault in Fault:
        info = FAULT_INFO[fault]
        table.add_row(fault.value, info.recreates, info.defence_removed)
    table.add_row(f"{HOLD}=FOLDER", HOLD_INFO.recreates, HOLD_INFO.defence_removed)
    console.print(table)
    for profile in PROFILES.values():
        console.print(
            f"profile [bold]{profile.name}[/]: {', '.join(profile.faults.names()) or '(none)'} — {profile.description}"
        )
