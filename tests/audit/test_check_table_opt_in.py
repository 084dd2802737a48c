"""Opt-in checks run only when named: lease_reuse can prove a leak but never a pass."""

from __future__ import annotations

import inspect

from click.testing import CliRunner

from kvfence.audit.check_table import ALL_CHECKS, DEFAULT_CHECKS, EMBEDDED_CHECKS, check_class
from kvfence.audit.cli import _parse_checks
from kvfence.audit.runbook import run_audit


def test_lease_reuse_is_known_but_only_run_when_named() -> None:
    assert "lease_reuse" in ALL_CHECKS and check_class("lease_reuse").name == "lease_reuse"
    # In a default run it would be INCONCLUSIVE on every target without a P/D router, and
    # an inconclusive check blocks the deploy: it must not be in any default.
    assert "lease_reuse" not in DEFAULT_CHECKS and "lease_reuse" not in EMBEDDED_CHECKS
    assert _parse_checks(None) == DEFAULT_CHECKS
    assert _parse_checks("canary,lease_reuse") == ("canary", "lease_reuse")
    assert inspect.signature(run_audit).parameters["checks"].default == DEFAULT_CHECKS


def test_the_checks_help_says_what_runs_by_default() -> None:
    from kvfence.audit.cli import audit

    out = CliRunner().invoke(audit, ["--help"]).output
    assert "lease_reuse" in out and "run only when named" in " ".join(out.split())
