"""`kvfence lab replay`: its output is read, not only printed."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from kvfence.cli import main
from kvfence.lab.profiles import PROFILES
from kvfence.lab.replay import run_replay
from kvfence.lab.scenario import Outcome


def test_replay_mirror_leaks_then_hardened_refuses(lab_checkpoint: Path) -> None:
    replay = run_replay(lab_checkpoint, PROFILES["workers-ai-2026"], seed=11)
    incident, hardened = replay.incident.results[0], replay.hardened.results[0]
    assert incident.b.status == 200 and incident.sentinel in incident.b.text
    assert incident.b.reported_prompt_tokens == incident.b.prompt_tokens
    assert incident.outcome is Outcome.LEAK
    assert hardened.b.status == 400 and hardened.sentinel not in hardened.b.body.__repr__()
    assert "336" in hardened.b.body["error"]["message"]  # names the limit
    assert replay.reproduced
    # the server says it is a lab server, so an audit can never mistake it for production
    assert set(incident.server_info["lab"]["faults"]) == set(
        PROFILES["workers-ai-2026"].faults.names()
    )
    assert hardened.server_info["lab"]["faults"] == []


def test_replay_llama_output_depends_on_other_tenant(lab_checkpoint: Path) -> None:
    replay = run_replay(lab_checkpoint, PROFILES["workers-ai-2026"], model_kind="llama", seed=12)
    texts = [r.b.text for r in replay.incident.results]
    assert all(r.b.status == 200 for r in replay.incident.results)
    assert (
        texts[0] != texts[1]
    )  # B's greedy answer changed with A's traffic: noninterference broken
    assert replay.hardened.clean_error
    assert replay.reproduced


def test_replay_command_output(lab_checkpoint: Path) -> None:
    result = CliRunner().invoke(
        main,
        ["lab", "replay", "--seed", "7", "--checkpoint", str(lab_checkpoint)],
        env={"COLUMNS": "400"},
    )
    assert result.exit_code == 0, result.output
    sentinel = re.search(r"A's sentinel\s*│\s*(ZQX[A-Z]+)", result.output)
    assert sentinel is not None, result.output
    rows = {
        line.split("│")[1].strip(): line.split("│")[2:4]
        for line in result.output.splitlines()
        if "│" in line
    }
    body = rows["B's body (after A's first traffic)"]
    assert (
        sentinel.group(1) in body[0] and sentinel.group(1) not in body[1]
    )  # incident column vs hardened
    assert rows["HTTP status"][0].strip() == "200" and rows["HTTP status"][1].strip() == "400"
    assert rows["A's data in B's body"][1].strip() == "no"
    assert "reproduced as expected" in result.output
