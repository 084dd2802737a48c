"""`kvfence watch`: the guard's command line and its top loop."""

from __future__ import annotations

import sys
import time

import click
from prometheus_client import start_http_server

from kvfence.audit.base import Verdict, worst
from kvfence.audit.key_options import key_a_option, key_b_option, operator_key_option
from kvfence.audit.targets.registry import ENGINE_CHOICES
from kvfence.audit.tenant_keys import second_key_missing
from kvfence.watch.guard import GuardConfig, Interval, Keys, TargetGuard
from kvfence.watch.metrics import WatchMetrics

_DEFAULTS = GuardConfig()


def verdict_of(out: Interval) -> Verdict:
    """An interval as the audit would grade it (facts unknown: inconclusive, never pass)."""
    if out.crossed or out.too_fast:
        return Verdict.FAIL
    if not out.facts_known or out.error:  # unknown facts, or a probe that failed: not a pass
        return Verdict.INCONCLUSIVE
    return worst([r.verdict for r in (out.gate, out.boundary) if r is not None] or [Verdict.PASS])


def report(url: str, out: Interval) -> None:
    state = "facts known" if out.facts_known else f"FACTS UNKNOWN ({out.error})"
    if out.facts_known and out.error:
        state += f"; PROBE FAILED ({out.error})"
    click.echo(f"{url}: {verdict_of(out).value}: {state}")
    if out.facts is not None:
        for name in ("pool_tokens", "context_length"):
            fact = getattr(out.facts, name)
            note = f"; {fact.note}" if fact.note else ""
            click.echo(f"  {name}: {fact.value} ({fact.source}{note})")
    for change in out.changed:
        click.echo(f"  changed: {change}")
    for r in (out.gate, out.boundary):
        if r is not None:
            click.echo(f"  {r.check}: {r.verdict.value}: {r.summary}")
    for note in out.notes:
        click.echo(f"  {note}")


def parse_listen(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise click.BadParameter(
            f"{addr!r}: expected HOST:PORT (port 0 = any)", param_hint="--listen"
        )
    return host or "127.0.0.1", int(port)


@click.command("watch")
@click.option("--target", "targets", multiple=True, required=True, help="engine base URL (repeat)")
@click.option("--engine", type=click.Choice(ENGINE_CHOICES), default="auto", show_default=True)
@key_a_option
@key_b_option
@operator_key_option
@click.option(
    "--interval", type=click.FloatRange(0.1), default=_DEFAULTS.interval_s, show_default=True
)
@click.option(
    "--requests-per-minute",
    type=click.IntRange(1),
    default=_DEFAULTS.requests_per_minute,
    show_default=True,
    help="the most probe requests per target per minute (a gate re-run on a change always runs)",
)
@click.option(
    "--headroom", type=click.FloatRange(1.0), default=_DEFAULTS.headroom, show_default=True
)
@click.option(
    "--false-alarms-per-30d",
    type=click.FloatRange(min=0, min_open=True),
    default=_DEFAULTS.false_alarms_per_30d,
    show_default=True,
    help="false timing alarms allowed per target per 30 days; sets each test's alpha",
)
@click.option(
    "--max-target-share",
    type=click.FloatRange(0, 1, min_open=True),
    default=_DEFAULTS.max_target_share,
    show_default=True,
    help="the most of a target's time the canary and timing rounds may take (rounds are spaced); "
    "a gate re-run on a change always runs",
)
@click.option("--listen", default=None, help="HOST:PORT for the guard's own /metrics")
@click.option("--once", is_flag=True, help="one interval, then exit 0 pass, 1 fail, 2 inconclusive")
@click.option("--no-canary", is_flag=True, help="send no canary pairs")
@click.option("--no-timing", is_flag=True, help="send no timing probes")
def watch(
    targets: tuple[str, ...],
    engine: str,
    key_a: str | None,
    key_b: str | None,
    operator_key: str | None,
    interval: float,
    requests_per_minute: int,
    headroom: float,
    false_alarms_per_30d: float,
    max_target_share: float,
    listen: str | None,
    once: bool,
    no_canary: bool,
    no_timing: bool,
) -> None:
    """Guard running engines: re-gate on every capacity change, canaries, prefill floor."""
    config = GuardConfig(
        interval,
        requests_per_minute,
        headroom,
        not no_canary,
        not no_timing,
        false_alarms_per_30d,
        max_target_share,
    )
    metrics = WatchMetrics()
    if (lacking := second_key_missing(key_a, key_b)) is not None:
        raise click.UsageError(lacking)
    keys = Keys(key_a, key_b, operator_key)
    guards = [TargetGuard(url.rstrip("/"), engine, keys, config, metrics) for url in targets]
    if listen is not None:
        host, port = parse_listen(listen)
        server, _ = start_http_server(port, host, registry=metrics.registry)
        click.echo(f"guard metrics at http://{host}:{server.server_port}/metrics", err=True)
    click.echo(
        f"watching {len(guards)} target(s) every {interval:g} s, "
        f"at most {requests_per_minute} probe requests per target per minute and "
        f"{max_target_share:.1%} of its time",
        err=True,
    )
    click.echo(config.budget.describe(), err=not once)
    try:
        if once:
            sys.exit(run_once(guards))
        run_forever(guards, interval)
    finally:
        for g in guards:
            g.close()


def run_once(guards: list[TargetGuard]) -> int:
    verdicts = []
    for g in guards:
        out = g.cycle()
        report(g.url, out)
        verdicts.append(verdict_of(out))
    verdict = worst(verdicts)
    return 0 if verdict.decisive_ok else 1 if verdict is Verdict.FAIL else 2


def run_forever(guards: list[TargetGuard], interval: float) -> None:
    """The top loop: every interval, one cycle per target, then sleep out the rest."""
    while True:
        start = time.monotonic()
        for g in guards:
            out = g.cycle()
            if out.changed or out.crossed or out.too_fast or not out.facts_known or out.error:
                report(g.url, out)
        time.sleep(max(0.0, interval - (time.monotonic() - start)))
