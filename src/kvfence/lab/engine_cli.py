"""`kvfence lab replay` and `kvfence lab matrix`: they run kvfence's engine (the `serve` extra),
so `kvfence lab` imports this module only when one of them is invoked."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from kvfence.faults import FAULT_INFO, FaultSet
from kvfence.lab.matrix import ROWS, MatrixRow, combinations, run_matrix
from kvfence.lab.profiles import get_profile
from kvfence.lab.replay import ReplaySide, run_replay
from kvfence.lab.routed import TOPOLOGIES, server_for
from kvfence.lab.scenario import ScenarioResult
from kvfence.model.tiny import default_checkpoint_dir

_MODEL = click.option(
    "--checkpoint",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="HF checkpoint directory (default: the embedded tiny checkpoint, made on first use)",
)


@click.command()
@click.option("--profile", "profile_name", default="workers-ai-2026", show_default=True)
@click.option(
    "--model",
    "model_kind",
    type=click.Choice(["mirror", "llama"]),
    default=None,
    help="default: the profile's (mirror)",
)
@click.option("--seed", type=int, default=0, show_default=True)
@_MODEL
def replay(profile_name: str, model_kind: str | None, seed: int, checkpoint: Path | None) -> None:
    """Replay the incident, then the same traffic hardened; exit 0 iff the leak reproduced as expected."""
    profile = get_profile(profile_name)
    console = Console()
    console.print(f"[bold]kvfence lab replay[/] — profile {profile.name}: {profile.description}")
    s = profile.scale
    console.print(
        f"scaled geometry: context {s.context_length} tokens, prefill pool {s.prefill_pool_tokens} tokens "
        f"({s.prefill_pool_tokens / s.context_length:.3f} x context; the incident: 681,280 / 1,048,576 = 0.650)"
    )
    result = run_replay(
        checkpoint or default_checkpoint_dir(), profile, model_kind=model_kind, seed=seed
    )
    table = Table(title="what tenant B received")
    table.add_column("")
    for side in (result.incident, result.hardened):
        table.add_column(side.label, overflow="fold", ratio=1)
    first_i, first_h = result.incident.results[0], result.hardened.results[0]
    table.add_row("A's sentinel", first_i.sentinel, first_h.sentinel)
    table.add_row(
        "B prompt tokens sent", str(first_i.b.prompt_tokens), str(first_h.b.prompt_tokens)
    )
    table.add_row("HTTP status", _statuses(result.incident), _statuses(result.hardened))
    table.add_row("usage.prompt_tokens", _usage(first_i), _usage(first_h))
    for i, (ri, rh) in enumerate(
        zip(result.incident.results, result.hardened.results, strict=True)
    ):
        table.add_row(f"B's body (after A's {ri_topic(i)} traffic)", _shown(ri), _shown(rh))
    table.add_row("A's data in B's body", _leak(first_i), _leak(first_h))
    table.add_row("verdict", _verdict(result.incident), _verdict(result.hardened))
    console.print(table)
    if result.reproduced:
        console.print(
            "[green]reproduced as expected[/]: the leak under the incident profile, a clean error with the defences on"
        )
        return
    console.print("[red]NOT reproduced as expected[/]")
    sys.exit(1)


@click.command()
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--topology",
    type=click.Choice(TOPOLOGIES),
    default="single",
    show_default=True,
    help="single: one kvfence process; sglang-router: the real sglang-router (PD mode) in front "
    "of a kvfence prefill and decode worker, one stack per row",
)
@click.option(
    "--transport",
    type=click.Choice(["mooncake", "nixl", "tcp"]),
    default="mooncake",
    show_default=True,
    help="with --topology sglang-router: what moves the KV between the workers",
)
@click.option(
    "--rows",
    type=click.Choice(ROWS),
    default="all",
    show_default=True,
    help="all: every subset of the four defences; singles: the incident, then each defence alone",
)
@click.option(
    "--also-fault",
    "also_faults",
    multiple=True,
    help="a switch turned on in every row besides the incident's (one that breaks a defence "
    "turns the matrix red: the proof it can fail); repeatable",
)
@_MODEL
def matrix(
    seed: int,
    topology: str,
    transport: str,
    rows: str,
    also_faults: tuple[str, ...],
    checkpoint: Path | None,
) -> None:
    """The incident under every subset of its four defences; exit 0 iff it leaks only with all four off."""
    console = Console()
    where = "" if topology == "single" else f", behind sglang-router with {transport} transfer"
    console.print(
        f"[bold]kvfence lab matrix[/] — the incident scenario under {rows} subsets of its "
        f"defences{where}"
    )
    try:
        also = FaultSet.parse(also_faults)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--also-fault") from None
    if topology != "single":
        from kvfence.transfer.native import missing_native

        if (missing := missing_native(transport)) is not None:
            raise click.UsageError(missing)

    def progress(i: int, n: int, row: MatrixRow) -> None:
        console.print(
            f"  [{i}/{n}] defences on: {_defences(row)} -> {row.result.outcome.value}",
            highlight=False,
        )

    server = server_for(topology, transport)
    results = run_matrix(
        checkpoint or default_checkpoint_dir(),
        seed=seed,
        progress=progress,
        combos=combinations(rows),
        also=also,
        server=server,
    )
    console.print(_matrix_table(results))
    bad = [r for r in results if not r.as_expected]
    if bad:
        console.print(f"[red]{len(bad)} combination(s) did not behave as expected[/]")
        sys.exit(1)
    console.print(
        "[green]defence in depth holds[/]: the leak occurs only with every defence off; any one defence stops it"
    )


def _matrix_table(results: list[MatrixRow]) -> Table:
    table = Table(
        title="defence matrix (I4 capacity gate/edge, I2 terminal reject, I3 reconciliation, I1 ledger check)"
    )
    for col in ("defences on", "B status", "B received", "outcome", "expected"):
        table.add_column(col, overflow="fold")
    for row in results:
        style = None if row.as_expected else "red"
        table.add_row(
            _defences(row),
            str(row.result.b.status),
            row.result.b.text[:72],
            row.result.outcome.value,
            row.expected.value + ("" if row.as_expected else "  <-- MISMATCH"),
            style=style,
        )
    return table


def ri_topic(i: int) -> str:
    return ("first", "second")[i] if i < 2 else str(i + 1)


def _defences(row: MatrixRow) -> str:
    return (
        ", ".join(sorted(FAULT_INFO[f].defence_removed.split(" ")[0] for f in row.defences_on))
        or "none (the incident)"
    )


def _statuses(side: ReplaySide) -> str:
    return " / ".join(str(r.b.status) for r in side.results)


def _usage(r: ScenarioResult) -> str:
    n = r.b.reported_prompt_tokens
    return (
        "—"
        if n is None
        else f"{n} ({'matches' if n == r.b.prompt_tokens else 'differs from'} B's request)"
    )


def _shown(r: ScenarioResult) -> str:
    return repr(r.b.text[:160])


def _leak(r: ScenarioResult) -> str:
    return f"YES: {r.leaked_fragment!r}" if r.leaked_fragment else "no"


def _verdict(side: ReplaySide) -> str:
    if side.leaked:
        return "LEAK: HTTP 200 built from another tenant's KV"
    if side.clean_error:
        return "clean error, nothing leaked"
    return "unexpected"
