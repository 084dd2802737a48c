"""The pre-deploy jobs in deploy/ci parse as YAML, call only kvfence commands and flags that
exist, and publish the JUnit file the audit writes."""

from __future__ import annotations

import shlex
from typing import Any

import click
import pytest
import yaml
from click.testing import CliRunner
from deploy_files import DEPLOY, kvfence_lines, parse_kvfence

from kvfence.cli import main

CI = DEPLOY / "ci"


def github_scripts(workflow: dict[str, Any]) -> list[str]:
    return [s["run"] for job in workflow["jobs"].values() for s in job["steps"] if "run" in s]


def gitlab_scripts(pipeline: dict[str, Any]) -> list[str]:
    return [
        line for job in pipeline.values() if isinstance(job, dict) for line in job.get("script", [])
    ]


def audit_commands(scripts: list[str]) -> list[dict[str, Any]]:
    found = []
    for script in scripts:
        for line in kvfence_lines(script):
            parsed = parse_kvfence(shlex.split(line))
            assert parsed.path == ("audit",), line
            found.append(parsed.params)
    return found


def test_the_github_workflow_audits_and_publishes_its_junit_file() -> None:
    workflow = yaml.safe_load((CI / "github-actions.yml").read_text())
    (audit,) = audit_commands(github_scripts(workflow))
    assert audit["targets"] and audit["fail_on_inconclusive"]
    steps = workflow["jobs"]["audit"]["steps"]
    published = [s for s in steps if s.get("uses", "").startswith("mikepenz/action-junit-report@")]
    assert [s["with"]["report_paths"] for s in published] == [audit["junit_out"]]
    # Published whatever the verdict: a failing audit is when the report matters most.
    assert all(s["if"] == "${{ !cancelled() }}" for s in published)
    # PyYAML reads the bare key `on` as True (YAML 1.1); GitHub reads it as the trigger list.
    assert {"workflow_call", "workflow_dispatch"} <= set(workflow[True])


def test_the_gitlab_job_audits_and_publishes_its_junit_file() -> None:
    pipeline = yaml.safe_load((CI / "gitlab-ci.yml").read_text())
    (audit,) = audit_commands(gitlab_scripts(pipeline))
    job = pipeline["kvfence-audit"]
    assert job["artifacts"]["reports"]["junit"] == audit["junit_out"]
    assert job["artifacts"]["when"] == "always"
    assert audit["junit_out"] in job["artifacts"]["paths"]


def test_each_called_command_is_listed_by_kvfence_help() -> None:
    listed = CliRunner().invoke(main, ["--help"]).output
    github = yaml.safe_load((CI / "github-actions.yml").read_text())
    gitlab = yaml.safe_load((CI / "gitlab-ci.yml").read_text())
    lines = [
        line for s in github_scripts(github) + gitlab_scripts(gitlab) for line in kvfence_lines(s)
    ]
    assert len(lines) == 2
    for line in lines:
        assert f"  {shlex.split(line)[1]} " in listed, line


@pytest.mark.parametrize(
    "line",
    [
        "kvfence audit --target x=http://h:1 --junit-file a.xml",  # no such flag
        "kvfence audits --target x=http://h:1",  # no such command
        "kvfence audit --target x=http://h:1 --max-seconds soon",  # not a number
    ],
)
def test_the_command_check_refuses_what_kvfence_would(line: str) -> None:
    """The checks above can fail: what the CLI refuses, the parser refuses too."""
    with pytest.raises(click.UsageError):
        parse_kvfence(shlex.split(line))
    result = CliRunner().invoke(main, shlex.split(line)[1:])
    assert result.exit_code == 2, result.output
