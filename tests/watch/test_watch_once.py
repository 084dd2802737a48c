"""`kvfence watch --once` prints the false-alarm budget it runs under (issue 11, item 5)."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner
from watch_helpers import hardened

from kvfence.cli import main
from kvfence.lab.scenario import OPERATOR, TENANT_A, TENANT_B


def test_watch_once_prints_the_budget_and_the_alpha_it_derives(checkpoint: Path) -> None:
    with hardened(checkpoint) as (url, keys):
        args = ["watch", "--once", "--target", url, "--key-a", keys[TENANT_A]]
        args += ["--key-b", keys[TENANT_B], "--operator-key", keys[OPERATOR], "--no-timing"]
        default = CliRunner().invoke(main, args)
        chosen = CliRunner().invoke(
            main, [*args, "--false-alarms-per-30d", "3", "--interval", "10"]
        )
    assert default.exit_code == 0, default.output
    # 30 days at 60 s: 43,200 tests; 1 / 43,200 = 2.3e-05 per test.
    assert (
        "false-alarm budget 1 per target per 30 days: 43200 timing tests at 60 s -> "
        "alpha 2.3e-05 per test (union bound)" in default.output
    ), default.output
    assert chosen.exit_code == 0, chosen.output
    # 259,200 tests at 10 s; 3 / 259,200 = 1.2e-05.
    assert (
        "false-alarm budget 3 per target per 30 days: 259200 timing tests at 10 s -> "
        "alpha 1.2e-05 per test" in chosen.output
    ), chosen.output
    assert f"{url}: pass: facts known" in default.output
