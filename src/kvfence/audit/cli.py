"""`kvfence audit`: the runbook against live engines; the verdict is the exit code.

Exit codes: 0 every check passed, 1 a check failed (a leak or a violated
invariant was observed), 2 inconclusive (a fact could not be read or a probe
could not run) — with `--fail-on-inconclusive` (the default). Usage errors
are click's exit code 2 as well, printed with "Usage:".

Without `--target` the embedded default is audited: `EMBEDDED_HOOK` names the
function that starts kvfence's own servers (the incident lab and the hardened
engine, as `kvfence serve` processes) and audits them side by side; the HTML
report then goes to a temporary path that is printed unless `--report` says
where. `runbook.audit_server(url, key_a, key_b)` audits any one started server.
"""

from __future__ import annotations

import importlib
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvfence.audit import report
from kvfence.audit.base import DEFAULT_ALPHA, DEFAULT_HEADROOM, Budget, CheckResult
from kvfence.audit.check_table import ALL_CHECKS, DEFAULT_CHECKS, EMBEDDED_CHECKS, OPT_IN_CHECKS
from kvfence.audit.contract import AuditContext
from kvfence.audit.key_options import key_a_option, key_b_option, operator_key_option
from kvfence.audit.runbook import AuditRun, run_audit
from kvfence.audit.target_names import TargetSpec, TargetSpecError, named_targets
from kvfence.audit.targets.registry import ENGINE_CHOICES
from kvfence.audit.tenant_keys import second_key_missing
from kvfence.extras import MISSING_EXTRA_EXIT, engine_missing

# "module:function" of the embedded-default runner:
#   (checks, headroom, seed, progress, budget, on_result, alpha) -> AuditRun
EMBEDDED_HOOK = "kvfence.audit.embedded:audit_embedded"


def _parse_checks(value: str | None, default: tuple[str, ...] = DEFAULT_CHECKS) -> tuple[str, ...]:
    if not value:
        return default
    names = tuple(n.strip().replace("-", "_") for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in ALL_CHECKS]
    if unknown:
        raise click.UsageError(
            f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(ALL_CHECKS)}"
        )
    return names


def _embedded_runner() -> Callable[..., AuditRun] | None:
    module, _, func = EMBEDDED_HOOK.partition(":")
    try:
        runner = getattr(importlib.import_module(module), func, None)
    except ModuleNotFoundError:
        return None
    return runner if callable(runner) else None


class _AuditGroup(click.Group):
    """`kvfence audit latency --from-log FILE` (the statistical checks' log mode) is imported
    only when invoked: it pulls in scipy, which the runbook needs only once its checks load
    (the embedded default loads them while its servers start)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), "latency"})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name != "latency":
            return super().get_command(ctx, cmd_name)
        try:
            from kvfence.audit.checks.latency.check import latency_command
        except ImportError:  # not part of this build
            return None
        return latency_command


@click.group(cls=_AuditGroup, invoke_without_command=True)
@click.option(
    "--target",
    "targets",
    multiple=True,
    metavar="[NAME=]URL",
    help="engine base URL, optionally named for the reports (repeat for several engines)",
)
@click.option("--engine", type=click.Choice(ENGINE_CHOICES), default="auto", show_default=True)
@key_a_option
@key_b_option
@operator_key_option
@click.option(
    "--checks",
    default=None,
    help=f"comma-separated subset of: {', '.join(ALL_CHECKS)} "
    f"(default: all but {', '.join(OPT_IN_CHECKS)}, which run only when named)",
)
@click.option(
    "--worker",
    "workers",
    multiple=True,
    help="a fleet worker's own URL to probe beside the target (repeat); a router's listed "
    "workers are probed without it",
)
@click.option("--context", "context", type=int, default=None, help="context length to gate on")
@click.option("--headroom", type=float, default=DEFAULT_HEADROOM, show_default=True)
@click.option("--report", "html_out", type=click.Path(dir_okay=False), default=None)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None)
@click.option("--junit", "junit_out", type=click.Path(dir_okay=False), default=None)
@click.option("--max-requests", type=int, default=5000, show_default=True)
@click.option("--max-seconds", type=float, default=900.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--alpha",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=DEFAULT_ALPHA,
    show_default=True,
    help="family-wise false-alarm rate per target, split over the statistical checks",
)
@click.option("--quiet", is_flag=True, help="no progress, only the summary line")
@click.option(
    "--fail-on-inconclusive/--no-fail-on-inconclusive",
    default=True,
    show_default=True,
    help="exit 2 when a check is inconclusive (fail closed)",
)
@click.pass_context
def audit(
    ctx: click.Context,
    targets: tuple[str, ...],
    engine: str,
    key_a: str | None,
    key_b: str | None,
    operator_key: str | None,
    checks: str | None,
    workers: tuple[str, ...],
    context: int | None,
    headroom: float,
    html_out: str | None,
    json_out: str | None,
    junit_out: str | None,
    max_requests: int,
    max_seconds: float,
    seed: int,
    alpha: float,
    quiet: bool,
    fail_on_inconclusive: bool,
) -> None:
    """Audit engines for cross-tenant leaks: exit 0 pass, 1 fail, 2 inconclusive."""
    if ctx.invoked_subcommand is not None:
        return
    names = _parse_checks(checks, DEFAULT_CHECKS if targets else EMBEDDED_CHECKS)
    if headroom < 1.0:
        raise click.UsageError(f"--headroom must be >= 1, got {headroom}")
    if context is not None and context <= 0:
        raise click.UsageError(f"--context must be positive, got {context}")
    # CI logs are not terminals: give the summary table room instead of rich's 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 140)
    budget = Budget(max_requests=max_requests, max_seconds=max_seconds)
    try:
        specs = named_targets(targets)
    except TargetSpecError as e:
        raise click.BadParameter(str(e), param_hint="--target") from None
    if specs and (lacking := second_key_missing(key_a, key_b)) is not None:
        raise click.UsageError(lacking)
    if specs:
        actx = AuditContext(
            key_a=key_a,
            key_b=key_b,
            operator_key=operator_key,
            headroom=headroom,
            context_override=context,
            budget=budget,
            seed=seed,
            quiet=quiet,
            alpha=alpha,
            workers=workers,
        )
        body = _on_targets(actx, specs, engine, names)
        run = _with_progress(body, len(targets) * len(names), quiet, console)
    else:
        body = _on_embedded(console, names, headroom, seed, budget, alpha)
        if html_out is None:
            html_out = str(Path(tempfile.mkdtemp(prefix="kvfence-audit-")) / "report.html")
        run = _with_progress(body, 2 * len(names), quiet, console)
    finish(run, console, html_out, json_out, junit_out, quiet, fail_on_inconclusive)


ProgressFn = Callable[[str, float | None], None]
ResultFn = Callable[[CheckResult], None]
AuditBody = Callable[[ProgressFn | None, ResultFn | None], AuditRun]


def _on_targets(
    actx: AuditContext, targets: tuple[TargetSpec, ...], engine: str, names: tuple[str, ...]
) -> AuditBody:
    def run_targets(progress: ProgressFn | None, on_result: ResultFn | None) -> AuditRun:
        if progress is not None:
            actx.progress = progress
        with actx.open():
            return run_audit(targets, actx, engine=engine, checks=names, on_result=on_result)

    return run_targets


def _on_embedded(
    console: Console,
    names: tuple[str, ...],
    headroom: float,
    seed: int,
    budget: Budget,
    alpha: float,
) -> AuditBody:
    """The embedded default (no --target): a kvfence server this command starts itself."""
    if (missing := engine_missing()) is not None:  # the embedded servers run kvfence's engine
        # click, not rich: rich would read the extra's brackets as markup
        click.echo(missing.hint("kvfence audit without --target (the embedded demo)"), err=True)
        click.echo("or audit a running engine: kvfence audit --target URL", err=True)
        sys.exit(MISSING_EXTRA_EXIT)
    runner = _embedded_runner()
    if runner is None:
        console.print(
            "no --target given and the embedded default is not available in this build: "
            "start `kvfence serve` and pass --target URL"
        )
        sys.exit(2)

    def run_embedded(progress: ProgressFn | None, on_result: ResultFn | None) -> AuditRun:
        return runner(
            checks=names,
            headroom=headroom,
            seed=seed,
            progress=progress,
            budget=budget,
            on_result=on_result,
            alpha=alpha,
        )

    return run_embedded


def _with_progress(
    body: AuditBody,
    total: int,
    quiet: bool,
    console: Console,
) -> AuditRun:
    """Run `body` under a rich progress display (or silently with --quiet)."""
    if quiet:
        return body(None, None)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        overall = progress.add_task("audit", total=total)
        step = progress.add_task("", total=1.0)

        def on_progress(message: str, fraction: float | None) -> None:
            progress.update(step, description=message, completed=fraction or 0.0)

        def on_result(res: CheckResult) -> None:
            progress.advance(overall)
            where = escape(res.target_name or res.target)
            progress.console.print(f"  {res.check} on {where}: {res.verdict.value}")

        return body(on_progress, on_result)


def finish(
    run: AuditRun,
    console: Console,
    html_out: str | None,
    json_out: str | None,
    junit_out: str | None,
    quiet: bool,
    fail_on_inconclusive: bool,
) -> None:
    """Write the reports, print the summary, exit with the verdict."""
    if json_out:
        report.write_json(run, json_out, fail_on_inconclusive)
    if junit_out:
        report.write_junit(run, junit_out)
    if html_out:
        report.write_html(run, html_out, fail_on_inconclusive)
    code = run.exit_code(fail_on_inconclusive)
    if quiet:
        click.echo(report.quiet_line(run, fail_on_inconclusive))
    else:
        report.print_summary(run, console, fail_on_inconclusive)
    for label, path in (("HTML report", html_out), ("JSON", json_out), ("JUnit", junit_out)):
        if path:
            click.echo(f"{label}: {path}")
    sys.exit(code)
