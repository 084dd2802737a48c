"""The PrometheusRule is generated from the rules file promtool checks, and its rules pass
promtool themselves; the plain Prometheus config beside the rules passes promtool too."""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import DEPLOY, K8S, RULES, documents

RENDER = K8S / "render_rules.py"
RULE_OBJECT = K8S / "kvfence-rules.yaml"
CONFIG = DEPLOY / "prometheus" / "prometheus-kvfence.yml"


def promtool() -> str:
    found = shutil.which("promtool")
    if found:
        return found
    reason = "promtool not installed (make prometheus)"
    if os.environ.get("KVFENCE_REQUIRE_PROMETHEUS") == "1":
        pytest.fail(reason + "; KVFENCE_REQUIRE_PROMETHEUS=1 forbids skipping")
    pytest.skip(reason)


def check_rules(spec: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    rules = tmp_path / "from-prometheusrule.yml"
    rules.write_text(yaml.safe_dump(spec, sort_keys=False))
    return subprocess.run(
        [promtool(), "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )


def test_the_committed_prometheusrule_is_what_the_script_renders() -> None:
    render = runpy.run_path(str(RENDER))["render"]
    assert RULE_OBJECT.read_text() == render(RULES.read_text()), (
        f"{RULE_OBJECT.name} is stale: run python deploy/k8s/render_rules.py"
    )
    check = subprocess.run(
        [sys.executable, str(RENDER), "--check"], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_prometheusrule_holds_exactly_the_checked_rules() -> None:
    (rule,) = documents(RULE_OBJECT)
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(RULES.read_text())


def test_the_prometheusrule_rules_pass_promtool(tmp_path: Path) -> None:
    (rule,) = documents(RULE_OBJECT)
    done = check_rules(rule["spec"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    count = sum(len(g["rules"]) for g in rule["spec"]["groups"])
    assert f"SUCCESS: {count} rules found" in done.stdout, done.stdout


def test_promtool_refuses_a_broken_rule(tmp_path: Path) -> None:
    """The check above can fail: one expression with a dangling operator is refused."""
    (rule,) = documents(RULE_OBJECT)
    rule["spec"]["groups"][0]["rules"][0]["expr"] += " and"
    done = check_rules(rule["spec"], tmp_path)
    assert done.returncode != 0 and "KVPoolBelowContext" in done.stdout + done.stderr


def test_the_plain_prometheus_config_passes_promtool() -> None:
    """Syntax only: full checking would stat the operator-key file, which is the host's."""
    done = subprocess.run(
        [promtool(), "check", "config", "--syntax-only", str(CONFIG)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    config = yaml.safe_load(CONFIG.read_text())
    assert [CONFIG.parent / f for f in config["rule_files"]] == [RULES]
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert "kvfence-guard" in jobs  # what GuardDown looks for
    assert jobs["kvfence-engines"]["authorization"]["type"] == "Bearer"
